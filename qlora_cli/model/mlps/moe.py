"""The mixture-of-experts MLP (Qwen3 MoE, Qwen3.5 MoE): a softmax router picks each token's top-k routed
experts, each a SwiGLU MLP of frozen weights; the tokens' copies are sorted by expert, the experts'
projections run as grouped GEMMs over those rows (qlora_kernels.grouped_linear: NF4 tiles decoded in
the GEMM), and each token sums its k outputs, weighted (qlora_kernels.expert_rows spreads the tokens to
their sorted rows and combines them back). Nothing reads the routing on the host, so a CUDA
graph captures the layer. A shared expert, where the family has one, runs on every token through the
mode's projections as the dense MLP does, scaled by sigmoid(shared_expert_gate · x).

The router and the shared expert's gate stay in the compute dtype, unquantized and untrained. Each
routed expert's three matrices are stored in the frozen format one by one (NF4 when quantizing) and
stacked per projection as they load. Where the LoRA config targets the experts' fused parameters
(LoRAConfig.expert_targets), their LoRA (expert_lora.py, in PEFT's layout) adds to gate/up's output and
to down's on the same sorted rows; otherwise the routed experts are frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.lora import LoRAConfig
from qlora_cli.model.mlps.balance import router_tally
from qlora_cli.model.mlps.expert_lora import ExpertLoRA
from qlora_cli.model.modes import Projections
from qlora_cli.sources.spec import ModelSpec
from qlora_kernels.expert_rows import combine_rows, spread_rows
from qlora_kernels.formats import FrozenFormat
from qlora_kernels.grouped_linear import GroupedWeight, grouped_linear, grouped_linear_pair
from qlora_kernels.swiglu import swiglu

# The projections of a routed expert, in the order it holds them.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool):
    """(probs [tokens, experts] fp32, weights [tokens, k] in x's dtype, experts [tokens, k]) for x
    [tokens, hidden]: the softmax of the router's logits in fp32 (what the load-balancing loss reads),
    its top k as torch.topk orders them (ties to the lower expert index, as transformers' router breaks
    them), summing to 1 when `renormalise`.

    The logits are an fp32 product, as llama.cpp's router and Megatron's fp32 router take them: a bf16
    GEMM's rounding depends on how many rows it is given (its kernel and split change with them), so a
    token's experts would change with the rows beside it in its micro-batch, or with the rows a CUDA
    graph pads a short one with."""
    probs = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights.to(x.dtype), experts


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [tokens, k]: where each token's k copies sit among the rows sorted by expert,
    expert_offsets [experts + 1]: each expert's first sorted row) for the top-k `experts` [tokens, k].
    The sort is stable, so each expert's tokens keep their order."""
    choices = experts.reshape(-1)
    order = torch.argsort(choices, stable=True)
    bounds = torch.arange(num_experts + 1, device=experts.device, dtype=choices.dtype)
    expert_offsets = torch.searchsorted(choices[order], bounds)
    # The order's inverse.
    copies = torch.arange(order.numel(), device=experts.device, dtype=order.dtype)
    positions = torch.empty_like(order).scatter_(0, order, copies).view(experts.shape)
    return positions, expert_offsets


class MoEMLP(nn.Module):
    """A MoE layer's MLP. Its projection groups are the shared expert's (named as the dense MLP's, so
    every mode runs them as it runs that one), built only where the family has a shared expert; the
    routed experts, the router and the shared expert's gate are held here, filled by `load`."""

    groups = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    checkpoint_module = "mlp.shared_expert"
    # It has a router, so it tallies the load-balancing loss when asked (qlora_cli/model/mlps/balance.py).
    routes_tokens = True
    # The shared expert's output is read after its down projection (scaled by its gate and added to the
    # experts'), so a recompute must produce it.
    down_output_unread_in_recompute = False

    def __init__(self, spec: ModelSpec, lora: LoRAConfig | None = None):
        super().__init__()
        moe = spec.moe
        self.intermediate_size = moe.expert_intermediate_size
        self.expert_lora = ExpertLoRA(spec, lora) if lora and lora.expert_targets else None
        self.num_experts, self.top_k, self.renormalise = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.shared_expert = moe.shared_expert_intermediate_size > 0
        self.router: torch.Tensor | None = None
        self.shared_expert_gate: torch.Tensor | None = None
        # Projection name (EXPERT_PROJECTIONS) -> every routed expert's matrix, stacked.
        self.experts: dict[str, GroupedWeight] = {}
        self.scratch: torch.Tensor | None = None

    def load(self, name: str, tensor: torch.Tensor, frozen: FrozenFormat, dtype: torch.dtype) -> None:
        """Take the checkpoint's tensor `name` (below `mlp.`): the router, the shared expert's gate, or one
        routed expert's matrix, stored in `frozen` into its slot as it arrives."""
        if name == "gate.weight":
            self.router = tensor.to(dtype)
        elif name == "shared_expert_gate.weight":
            self.shared_expert_gate = tensor.to(dtype)
        else:
            _, expert, projection, _ = name.split(".")
            stacked = self.experts.get(projection)
            self.experts[projection] = frozen.put_expert(
                stacked, self.num_experts, int(expert), tensor.to(dtype)
            )

    @staticmethod
    def kept_activations(spec: ModelSpec) -> int:
        """Values a token keeps for the MLP's backward (bf16 units): the shared expert's gate/up output;
        per routed copy, gate's and up's outputs (the fused SwiGLU recomputes its own; the grouped
        GEMMs keep no input), the expert's output and the weight that multiplies it; the router's
        fp32 probabilities, and its fp32 top k and their sum where they are renormalised; in int64,
        the experts it chose (the top k's indices) and where its copies sit among the sorted rows."""
        moe = spec.moe
        routed = moe.top_k * (2 * moe.expert_intermediate_size + spec.hidden_size + 1)
        router = 2 * moe.num_experts + (2 * moe.top_k + 2 if moe.norm_topk_prob else 0)
        return 2 * moe.shared_expert_intermediate_size + routed + router + 2 * 4 * moe.top_k

    @staticmethod
    def lora_kept_activations(spec: ModelSpec, lora: LoRAConfig) -> int:
        """What the routed experts' LoRA adds per token (bf16 units): per routed copy, each adapted
        parameter's input rows (gate/up's sorted hidden states, down's SwiGLU output, which the
        frozen GEMMs keep none of) and its rank-wide t."""
        moe = spec.moe
        inputs = {"gate_up_proj": spec.hidden_size, "down_proj": moe.expert_intermediate_size}
        return moe.top_k * sum(inputs[name] + lora.r for name in lora.expert_targets)

    @staticmethod
    def backward_working_bytes(spec: ModelSpec, tokens: int) -> int:
        """What its backward holds at once: the rerun's routed activations (gate/up's output and the
        experts'), and their gradients (the expert outputs' and the sorted rows', gate's, up's and
        SwiGLU's), for every copy; the shared expert runs unsliced beside them."""
        moe = spec.moe
        routed = moe.top_k * (2 * moe.expert_intermediate_size + spec.hidden_size)
        gradients = moe.top_k * (3 * moe.expert_intermediate_size + 2 * spec.hidden_size)
        shared = 4 * moe.shared_expert_intermediate_size
        return tokens * (routed + gradients + shared) * 2

    def scratch_numel(self) -> int:
        """None of the layers' shared weight buffer: the grouped GEMMs decode NF4 tiles in registers."""
        return 0

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        if self.expert_lora is not None:
            self.expert_lora.reset_lora(generator)

    def forward(self, h, project: Projections, layer, balance_tokens: torch.Tensor | None = None):
        """h [batch, seq, hidden] -> the MLP's output; `layer` is the DecoderLayer it runs in. With
        `balance_tokens` [batch * seq] (1.0, or 0.0 at padding): (the output, the routing's `router_tally`)."""
        x = h.reshape(-1, h.shape[-1])
        probs, weights, experts = timed(Op.ROUTER, route, x, self.router, self.top_k, self.renormalise)
        positions, expert_offsets = timed(Op.EXPERT_SORT, sort_by_expert, experts, self.num_experts)
        rows = timed(Op.EXPERT_ROWS, spread_rows, x, positions)
        gate_up = timed(
            Op.EXPERT_GATE_UP,
            grouped_linear_pair,
            rows,
            self.experts["gate_proj"],
            self.experts["up_proj"],
            expert_offsets,
        )
        lora = self.expert_lora
        switch = project.adapter_scale if lora is not None else None
        if (
            lora is not None
            and (delta := lora.delta("gate_up_proj", rows, expert_offsets, switch)) is not None
        ):
            gate_up = gate_up + delta
        activation = timed(Op.EXPERT_SWIGLU, swiglu, gate_up)
        routed = timed(Op.EXPERT_DOWN, grouped_linear, activation, self.experts["down_proj"], expert_offsets)
        if (
            lora is not None
            and (down := lora.delta("down_proj", activation, expert_offsets, switch)) is not None
        ):
            routed = routed + down
        out = timed(Op.EXPERT_ROWS, combine_rows, routed, positions, weights)
        if self.shared_expert:
            shared = project.down(project.swiglu(project.gate_up(h, 0)), 0).reshape(x.shape)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.to(x.dtype))) * shared
        if balance_tokens is None:
            return out.view(h.shape)
        return out.view(h.shape), router_tally(probs, experts, balance_tokens)
