"""A checkpoint's manifest: the size and SHA-256 of every file in it, written last inside the atomic save.

Parsing a file back only finds damage to its structure: a disk, a copy or a sync that changes bytes inside
a tensor leaves a safetensors file that loads. The manifest finds any changed byte before a checkpoint is
trusted. Checkpoints written before manifests have none, and are read as they were; the trainer state of
every later one says it was written with one, so that one which lost its manifest is found damaged.
"""

from __future__ import annotations

import json
from pathlib import Path

from qlora_cli.core.files import sha256_file, write_json
from qlora_cli.rundir.names import MANIFEST_FILE

# Checkpoints found intact in this process, by their files' (name, size, mtime) as they were then: a
# command reads a checkpoint several times, and hashes it once.
_intact: set[tuple] = set()


def write_manifest(folder: Path) -> None:
    """Record every file in folder (written and closed) in its manifest."""
    files = {
        entry.name: {"size": entry.stat().st_size, "sha256": sha256_file(entry)}
        for entry in sorted(Path(folder).iterdir())
        if entry.is_file() and entry.name != MANIFEST_FILE
    }
    write_json(Path(folder) / MANIFEST_FILE, {"files": files})


def has_manifest(folder: Path) -> bool:
    return (Path(folder) / MANIFEST_FILE).is_file()


def _signature(folder: Path, names) -> tuple:
    stats = [(name, (folder / name).stat()) for name in sorted(names)]
    return (str(folder.resolve()), *((name, s.st_size, s.st_mtime_ns, s.st_ino) for name, s in stats))


def manifest_problem(folder: Path) -> str | None:
    """The first file of the checkpoint that differs from its manifest (missing, resized or other bytes),
    or None when every one matches. Call only where has_manifest(folder)."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        recorded = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path} is corrupt: {err}"
    missing = [name for name in recorded if not (folder / name).is_file()]
    if missing:
        return f"checkpoint {folder} is incomplete: {missing[0]} is missing"
    signature = _signature(folder, recorded)
    if signature in _intact:
        return None
    for name, (size, sha256) in recorded.items():
        file = folder / name
        actual = file.stat().st_size
        if actual != size:
            return f"{file} is corrupt: it holds {actual} bytes, its manifest recorded {size}"
        if sha256_file(file) != sha256:
            return f"{file} is corrupt: its SHA-256 is not the one its manifest recorded (same size, other bytes)"
    _intact.add(signature)
    return None
