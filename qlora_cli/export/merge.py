"""The base's weights with the adapter merged in, one tensor at a time as they stream past, so host
memory stays near one tensor however large the model is."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.model.mlps.expert_lora import expert_matrix_delta
from qlora_cli.rundir.adapter import PREFIX
from qlora_cli.rundir.names import STATE_FILE
from qlora_cli.rundir.trainer_state import TrainerState
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.weights import canonical_name, rewrite_checkpoint, stream_tensors
from qlora_kernels.formats import NF4

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def training_dtype(state: TrainerState) -> torch.dtype:
    """The compute dtype the run trained in, as the checkpoint's trainer state records it.

    `QLoRAModel.load_base` casts each projection to the compute dtype before quantizing, and dequantizing
    gives that dtype back, so the weights the adapter learned against are
    dequantize_nf4(quantize_nf4(W.to(compute dtype))).
    """
    name = state.compute_dtype
    if name not in DTYPES:
        raise QLoraError(f"{STATE_FILE} does not record the run's compute dtype; --base nf4 needs it")
    return DTYPES[name]


def nf4_round_trip(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight as the quantized model computes with it (the format's round trip)."""
    return NF4.round_trip(weight, dtype)


def merge_tensor(
    name: str,
    tensor: torch.Tensor,
    adapter: dict[str, torch.Tensor],
    scaling: float,
    round_trip: torch.dtype | None,
    experts: ExpertMerge | None = None,
) -> torch.Tensor:
    """One base tensor as the trained model sees it.

    With `round_trip` every projection weight (adapted or not, all are NF4 in training) becomes its NF4
    round trip in that dtype; a projection with an adapter then becomes W + scaling · B @ A computed in
    fp32 (a gated q_proj's B holds the gate rows, interleaved per head as the weight's are, so the
    product lines up row for row); a trained norm becomes its trained value; anything else passes as it
    is. A routed expert's matrix adds its share of its fused parameter's LoRA where `experts` targets it.
    `adapter` is keyed by the names the tensors stream under (`by_tensor_name`).
    """
    module = name.removesuffix(".weight")
    if round_trip is not None and module != name and module.rsplit(".", 1)[-1] in ALL_PROJECTIONS:
        tensor = nf4_round_trip(tensor, round_trip)
    if experts is not None:
        delta = expert_matrix_delta(name, adapter, experts.spec, experts.targets, scaling)
        if delta is not None:
            return tensor.float() + delta
    lora_a = adapter.get(f"{module}.lora_A.weight")
    if lora_a is None:
        return adapter.get(name, tensor)
    lora_b = adapter[f"{module}.lora_B.weight"]
    return torch.addmm(tensor.float(), lora_b.float(), lora_a.float(), alpha=scaling)


@dataclass(frozen=True)
class ExpertMerge:
    """The routed experts' LoRA a merge folds in: the fused parameters it targets, and the model's shape."""

    spec: ModelSpec
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Merge:
    """What a merged export merges: the base's folder and shape, the adapter and its scaling, and the
    dtype of the NF4 round trip the base weights take first (None: the original weights)."""

    base_folder: Path
    spec: ModelSpec
    adapter: dict[str, torch.Tensor]
    scaling: float
    round_trip: torch.dtype | None
    expert_targets: tuple[str, ...] = ()

    def merge(self, name: str, tensor: torch.Tensor, named: dict[str, torch.Tensor]) -> torch.Tensor:
        experts = ExpertMerge(self.spec, self.expert_targets) if self.expert_targets else None
        return merge_tensor(name, tensor, named, self.scaling, self.round_trip, experts)


def by_tensor_name(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter keyed as the base's tensors stream (`model.layers.N....`): PEFT's prefix dropped and
    a vision-language decoder's `model.language_model.` made `model.`."""
    return {canonical_name(name.removeprefix(PREFIX)): tensor for name, tensor in adapter.items()}


def merged_tensors(merge: Merge) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors merged one at a time as they stream past, under the names stream_tensors
    gives them; a tied lm_head is not among them (stream_tensors yields only the tensors the spec
    names), as transformers and llama.cpp expect."""
    named = by_tensor_name(merge.adapter)
    for name, tensor in stream_tensors(merge.base_folder, merge.spec):
        yield name, merge.merge(name, tensor, named)


def merged_checkpoint(merge: Merge) -> Iterator[tuple[str, torch.Tensor]]:
    """The base checkpoint in its own layout and names, the decoder merged: a vision-language
    checkpoint's vision tower and any MTP head pass through unchanged, and routed experts stored fused
    stay fused, so the result loads as the class the base's config.json names."""
    named = by_tensor_name(merge.adapter)
    return rewrite_checkpoint(
        merge.base_folder,
        merge.spec,
        lambda name, tensor: merge.merge(name, tensor, named),
    )
