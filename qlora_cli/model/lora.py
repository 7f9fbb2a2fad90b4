"""LoRA's shape and the projection groups: frozen NF4 (or plain) weights with trainable adapters.

A group is the projections that share one input (q/k/v, a Gated DeltaNet layer's four input
projections, gate/up, or a single one); it runs as one fused call of qlora_kernels.linear, LoRA included.
Each layer kind's mixer and the MLP name their groups (qlora_cli/model/mixers/, qlora_cli/model/mlps/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.model.mixers import MIXERS
from qlora_cli.sources.spec import DENSE_MLP, FULL_ATTENTION, MOE_MLP, ModelSpec
from qlora_kernels.dropout import seeded_dropout
from qlora_kernels.formats import FrozenWeight
from qlora_kernels.fp8 import FP8Scales
from qlora_kernels.linear import buffer_numel, lora_linear, lora_linear_a, lora_linear_b


@dataclass(frozen=True)
class LoRAConfig:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    use_rslora: bool = False
    train_norms: bool = False
    # The routed experts' fused parameters that take LoRA (EXPERT_PARAMETERS); none by default.
    expert_targets: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def lora_weights_per_layer(
        self, spec: ModelSpec, kind: str = FULL_ATTENTION, mlp: str = DENSE_MLP
    ) -> int:
        """LoRA A [r, in] and B [out, r] of each targeted projection of one layer of `kind` with an MLP
        of kind `mlp`, and a MoE layer's routed experts' (an A and a B per expert and targeted fused
        parameter)."""
        shapes = spec.projection_shapes(kind, mlp)
        total = sum(
            self.r * (out + inp) for name, (out, inp) in shapes.items() if name in self.target_modules
        )
        return total + (self.expert_weights_per_layer(spec) if mlp == MOE_MLP else 0)

    def expert_weights_per_layer(self, spec: ModelSpec) -> int:
        """The routed experts' LoRA in one MoE layer."""
        if not self.expert_targets:
            return 0
        shapes = spec.moe.fused_expert_shapes(spec.hidden_size)
        per_expert = sum(
            self.r * (out + inp) for name, (out, inp) in shapes.items() if name in self.expert_targets
        )
        return spec.moe.num_experts * per_expert

    def trained_weights(self, spec: ModelSpec) -> int:
        """Every weight the adapter trains: what the optimizer holds state for and a checkpoint saves.

        The memory planner and the output_dir's free-space check both count from here."""
        total = spec.hidden_size if self.train_norms else 0
        for kind, mlp in spec.layer_kinds:
            total += self.lora_weights_per_layer(spec, kind, mlp)
            if self.train_norms:
                total += 2 * spec.hidden_size + MIXERS[kind].trained_norm_weights(spec)
        return total


def init_lora(lora_a: nn.ParameterDict, lora_b: nn.ParameterDict, generator: torch.Generator | None) -> None:
    """A as PEFT initialises it (kaiming-uniform with a=sqrt(5) over A's [rows, in]), B zeros: the adapter
    starts as a no-op."""
    for a in lora_a.values():
        bound = 1.0 / math.sqrt(a.shape[1])
        with torch.no_grad():
            a.uniform_(-bound, bound, generator=generator)
    for b in lora_b.values():
        with torch.no_grad():
            b.zero_()


class ProjectionGroup(nn.Module):
    """Projections that share one input (q/k/v, gate/up, or a single one), run as one fused call.

    Frozen weights are NF4 (or plain tensors when quantization is off; any kernels.formats format)
    and live outside the parameter list; LoRA A/B are the trainable fp32 master weights, named as PEFT names them.
    LoRA dropout's mask is hash(the model's dropout seed, `salt`, token) (kernels.dropout): each
    group of each layer has its own salt, and a recompute repeats the mask without saving anything.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        shapes: dict[str, tuple[int, int]],
        lora: LoRAConfig | None,
        salt: int = 0,
    ):
        super().__init__()
        self.names = names
        self.salt = salt
        self.out_features = [shapes[n][0] for n in names]
        self.weights: list[FrozenWeight | None] = [None] * len(names)
        self.biases: list[torch.Tensor | None] = [None] * len(names)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.scaling = lora.scaling if lora else 0.0
        self.dropout = lora.dropout if lora else 0.0
        for name in names:
            if lora and name in lora.target_modules:
                out_features, in_features = shapes[name]
                self.lora_A[name] = nn.Parameter(torch.empty(lora.r, in_features))
                self.lora_B[name] = nn.Parameter(torch.zeros(out_features, lora.r))
        self.scratch: torch.Tensor | None = None
        # The e4m3 scales of the frozen weights when they multiply in FP8 (QLoRAModel.use_fp8).
        self.fp8: FP8Scales | None = None

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        init_lora(self.lora_A, self.lora_B, generator)

    def lora_a_list(self, adapter_scale: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """The A's in projection order, times `adapter_scale` when given: the model's adapter switch
        (QLoRAModel.adapter_off) reaches every LoRA product through A, since the kernels take `scaling`
        as a Python number, which a captured CUDA graph would keep. Times 1.0 leaves A's bits as they are."""
        a_list = [self.lora_A.get(n) for n in self.names]
        if adapter_scale is None:
            return a_list
        return [None if a is None else a * adapter_scale for a in a_list]

    def scratch_numel(self) -> int:
        return buffer_numel(self.weights, self.lora_a_list())

    def set_weight(self, name: str, weight: FrozenWeight) -> None:
        self.weights[self.names.index(name)] = weight

    def set_bias(self, name: str, bias: torch.Tensor) -> None:
        self.biases[self.names.index(name)] = bias

    def forward(
        self,
        x: torch.Tensor,
        need_output: bool = True,
        *,
        keep_lora_t: bool = False,
        lora_t: torch.Tensor | None = None,
        dropout_seed: torch.Tensor | None = None,
        token_offset: int = 0,
        adapter_scale: torch.Tensor | None = None,
    ):
        """The projections with LoRA. keep_lora_t: return (y without LoRA's B, t = lora_x @ A^T)
        for the next op to finish; lora_t: start from that t instead of x @ A^T (whoever formed it
        applied the adapter switch). With dropout, `dropout_seed` draws the mask; x's first token is
        token `token_offset` of the micro-batch. `adapter_scale` multiplies LoRA's contribution."""
        lora_x = x
        if self.dropout and self.training:
            if dropout_seed is None:
                raise ValueError("LoRA dropout needs the model's dropout seed")
            lora_x = seeded_dropout(x, self.dropout, dropout_seed, self.salt, token_offset * x.shape[-1])
        lora_b = [self.lora_B.get(n) for n in self.names]
        if keep_lora_t:
            return lora_linear_a(
                x,
                self.weights,
                self.biases,
                self.lora_a_list(adapter_scale),
                lora_x,
                self.scratch,
                need_output,
                self.fp8,
            )
        if lora_t is not None:
            return lora_linear_b(
                x,
                lora_t,
                self.weights,
                self.biases,
                lora_b,
                self.scaling,
                self.scratch,
                need_output,
                self.fp8,
            )
        return lora_linear(
            x,
            self.weights,
            self.biases,
            self.lora_a_list(adapter_scale),
            lora_b,
            self.scaling,
            lora_x=lora_x,
            buffer=self.scratch,
            need_output=need_output,
            fp8=self.fp8,
        )
