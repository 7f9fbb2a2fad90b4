"""What a mode hands a decoder layer: how its projections run, and generation's share of the cache.

Training and the prefill run the fused training kernels; a decode step runs generation's decode copies
(qlora_cli/generate/decoding.py). The mixers and the MLP call these and never ask which mode it is,
but for the cache's `decoding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qlora_cli.core.ops import Op


class Projections(Protocol):
    """How one mode runs a layer's projection groups, in the layer's order. gate_up's result goes to
    swiglu and swiglu's to down as they are, so a mode may hand partial results along (the training
    kernels finish gate/up's LoRA inside SwiGLU). `token_offset` is the first token's index in the
    row, for LoRA dropout's masks when the MLP runs in slices. `adapter_scale` (a 0-d tensor, or None
    for 1) multiplies LoRA's contribution where an MLP runs LoRA of its own (the routed experts')."""

    adapter_scale: torch.Tensor | None

    def run(self, op: Op, group: str, x: torch.Tensor) -> torch.Tensor:
        """A mixer's projection group `group` on x, timed as `op`."""

    def gate_up(self, h: torch.Tensor, token_offset: int): ...

    def swiglu(self, gate_up): ...

    def down(self, activation, token_offset: int) -> torch.Tensor: ...


class LayerCache(Protocol):
    """One layer's share of generation's cache, handed to its forward; each mixer's cache says what
    else it holds. In a decode step (`decoding`) it brings the decode kernels' copies of the layer's
    projections."""

    decoding: bool
    projections: Projections


@dataclass(frozen=True)
class PrefillRows:
    """Where a prefill's prompts sit: `prompts` rows of the cache are filled; `prompt_tokens` [rows, seq]
    marks the pass's tokens that are the prompts' (not padding), and `rows` and `positions` give each
    such token's cache row and position, in the order the mask lists them."""

    prompts: int
    prompt_tokens: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class DecodeRows:
    """A decode step's tokens, one a row: `positions` [rows, 1], and `visible` [rows, capacity] marking the
    cached positions each row's query sees (its own so far, within the sliding window if there is one)."""

    positions: torch.Tensor
    visible: torch.Tensor
