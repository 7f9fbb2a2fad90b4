"""Where `qlora export` puts its result: the folder built under a temporary name is renamed to --out
in a way that loses no file the user did not ask to replace, and never the export itself."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, reason

_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR)


def check_out_path(out: Path) -> None:
    """Refuse up front an --out that the export could write but not rename into place, before the work
    of an export that would be discarded at the end."""
    if out.is_symlink():
        target = os.path.realpath(out)
        raise QLoraError(f"--out {out} is a symbolic link to {target}; give the folder's own path, {target}")


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


def replace_out(temp: Path, out: Path) -> list[str]:
    """--force: the old --out is renamed aside, the export renamed into place, and only then the old
    folder deleted, so a folder that cannot be deleted whole costs neither --out nor the export. Returns
    notes: where the old folder's remains are, if they stay."""
    aside = out.with_name(f".{out.name}.old-export-{os.getpid()}")
    moved = _move_aside(out, aside)
    try:
        temp.rename(out)
    except OSError:
        if moved:
            aside.rename(out)
        raise
    if not moved:
        return []
    try:
        shutil.rmtree(aside)
    except OSError as err:
        return [
            f"the export replaced --out {out}, but the old folder could not be deleted whole "
            f"({describe(err, aside)}); what is left of it is in {aside}"
        ]
    return []


def _move_aside(out: Path, aside: Path) -> bool:
    """Rename --out to `aside`; False when there is no --out to replace."""
    try:
        out.rename(aside)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise WriteFailed(
            f"--out {out} could not be moved aside to be replaced ({reason(err, out)}); it is left as it "
            "was and the export discarded"
        ) from None
    return True
