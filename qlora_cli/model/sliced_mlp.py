"""The MLP over slices of a long row, so no tensor of tokens × intermediate_size exists whole.

gate/up's output, SwiGLU's and their gradients are each tokens × intermediate_size: at 7B and 128K
tokens, 9.9 GB apiece. The MLP acts on each token alone, so it can run slice by slice with the
same result. Forward writes each slice's output and keeps only the MLP's input; backward reruns a
slice's gate/up and SwiGLU (inside `recompute()`, so down's forward GEMM is skipped) and
back-propagates it before the next. A recomputed layer reruns its MLP in backward anyway, so there
the slicing costs no extra work; its recompute pass gets an output that takes no memory, because
nothing after the MLP reads it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

SLICE_BYTES = 1 << 30  # gate/up's bf16 output for one slice; large enough to keep the GEMMs efficient
SLICE_MULTIPLE = 256


def slice_tokens(tokens: int, intermediate_size: int, element_bytes: int = 2) -> int:
    """Tokens per slice for a row of `tokens`: the whole row when its gate/up output fits SLICE_BYTES,
    otherwise equal slices (rounded up to SLICE_MULTIPLE) that each fit."""
    largest = max(SLICE_MULTIPLE, SLICE_BYTES // (2 * intermediate_size * element_bytes))
    if tokens <= largest:
        return tokens
    slices = math.ceil(tokens / largest)
    return math.ceil(tokens / slices / SLICE_MULTIPLE) * SLICE_MULTIPLE


def slice_working_bytes(tokens: int, intermediate_size: int, element_bytes: int = 2) -> int:
    """What one slice holds in backward: gate/up's output and its gradient (4 × intermediate_size a
    token)."""
    return 4 * slice_tokens(tokens, intermediate_size, element_bytes) * intermediate_size * element_bytes


class SlicedMLP(torch.autograd.Function):
    """`mlp(part, start)` applied to `slice_tokens` tokens at a time; see the module docstring. `start`
    is the slice's first token in the row, so LoRA dropout draws the whole MLP's mask for it."""

    @staticmethod
    def forward(
        ctx,
        mlp: Callable[[torch.Tensor, int], torch.Tensor],
        recompute: Callable[[], contextlib.AbstractContextManager],
        recomputing: bool,
        slice_tokens: int,
        h: torch.Tensor,
        *trainables: torch.Tensor,
    ):
        ctx.mlp, ctx.recompute, ctx.slice, ctx.trainables = mlp, recompute, slice_tokens, len(trainables)
        ctx.save_for_backward(h)
        if recomputing:
            return h.new_zeros(1).expand(h.shape)
        rows = h.reshape(-1, h.shape[-1])
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], slice_tokens):
            out[start : start + slice_tokens] = mlp(rows[start : start + slice_tokens].unsqueeze(0), start)[0]
        return out.view(h.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        rows, grads = h.reshape(-1, h.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dh = torch.empty_like(rows)
        for start in range(0, rows.shape[0], ctx.slice):
            part = rows[start : start + ctx.slice].unsqueeze(0).detach().requires_grad_(True)
            with torch.enable_grad(), ctx.recompute():
                out = ctx.mlp(part, start)
            torch.autograd.backward(out, grads[start : start + ctx.slice].unsqueeze(0))
            dh[start : start + ctx.slice] = part.grad[0]
        return (None, None, None, None, dh.view(h.shape)) + (None,) * ctx.trainables
