"""Where `qlora export` puts its result: the folder built under a temporary name is renamed to --out
only in a way that loses none of the user's files."""

from __future__ import annotations

import errno
from pathlib import Path

from qlora_cli.core.errors import QLoraError

_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR)


def move_into_place(temp: Path, out: Path) -> None:
    """Rename the finished export to --out. The OS renames a folder only onto a missing or empty one,
    checked in the same step, so files put in --out while the export ran are never replaced."""
    try:
        temp.rename(out)
    except OSError as err:
        if err.errno not in _TAKEN:
            raise
        raise QLoraError(
            f"--out {out} was filled while the export ran (it was new or empty at the start); it is left "
            "as it is and the export discarded; choose a new folder or add --force to replace it"
        ) from None
