"""The load-balancing auxiliary loss of a mixture of experts (Switch Transformer's), computed as
transformers' load_balancing_loss_func does for Qwen3 MoE and Qwen3.5 MoE, for configs that ask for it
(output_router_logits).

Over the rows of every layer that has a router (a dense layer has none) taken together, with f_e the
share of (row, choice) picks that went to expert e and P_e the mean router probability of e, both
divided by the rows of all those layers: loss = num_experts · Σ_e f_e · P_e. It is a product of sums
over all the layers, not a sum of per-layer terms, so each layer hands its sums (`router_tally`) out of
its forward, as an output that recompute and offload treat like the layer's others, and the model
combines them after the last layer (`load_balancing_loss`). Only P carries a gradient: through each
router's softmax into the hidden states below it, and so into LoRA. Padding counts in neither: each row
is weighted by the token mask, as transformers weights by its attention mask.

The probabilities are the router's own fp32 softmax and the picks its top k: in fp32 that is
transformers' value; in bf16 transformers takes the softmax again in bf16 and picks its top k anew.
Nothing here reads a value on the host, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch


def router_tally(probs: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One layer's sums [2, num_experts] fp32: the picks of each expert (no gradient), then its router
    probabilities summed, over the rows `tokens` [rows] weighs (1.0, or 0.0 at padding). probs: the
    softmax over every expert [rows, num_experts]; experts: each row's top k [rows, k]."""
    picks = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device)
    picks.index_add_(0, experts.reshape(-1), tokens[:, None].expand(experts.shape).reshape(-1))
    return torch.stack([picks, tokens @ probs])


def load_balancing_loss(tallies: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The loss (fp32, 0-d) from every routed layer's tally of the rows `tokens` weighs. A micro-batch
    without a counted row (none is made) gives 0, not NaN."""
    picks, probs = torch.stack(tallies).sum(dim=0)
    rows = (len(tallies) * tokens.sum()).clamp(min=1)
    return probs.shape[-1] * torch.sum((picks / rows) * (probs / rows))
