"""The mixture-of-experts MLP (Qwen3 MoE, Qwen3.5 MoE): a softmax router picks each token's top-k routed
experts, each a SwiGLU MLP of frozen weights; the tokens are sorted by expert, each expert runs on its
slice of them, and the outputs come back weighted, added into each token's row. A shared expert, where
the family has one, runs on every token through the mode's projections as the dense MLP does, scaled
by sigmoid(shared_expert_gate · x).

The router and the shared expert's gate stay in the compute dtype, unquantized and untrained. Each
routed expert's three matrices are stored in the frozen format one by one (NF4 when quantizing) and
multiplied through qlora_kernels.linear, one expert at a time; they take no LoRA yet. Forward and
backward are torch ops around those products (a grouped GEMM over the experts is a later step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qlora_cli.model.modes import Projections
from qlora_cli.sources.spec import ModelSpec
from qlora_kernels.formats import FrozenFormat, FrozenWeight
from qlora_kernels.linear import buffer_numel, lora_linear

# The projections of a routed expert, in the order it holds them.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool):
    """(weights [tokens, k] in x's dtype, experts [tokens, k]) for x [tokens, hidden]: softmax of the
    router's logits in fp32, its top k as torch.topk orders them (ties to the lower expert index, as
    transformers' router breaks them), summing to 1 when `renormalise`."""
    probs = torch.softmax(F.linear(x, router.to(x.dtype)).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


class MoEMLP(nn.Module):
    """A MoE layer's MLP. Its projection groups are the shared expert's (named as the dense MLP's, so
    every mode runs them as it runs that one), built only where the family has a shared expert; the
    routed experts, the router and the shared expert's gate are held here, filled by `load`."""

    groups = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    checkpoint_module = "mlp.shared_expert"
    # The tokens each expert got are read back to split the rows among the experts' GEMMs.
    graph_blocker = "a mixture-of-experts MLP reads how many tokens each expert got on the host"
    # The shared expert's output is read after its down projection (scaled by its gate and added to the
    # experts'), so a recompute must produce it.
    down_output_unread_in_recompute = False

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        self.num_experts, self.top_k, self.renormalise = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.shared_expert = moe.shared_expert_intermediate_size > 0
        self.router: torch.Tensor | None = None
        self.shared_expert_gate: torch.Tensor | None = None
        self.experts: list[list[FrozenWeight | None]] = [
            [None] * len(EXPERT_PROJECTIONS) for _ in range(moe.num_experts)
        ]
        self.scratch: torch.Tensor | None = None

    def load(self, name: str, tensor: torch.Tensor, frozen: FrozenFormat, dtype: torch.dtype) -> None:
        """Take the checkpoint's tensor `name` (below `mlp.`): the router, the shared expert's gate, or one
        routed expert's matrix, stored in `frozen` as it arrives."""
        if name == "gate.weight":
            self.router = tensor.to(dtype)
        elif name == "shared_expert_gate.weight":
            self.shared_expert_gate = tensor.to(dtype)
        else:
            _, expert, projection, _ = name.split(".")
            self.experts[int(expert)][EXPERT_PROJECTIONS.index(projection)] = frozen.encode(tensor.to(dtype))

    def scratch_numel(self) -> int:
        """The shared weight buffer's size for one expert's gate/up (the largest of its calls)."""
        gate, up, down = self.experts[0]
        return max(buffer_numel([gate, up]), buffer_numel([down]))

    def forward(self, h, project: Projections, layer):
        """h [batch, seq, hidden] -> the MLP's output; `layer` is the DecoderLayer it runs in."""
        x = h.reshape(-1, h.shape[-1])
        weights, experts = route(x, self.router, self.top_k, self.renormalise)
        # Each (token, choice) pair sorted by expert; stable, so each expert's tokens keep their order.
        choices = experts.reshape(-1)
        order = torch.argsort(choices, stable=True)
        tokens = order // self.top_k
        per_expert = torch.bincount(choices, minlength=self.num_experts).tolist()
        rows = x[tokens]
        outputs = [
            self._expert(expert, part)
            for expert, part in enumerate(rows.split(per_expert))
            if per_expert[expert]
        ]
        routed = torch.cat(outputs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, tokens, routed)
        if self.shared_expert:
            shared = project.down(project.swiglu(project.gate_up(h, 0)), 0).reshape(x.shape)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.to(x.dtype))) * shared
        return out.view(h.shape)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Routed expert `expert`'s SwiGLU on its tokens x [n, hidden], through the frozen-format GEMMs."""
        gate, up, down = self.experts[expert]
        none = [None, None]
        gate_up = lora_linear(x, [gate, up], none, none, none, 0.0, buffer=self.scratch)
        g, u = gate_up.chunk(2, dim=-1)
        return lora_linear(F.silu(g) * u, [down], [None], [None], [None], 0.0, buffer=self.scratch)
