"""Where `qlora export` puts its result: the folder built under a temporary name is renamed to --out
in a way that loses no file the user did not ask to replace, and never the export itself; what an
export killed midway left beside --out is removed by the next one."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, reason
from qlora_cli.core.wording import byte_size

_TAKEN = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR)


def out_path(given: str | Path) -> Path:
    """--out as a path; an empty one is refused, as Path("") would be the current folder."""
    if str(given) == "":
        raise QLoraError("--out is empty; give the folder to write the export to")
    return Path(given)


def check_out_path(out: Path) -> None:
    """Refuse up front an --out the export could not end in (a symbolic link, a path under a file),
    rather than after all its work."""
    if out.is_symlink():
        target = os.path.realpath(out)
        raise QLoraError(f"--out {out} is a symbolic link to {target}; give the folder's own path, {target}")
    parent = next((folder for folder in out.parents if folder.exists()), None)
    if parent is not None and not parent.is_dir():
        raise QLoraError(f"--out {out} cannot be made: its parent {parent} is a file, not a folder")


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


def temp_folder(out: Path) -> Path:
    """The hidden folder beside --out that this process builds the export in."""
    return out.with_name(f".{out.name}.tmp-export-{os.getpid()}")


def remove_stale(out: Path) -> list[str]:
    """Delete the folders beside --out that exports to it left when killed midway (their process is
    gone): nothing else ever would, and a merged model's is many GB. Returns a note for each."""
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:tmp|old)-export-(\d+)")
    notes = []
    for path in sorted(out.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and not _running(int(match.group(1))):
            notes.append(_remove_left(path))
    return notes


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_left(folder: Path) -> str:
    size = sum(
        os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(folder) for name in files
    )
    try:
        shutil.rmtree(folder)
    except OSError as err:
        return f"could not remove {folder}, left by an export killed midway: {describe(err, folder)}"
    return f"removed {folder} ({byte_size(size)}), left by an export to the same --out killed midway"
