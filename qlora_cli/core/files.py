"""Writing files that survive crashes, full disks and odd umasks.

A file that matters is written under a temporary name, fsynced, and renamed over its final name, so a
reader finds the old version or the new one, never half of one. Any failure of the operating system
comes back as an OSError that names the file, whichever library wrote it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

_RUST_IO_ERROR = re.compile(r"I/O error: (.*) \(os error (\d+)\)")


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """safetensors creates its files with mode 0600; give them the mode every other new file gets."""
    os.chmod(path, 0o666 & ~current_umask())


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file; a refused write is an OSError naming `path`, like Python's own writes."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        match = _RUST_IO_ERROR.search(str(err))
        if match is None:
            raise OSError(errno.EIO, str(err), str(path)) from None
        raise OSError(int(match.group(2)), match.group(1), str(path)) from None
    apply_umask(path)


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def sha256_file(path: Path) -> str:
    """The SHA-256 of every byte of a file, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    for file in Path(folder).iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(folder)


def temp_beside(target: Path) -> Path:
    """The name a file is written under before it is renamed over `target`: same folder, hidden."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def check_writable(target: Path) -> None:
    """`target` can be written as a file (its folder made if need be), checked before the work whose
    result it will hold; an existing `target` is left as it is. Raises OSError naming the file."""
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(target))
    if target.parent.exists() and not target.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "is a file, not a folder", str(target.parent))
    target.parent.mkdir(parents=True, exist_ok=True)
    probe = temp_beside(target)
    try:
        probe.open("wb").close()
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(target)) from None
    probe.unlink()


def replace_file(target: Path, data: bytes) -> None:
    """`target` holds `data`, or (after a crash) what it held before; never a mix."""
    target = Path(target)
    temp = temp_beside(target)
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        temp.replace(target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def describe(err: OSError, fallback: Path) -> str:
    """'<file>: <reason>', the file the OS named or else the one being written."""
    return f"{err.filename or fallback}: {err.strerror or err}"


def reason(err: OSError, target: Path) -> str:
    """Why `target` could not be written: the OS's reason, naming the file it names when that is not
    `target` itself (a parent folder)."""
    named = err.filename is not None and Path(err.filename) != Path(target)
    return describe(err, target) if named else (err.strerror or str(err))
