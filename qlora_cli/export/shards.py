"""A merged export as the Hugging Face folder `from_pretrained` loads: safetensors shards of bounded
size written as the merged weights stream past, their index, and the base's config files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.files import save_tensors, write_json
from qlora_cli.export.merge import DTYPES, Merge, merged_checkpoint
from qlora_cli.sources.hf_files import GENERATION_CONFIG, MODEL_CONFIG, PROCESSOR_FILES, SAFETENSORS_INDEX

SAFETENSORS_METADATA = {"format": "pt"}
# A vision-language base's image and video preprocessing, which its merged model needs beside it.

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """Bytes from '5GB', '500MB' (powers of 1000) or '2GiB' (powers of 1024), as Hugging Face reads them."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise QLoraError(f"--max-shard-size: expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


class ShardWriter:
    """Collects tensors into shards of at most `max_bytes` (a larger tensor gets a shard of its own).

    Shards are written as they fill, under provisional names, and renamed to model-k-of-n once n is known.
    """

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_size = 0

    def _provisional(self, index: int) -> Path:
        return self.folder / f".model-{index:05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        save_tensors(self.pending, self._provisional(len(self.shards) + 1), metadata=SAFETENSORS_METADATA)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Write the last shard, name every shard k-of-n and write the index; returns n."""
        if self.pending:
            self._flush()
        count = len(self.shards)
        weight_map = {}
        for index, names in enumerate(self.shards, start=1):
            final = f"model-{index:05d}-of-{count:05d}.safetensors"
            self._provisional(index).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        write_json(self.folder / SAFETENSORS_INDEX, index_file)
        return count


def _base_config(folder: Path, dtype: str) -> dict:
    """The base's config.json for a plain (unquantized) model in the export dtype."""
    config = json.loads((folder / MODEL_CONFIG).read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    return config


def write_merged(folder: Path, merge: Merge, dtype: str, max_bytes: int) -> int:
    """Stream the base, merge each tensor as it passes, write shards."""
    writer = ShardWriter(folder, max_bytes)
    for name, tensor in merged_checkpoint(merge):
        writer.add(name, tensor.to(DTYPES[dtype]))
    shards = writer.finish()
    base_folder = merge.base_folder
    write_json(folder / MODEL_CONFIG, _base_config(base_folder, dtype))
    for name in (GENERATION_CONFIG, *PROCESSOR_FILES):
        if (base_folder / name).is_file():
            shutil.copyfile(base_folder / name, folder / name)
    return shards
