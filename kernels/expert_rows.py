"""A mixture-of-experts layer's token copies: each token spread to the k rows its routed copies take
once sorted by expert, and each token's k rows gathered back as their weighted sum.

`positions` [T, k] (int, on the device) says where token t's j-th copy sits among the T·k sorted rows;
it holds every row exactly once (the inverse of the sort's order), so each row has one writer and
neither direction needs atomics or a zeroed buffer. Spreading is a gather's transpose and combining
a weighted spread's, so each op's backward is the other's kernel: a spread's gradient sums each
token's k rows, a combine's writes each row its token's weighted gradient (and each weight's gradient
is its row's dot with the token's). Sums accumulate in fp32 and store in the rows' dtype; no host
sync reads the routing, so a CUDA graph captures both.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def spread_rows_reference(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """rows [T·k, H] with rows[positions[t, j]] = x[t]."""
    copies = x.unsqueeze(1).expand(*positions.shape, x.shape[-1]).reshape(-1, x.shape[-1])
    return copies.new_empty(copies.shape).index_copy(0, positions.reshape(-1), copies)


def combine_rows_reference(
    rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] rows[positions[t, j]], in fp32, stored in the rows' dtype."""
    return (rows[positions].float() * weights.float().unsqueeze(-1)).sum(dim=1).to(rows.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _spread_kernel(
        x_ptr,
        positions_ptr,
        weights_ptr,
        rows_ptr,
        hidden,
        K: tl.constexpr,
        WEIGHTED: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One program per (token, block of H): rows[positions[t, j]] = weights[t, j] x[t] (x[t]
        unweighted), for each of its k copies."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        x = tl.load(x_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            row = tl.load(positions_ptr + token * K + j).to(tl.int64)
            value = x
            if WEIGHTED:
                value = x * tl.load(weights_ptr + token * K + j).to(tl.float32)
            tl.store(rows_ptr + row * hidden + cols, value.to(rows_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_kernel(
        rows_ptr,
        positions_ptr,
        weights_ptr,
        out_ptr,
        hidden,
        K: tl.constexpr,
        WEIGHTED: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One program per (token, block of H): out[t] = sum_j weights[t, j] rows[positions[t, j]]."""
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(positions_ptr + token * K + j).to(tl.int64)
            value = tl.load(rows_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if WEIGHTED:
                value = value * tl.load(weights_ptr + token * K + j).to(tl.float32)
            acc += value
        tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_dots_kernel(
        rows_ptr, positions_ptr, dout_ptr, dweights_ptr, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr
    ):
        """One program per token: dweights[t, j] = rows[positions[t, j]] . dout[t], over all of H."""
        token = tl.program_id(0).to(tl.int64)
        for j in tl.static_range(K):
            row = tl.load(positions_ptr + token * K + j).to(tl.int64)
            dot = tl.zeros([BLOCK_H], dtype=tl.float32)
            for start in range(0, hidden, BLOCK_H):
                cols = start + tl.arange(0, BLOCK_H)
                mask = cols < hidden
                value = tl.load(rows_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.load(dout_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
                dot += value * grad
            tl.store(dweights_ptr + token * K + j, tl.sum(dot).to(dweights_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

# Columns a program moves of one token: 16-byte bf16 vectors across 128 threads.
_BLOCK_H = 1024
_WARPS = 4


def _block_h(hidden: int) -> int:
    return min(_BLOCK_H, triton.next_power_of_2(hidden))


def _per_token(kernel, source, positions, weights, out) -> torch.Tensor:
    """Runs the spread or combine `kernel` over (token, block of H) programs into `out`."""
    tokens, k = positions.shape
    hidden = source.shape[-1]
    block = _block_h(hidden)
    kernel[(tokens, triton.cdiv(hidden, block))](
        source,
        positions,
        weights if weights is not None else positions,
        out,
        hidden,
        K=k,
        WEIGHTED=weights is not None,
        BLOCK_H=block,
        num_warps=_WARPS,
    )
    return out


def _spread(x: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    rows = x.new_empty(positions.numel(), x.shape[-1])
    return _per_token(_spread_kernel, x, positions, weights, rows)


def _combine(rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    out = rows.new_empty(positions.shape[0], rows.shape[-1])
    return _per_token(_combine_kernel, rows, positions, weights, out)


def _row_dots(
    rows: torch.Tensor, positions: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    tokens, k = positions.shape
    dweights = torch.empty(tokens, k, dtype=dtype, device=rows.device)
    _row_dots_kernel[(tokens,)](
        rows,
        positions,
        dout,
        dweights,
        rows.shape[-1],
        K=k,
        BLOCK_H=_block_h(rows.shape[-1]),
        num_warps=_WARPS,
    )
    return dweights


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class SpreadRowsFunction(torch.autograd.Function):
    """Saves `positions`: the gradient of a token is the sum of its k rows' gradients."""

    @staticmethod
    def forward(ctx, x, positions):
        ctx.save_for_backward(positions)
        return _spread(x.contiguous(), positions, None)

    @staticmethod
    def backward(ctx, drows):
        (positions,) = ctx.saved_tensors
        return _combine(drows.contiguous(), positions, None), None


class CombineRowsFunction(torch.autograd.Function):
    """Saves the rows, `positions` and the weights: a row's gradient is its weight times its token's,
    a weight's is its row's dot with its token's gradient."""

    @staticmethod
    def forward(ctx, rows, positions, weights):
        rows, weights = rows.contiguous(), weights.contiguous()
        ctx.save_for_backward(rows, positions, weights)
        return _combine(rows, positions, weights)

    @staticmethod
    def backward(ctx, dout):
        rows, positions, weights = ctx.saved_tensors
        dout = dout.contiguous()
        drows = _spread(dout, positions, weights) if ctx.needs_input_grad[0] else None
        dweights = _row_dots(rows, positions, dout, weights.dtype) if ctx.needs_input_grad[2] else None
        return drows, None, dweights


# ---------------------------------------------------------------------------------------------
# Public
# ---------------------------------------------------------------------------------------------


def _check(positions: torch.Tensor, tokens: int) -> None:
    if (
        positions.dim() != 2
        or positions.shape[0] != tokens
        or positions.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"positions must be int [{tokens}, k], got {positions.dtype} {tuple(positions.shape)}"
        )


def spread_rows(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """rows [T·k, H] holding x [T, H]'s token t at positions[t, j] for each of its k copies; every
    row is one token's copy (positions holds each row once). Differentiable in x."""
    _check(positions, x.shape[0])
    if use_triton(x):
        return SpreadRowsFunction.apply(x, positions.contiguous())
    return spread_rows_reference(x, positions)


def combine_rows(rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum_j weights[t, j] rows[positions[t, j]]: each token's k copies, weighted and
    summed in fp32, in the rows' dtype. Differentiable in rows and weights."""
    _check(positions, weights.shape[0])
    if use_triton(rows):
        return CombineRowsFunction.apply(rows, positions.contiguous(), weights)
    return combine_rows_reference(rows, positions, weights)
