"""Checkpoint reading: safetensors shards checked against a ModelSpec and streamed tensor by tensor.

Readers hand tensors over and build nothing: the model decides what to do with each one, so host
memory stays near one tensor however large the checkpoint is. A rewrite in the checkpoint's own layout
(a merged export) puts a fused tensor back together from its experts' matrices, one stored tensor at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import count
from qlora_cli.sources.hf_files import SAFETENSORS_INDEX
from qlora_cli.sources.spec import DECODER_PREFIX, TEXT_LAYOUT, VISION_LANGUAGE_LAYOUT, ModelSpec


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise QLoraError(f"{index} is not a valid safetensors index: {err}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QLoraError(f"model folder {folder} has no safetensors weights")
    for file in files:
        if not file.is_file():
            raise QLoraError(f"safetensors shard {file} named by the index is missing")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise QLoraError(f"{file} is not a valid safetensors file (truncated or corrupt?): {err}") from None


# Tensors of a checkpoint that qlora does not train and never reads: a vision-language checkpoint's vision
# tower, and Qwen3.5's multi-token-prediction head, by the prefix of their names.
SKIPPED_PARTS = {"model.visual.": "vision-tower", "mtp.": "MTP", "model.mtp.": "MTP"}


def canonical_name(stored: str) -> str:
    """The name a tensor streams under: a vision-language checkpoint's text decoder moves from
    `model.language_model.` to `model.`, where a causal LM keeps it."""
    prefix = DECODER_PREFIX[VISION_LANGUAGE_LAYOUT]
    return DECODER_PREFIX[TEXT_LAYOUT] + stored.removeprefix(prefix) if stored.startswith(prefix) else stored


def _skipped_part(stored: str) -> str | None:
    return next((part for prefix, part in SKIPPED_PARTS.items() if stored.startswith(prefix)), None)


# A MoE layer's routed experts stored fused, all experts in one 3-D tensor (as transformers 5 holds them):
# gate_up_proj [E, 2·I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I]. Each
# expert's matrices stream as the per-expert names, read one expert at a time: (name, chunk of chunks).
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
_FUSED_PARTS = {"gate_up_proj": (("gate_proj", 0, 2), ("up_proj", 1, 2)), "down_proj": (("down_proj", 0, 1),)}


@dataclass(frozen=True)
class ExpertSlice:
    """A per-expert tensor read from a fused one: its `expert`'s matrix, rows split in `chunks`."""

    expert: int
    chunk: int
    chunks: int


@dataclass(frozen=True)
class TensorLocations:
    """Where each tensor the spec needs is stored: file → {streamed name: name in the file}, in
    stream order; how many tensors of each skipped part (vision tower, MTP) were left unread, and
    their stored names file by file (a merged export carries them over). A routed expert's matrix read
    from a fused 3-D tensor has its slice in `expert_slices`."""

    by_file: dict[Path, dict[str, str]]
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_by_file: dict[Path, list[str]] = field(default_factory=dict)
    expert_slices: dict[str, ExpertSlice] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for names in self.by_file.values() for name in names]

    def note(self) -> str | None:
        """One line for the user when parts of the checkpoint are not trained, else None."""
        if not self.skipped:
            return None
        parts = " and ".join(count(tensors, f"{part} tensor") for part, tensors in self.skipped.items())
        return f"skipped {parts} of the checkpoint (not trained; qlora trains the text decoder)"


def _fused_experts(name: str, spec: ModelSpec) -> tuple[tuple[int, ...], dict[str, ExpertSlice]] | None:
    """For a fused routed-experts tensor of a MoE layer: its expected shape and the per-expert names it
    holds, with their slices; None for any other name."""
    match = _FUSED_EXPERTS.fullmatch(name)
    if match is None or spec.moe is None:
        return None
    prefix, fused = match.groups()
    experts = spec.moe.num_experts
    parts: dict[str, ExpertSlice] = {}
    for expert in range(experts):
        for proj, chunk, chunks in _FUSED_PARTS[fused]:
            parts[f"{prefix}.{expert}.{proj}.weight"] = ExpertSlice(expert, chunk, chunks)
    out, inp = spec.moe.expert_tensors(spec.hidden_size)[_FUSED_PARTS[fused][0][0]]
    rows = out * len(_FUSED_PARTS[fused])
    return (experts, rows, inp), parts


def check_tensors(files: list[Path], spec: ModelSpec) -> TensorLocations:
    """Read only the headers: every expected tensor present once with its shape, under either layout;
    routed experts stored per expert or fused."""
    expected = spec.expected_tensors()
    by_file: dict[Path, dict[str, str]] = {}
    stored_as: dict[str, str] = {}
    skipped: dict[str, int] = {}
    skipped_by_file: dict[Path, list[str]] = {}
    expert_slices: dict[str, ExpertSlice] = {}
    for file in files:
        with _open(file) as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = _skipped_part(stored)
                if part is not None:
                    skipped[part] = skipped.get(part, 0) + 1
                    skipped_by_file.setdefault(file, []).append(stored)
                    continue
                name = canonical_name(stored)
                fused = _fused_experts(name, spec)
                if fused is not None and next(iter(fused[1])) in expected:
                    shape, parts = fused
                    stored_shape = tuple(f.get_slice(stored).get_shape())
                    if stored_shape != shape:
                        raise QLoraError(
                            f"{file.name}: tensor {stored} has shape {list(stored_shape)}, "
                            f"expected {list(shape)} from config.json"
                        )
                    for part_name, piece in parts.items():
                        if part_name in stored_as:
                            raise QLoraError(
                                f"checkpoint holds {part_name} twice, as {stored_as[part_name]} and {stored}"
                            )
                        stored_as[part_name] = stored
                        by_file.setdefault(file, {})[part_name] = stored
                        expert_slices[part_name] = piece
                    continue
                if name not in expected:
                    continue
                if name in stored_as:
                    raise QLoraError(f"checkpoint holds {name} twice, as {stored_as[name]} and {stored}")
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != expected[name]:
                    raise QLoraError(
                        f"{file.name}: tensor {stored} has shape {list(shape)}, "
                        f"expected {list(expected[name])} from config.json"
                    )
                stored_as[name] = stored
                by_file.setdefault(file, {})[name] = stored
    missing = [name for name in expected if name not in stored_as]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise QLoraError(f"checkpoint is missing tensor {missing[0]}{more}")
    return TensorLocations(by_file, skipped, skipped_by_file, expert_slices)


def locate_tensors(folder: Path, spec: ModelSpec) -> TensorLocations:
    """The tensors the spec needs, file by file, in the order `stream_tensors` yields them; reads headers
    only, so a writer that must declare every tensor before the data (GGUF) can do so, and a caller can
    print the note on skipped parts before any weights load."""
    return check_tensors(shard_files(folder), spec)


def _share(matrix: torch.Tensor, piece: ExpertSlice) -> torch.Tensor:
    """The rows of one expert's matrix of a fused tensor that are `piece`'s (a view where it can be)."""
    return matrix.chunk(piece.chunks, dim=0)[piece.chunk]


def _read(f, file: Path, stored: str, piece: ExpertSlice | None = None) -> torch.Tensor:
    try:
        if piece is None:
            return f.get_tensor(stored)
        # One expert's rows of the fused tensor, then its share of them.
        return _share(f.get_slice(stored)[piece.expert], piece).contiguous()
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise QLoraError(f"{file}: cannot read tensor {stored} (truncated or corrupt?): {err}") from None


def stream_tensors(folder: Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor the spec needs, one at a time, shard by shard, named as a
    causal LM names them (`model.layers.N....`) whatever the checkpoint's layout."""
    locations = locate_tensors(folder, spec)
    for file, names in locations.by_file.items():
        with _open(file) as f:
            for name, stored in names.items():
                yield name, _read(f, file, stored, locations.expert_slices.get(name))


Change = Callable[[str, torch.Tensor], torch.Tensor]


def _rewrite(
    f, file: Path, stored: str, names: list[str], slices: dict[str, ExpertSlice], change: Change
) -> torch.Tensor:
    """The stored tensor with `change` applied to what stream_tensors reads of it: the tensor itself, or
    each routed expert's matrix of a fused one, read and changed alone (as training quantizes it) and put
    back in its place."""
    if names[0] not in slices:
        return change(names[0], _read(f, file, stored))
    fused = None
    for name in names:
        changed = change(name, _read(f, file, stored, slices[name]))
        if fused is None:
            fused = changed.new_empty(f.get_slice(stored).get_shape())
        _share(fused[slices[name].expert], slices[name]).copy_(changed)
    return fused


def rewrite_checkpoint(folder: Path, spec: ModelSpec, change: Change) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name in the checkpoint, tensor) for the tensors the spec needs, each as `change(name as
    stream_tensors gives it, tensor)` makes it, and those of the skipped parts unchanged, one stored
    tensor at a time, shard by shard: the checkpoint in its own layout, for a writer that keeps it."""
    locations = locate_tensors(folder, spec)
    for file in dict.fromkeys([*locations.by_file, *locations.skipped_by_file]):
        read_as: dict[str, list[str]] = {}
        for name, stored in locations.by_file.get(file, {}).items():
            read_as.setdefault(stored, []).append(name)
        with _open(file) as f:
            for stored, names in read_as.items():
                yield stored, _rewrite(f, file, stored, names, locations.expert_slices, change)
            for stored in locations.skipped_by_file.get(file, []):
                yield stored, _read(f, file, stored)
