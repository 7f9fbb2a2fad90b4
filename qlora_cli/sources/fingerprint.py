"""What identifies a local base model's weights without reading them all: each safetensors file's size, its
header, and the first and last 4 KiB of every tensor in it.

A checkpoint records this, so a base folder that moved (or was copied to another machine) can be
recognised as the one the run trained on, and a different model refused. A few MiB are read even for a
model of 100 GB; another model of the same shape (a fine-tune, another revision) differs in the values of
every tensor and so in these bytes. An edit inside a tensor that spares its first and last 4 KiB is not
seen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.weights import shard_files

# Names how the digests were taken: a record made another way cannot be compared, only re-made.
METHOD = "safetensors header + first and last 4 KiB of each tensor, SHA-256"
TENSOR_END_BYTES = 4096


def _tensor_ends(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes read of a tensor stored at [begin, end): all of a small one."""
    if end - begin <= 2 * TENSOR_END_BYTES:
        return [(begin, end - begin)]
    return [(begin, TENSOR_END_BYTES), (end - TENSOR_END_BYTES, TENSOR_END_BYTES)]


def _file_digests(file: Path) -> dict:
    with open(file, "rb") as stream:
        header_len = int.from_bytes(stream.read(8), "little")
        header = stream.read(header_len)
        try:
            tensors = json.loads(header)
            spans = sorted(
                tuple(entry["data_offsets"]) for name, entry in tensors.items() if name != "__metadata__"
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise QLoraError(
                f"{file} is not a valid safetensors file (truncated or corrupt?): {err}"
            ) from None
        values = hashlib.sha256()
        for begin, end in spans:
            for offset, length in _tensor_ends(begin, end):
                stream.seek(8 + header_len + offset)
                values.update(stream.read(length))
    return {
        "size": file.stat().st_size,
        "header_sha256": hashlib.sha256(header).hexdigest(),
        "values_sha256": values.hexdigest(),
    }


def weights_fingerprint(folder: Path) -> dict:
    """The fingerprint of the safetensors weights in a model folder, file by file."""
    folder = Path(folder)
    return {"method": METHOD, "files": {file.name: _file_digests(file) for file in shard_files(folder)}}


def weights_difference(recorded: dict, current: dict) -> str | None:
    """How current weights differ from recorded ones, in a few words; None when they are the same (or the
    record was made another way and says nothing)."""
    if recorded.get("method") != current["method"]:
        return None
    before, now = recorded["files"], current["files"]
    if before.keys() != now.keys():
        gone, new = sorted(before.keys() - now.keys()), sorted(now.keys() - before.keys())
        return f"other safetensors files ({', '.join([*(f'no {n}' for n in gone), *(f'{n} added' for n in new)])})"
    for name, entry in before.items():
        other = now[name]
        if entry["size"] != other["size"]:
            return f"{name} has {other['size']} bytes where the trained-on one had {entry['size']}"
        if entry["header_sha256"] != other["header_sha256"]:
            return f"{name} holds other tensors (its header differs)"
        if entry["values_sha256"] != other["values_sha256"]:
            return f"{name} holds other values (the same tensors, other bytes)"
    return None
