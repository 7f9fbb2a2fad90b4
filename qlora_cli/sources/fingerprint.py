"""What identifies a local base model without reading all of it: its weights (each safetensors file's size,
its header, and the first and last 4 KiB of every tensor in it), what its config.json makes the model
compute, and its tokenizer files.

A checkpoint records this, so a base folder that moved (or was copied to another machine) can be
recognised as the one the run trained on, and a different model refused. A few MiB are read even for a
model of 100 GB; another model of the same shape (a fine-tune, another revision) differs in the values of
every tensor and so in these bytes. An edit inside a tensor that spares its first and last 4 KiB is not
seen. The same weights under another config.json (rope_theta, rope_scaling, rms_norm_eps, how q_proj
splits into heads, ...) compute another model, so the record keeps every ModelSpec field that decides
what the layers compute, as read from config.json; a changed tokenizer or chat template only changes how
text becomes ids, which the caller notes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.tokenizer import FILES_READ
from qlora_cli.sources.weights import shard_files

# Names how the digests were taken: a record made another way cannot be compared, only re-made.
METHOD = "safetensors header + first and last 4 KiB of each tensor, SHA-256"
TENSOR_END_BYTES = 4096
# ModelSpec fields that decide nothing the layers compute: the dtype config.json declares (the safetensors
# headers hold the stored one) and the context length (a longer one changes no position below the old).
_NOT_COMPUTED = ("dtype", "max_position_embeddings")
# ModelSpec fields that config.json spells otherwise, so that a refusal names the key to look at.
_CONFIG_KEYS = {
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_layers": "num_hidden_layers",
}


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


def computed_fields(spec: ModelSpec) -> dict:
    """The spec's fields that decide what the model computes, as JSON values; nested ones (rope_scaling,
    linear_attention) by dotted name, so that a difference names the one field."""
    fields: dict = {}

    def add(name: str, value) -> None:
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                add(f"{name}.{field.name}", getattr(value, field.name))
        else:
            fields[name] = list(value) if isinstance(value, tuple) else value

    for field in dataclasses.fields(spec):
        if field.name not in _NOT_COMPUTED:
            add(_CONFIG_KEYS.get(field.name, field.name), getattr(spec, field.name))
    return fields


def _tokenizer_digests(folder: Path) -> dict[str, str | None]:
    """SHA-256 of each tokenizer file the tokenizer reads, None for one the folder lacks."""
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() if (folder / name).is_file() else None
        for name in FILES_READ
    }


def base_fingerprint(folder: Path) -> dict:
    """The fingerprint of a model folder: its safetensors weights file by file, the fields of its
    config.json that decide what it computes, and its tokenizer files."""
    folder = Path(folder)
    return {
        "method": METHOD,
        "files": {file.name: _file_digests(file) for file in shard_files(folder)},
        "config": computed_fields(read_spec(folder)),
        "tokenizer": _tokenizer_digests(folder),
    }


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


def config_difference(recorded: dict, current: dict) -> str | None:
    """The first field of config.json that makes the model compute otherwise than the recorded one, with
    both values; None when every field both record agrees (a record from before the config was kept
    holds none)."""
    now = current["config"]
    for name, value in recorded.get("config", {}).items():
        if name in now and now[name] != value:
            return (
                f"config.json's {name} is {json.dumps(now[name])} where the trained-on one had "
                f"{json.dumps(value)}"
            )
    return None


def tokenizer_difference(recorded: dict, current: dict) -> str | None:
    """Which tokenizer files differ from the recorded ones, in a few words; None when none does (or the
    record holds none)."""
    before, now = recorded.get("tokenizer"), current["tokenizer"]
    if before is None:
        return None
    changes = []
    for name in FILES_READ:
        if before.get(name) == now.get(name):
            continue
        if now.get(name) is None:
            changes.append(f"no {name}")
        elif before.get(name) is None:
            changes.append(f"{name} added")
        else:
            changes.append(f"another {name}")
    return ", ".join(changes) or None
