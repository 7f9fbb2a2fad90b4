"""LoRA on a MoE layer's routed experts, held in PEFT's layout for transformers 5's fused expert
parameters (LoraConfig(target_parameters=[...]), PEFT's ParamWrapper), so it saves, loads and compares
with PEFT's tensors as they are.

For a targeted parameter of E experts' [out, in] matrices (gate_up_proj [E, 2I, H], down_proj
[E, H, I]) PEFT keeps lora_A [E·r, in], expert e's A in rows e·r to e·r + r, and lora_B [out, r·E],
expert e's B in columns e, E + e, ..., (r - 1)·E + e (it reshapes B to [out, r, E]); expert e's weight
becomes W_e + scaling · B_e A_e, scaling alpha / r (or / sqrt(r)) as for any LoRA. PEFT takes no
dropout there, and neither does this.
"""

from __future__ import annotations

import torch
from torch import nn

from qlora_cli.core.names import EXPERT_PARAMETERS
from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.lora import LoRAConfig, init_lora
from qlora_cli.sources.spec import ModelSpec
from qlora_kernels.grouped_lora import grouped_lora

# The module below a layer that holds the fused parameters, in transformers' and PEFT's names.
EXPERTS_MODULE = "mlp.experts"


def wrapper_paths(adapted) -> dict[str, str]:
    """Each adapted fused parameter's place below EXPERTS_MODULE in PEFT's tensor names. PEFT wraps the
    module once per targeted parameter, in the order the module registers them (EXPERT_PARAMETERS'),
    each wrapper around the last: the first sits innermost, below one `base_layer.` per wrapper
    outside it (gate_up_proj's lora_A is `mlp.experts.base_layer.lora_A` when down_proj's is adapted too)."""
    ordered = [name for name in EXPERT_PARAMETERS if name in adapted]
    return {name: "base_layer." * (len(ordered) - 1 - i) for i, name in enumerate(ordered)}


def target_parameters(adapted) -> list[str]:
    """adapter_config.json's target_parameters for these adapted fused parameters."""
    return [f"{EXPERTS_MODULE}.{name}" for name in EXPERT_PARAMETERS if name in adapted]


def per_expert(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A [E·r, in] and lora_B [out, r·E] as A [E, r, in] and B [E, out, r] (views)."""
    return lora_a.view(experts, -1, lora_a.shape[1]), lora_b.view(lora_b.shape[0], -1, experts).permute(
        2, 0, 1
    )


def expert_deltas(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """[E, out, in] fp32: what the adapter adds to each expert's matrix, scaling · B_e A_e."""
    a, b = per_expert(lora_a.float(), lora_b.float(), experts)
    return scaling * torch.bmm(b, a)


def expert_matrix_delta(
    name: str, adapter: dict[str, torch.Tensor], spec: ModelSpec, targets, scaling: float
) -> torch.Tensor | None:
    """What the adapter adds to one routed expert's matrix as the base's tensors stream
    (`model.layers.L.mlp.experts.E.gate_proj.weight`: fused checkpoints stream per expert too), fp32;
    None when that matrix takes no LoRA. `adapter` is keyed by the streamed names' prefix; gate_proj's
    rows are the first I of gate_up_proj's delta, up_proj's the next I."""
    layer, found, rest = name.partition(f".{EXPERTS_MODULE}.")
    if not found:
        return None
    expert, projection, _ = rest.split(".")
    fused = "down_proj" if projection == "down_proj" else "gate_up_proj"
    if fused not in targets:
        return None
    module = f"{layer}.{EXPERTS_MODULE}.{wrapper_paths(targets)[fused]}"
    a, b = per_expert(
        adapter[f"{module}lora_A.weight"], adapter[f"{module}lora_B.weight"], spec.moe.num_experts
    )
    i = spec.moe.expert_intermediate_size
    rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[projection]
    return scaling * (b[int(expert), rows].float() @ a[int(expert)].float())


class ExpertLoRA(nn.Module):
    """The routed experts' LoRA A and B (fp32 masters, named by the fused parameter they adapt), and
    their product on a MoE layer's rows sorted by expert."""

    def __init__(self, spec: ModelSpec, lora: LoRAConfig):
        super().__init__()
        self.experts, self.scaling = spec.moe.num_experts, lora.scaling
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (out_features, in_features) in spec.moe.fused_expert_shapes(spec.hidden_size).items():
            if name in lora.expert_targets:
                self.lora_A[name] = nn.Parameter(torch.empty(self.experts * lora.r, in_features))
                self.lora_B[name] = nn.Parameter(torch.zeros(out_features, lora.r * self.experts))

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        init_lora(self.lora_A, self.lora_B, generator)

    def delta(
        self,
        name: str,
        rows: torch.Tensor,
        expert_offsets: torch.Tensor,
        adapter_scale: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """What fused parameter `name`'s LoRA adds to its output on `rows` (None: it takes none).
        `adapter_scale` multiplies A, as for every LoRA (QLoRAModel.adapter_off)."""
        if name not in self.lora_A:
            return None
        a, b = per_expert(self.lora_A[name], self.lora_B[name], self.experts)
        if adapter_scale is not None:
            a = a * adapter_scale
        return timed(Op.EXPERT_LORA, grouped_lora, rows, a, b, expert_offsets, self.scaling)
