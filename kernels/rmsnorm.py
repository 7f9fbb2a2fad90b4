"""RMSNorm and fused residual-add + RMSNorm, with Qwen3.5's zero-centred weight as an option,
and Qwen3.5's gated RMSNorm (the Gated DeltaNet output: rmsnorm(x) * w * silu(gate)).

The Triton path keeps the statistics in fp32, stores the output once in the activation dtype,
and saves only the (summed) input, the gate, and one fp32 inverse RMS per row for backward. A
zero-centred norm scales by (1 + w) (w initialised to 0); the kernels take that 1 as a weight offset.
"""

import torch
import torch.nn.functional as F

from qlora_kernels._dispatch import TRITON_AVAILABLE, multiprocessors, use_triton
from qlora_kernels._layout import as_head_rows, as_rows

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool = False
) -> torch.Tensor:
    """HF Qwen2RMSNorm, op for op: the numerical truth the kernels are checked against.

    zero_centred is HF Qwen3_5RMSNorm instead: it multiplies by (1 + w) in fp32 and casts once at
    the end, where Qwen2 casts the normalised input to x's dtype before multiplying by w.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if residual is None else x + residual
    return rms_norm_reference(summed, weight, eps, zero_centred=zero_centred), summed


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """HF Qwen3_5RMSNormGated, op for op: Qwen2's RMSNorm (plain weight), then silu(gate) in fp32."""
    return (rms_norm_reference(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr,
        residual_ptr,
        gate_ptr,
        weight_ptr,
        y_ptr,
        summed_ptr,
        rstd_ptr,
        x_row_stride,
        residual_row_stride,
        gate_token_stride,
        gate_head_stride,
        gate_heads,
        n_rows,
        n_cols,
        eps,
        weight_offset,
        HAS_RESIDUAL: tl.constexpr,
        HAS_GATE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """ROWS rows a program: one row of a short norm (a 128-value head) is too little work alone."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        in_rows = rows < n_rows
        mask = in_rows[:, None] & (cols < n_cols)[None, :]
        tile = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            residual = tl.load(
                residual_ptr + rows[:, None] * residual_row_stride + cols[None, :], mask=mask, other=0.0
            )
            # Round the sum to the residual stream's dtype first, so the norm sees what is stored.
            summed = (x + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
            tl.store(summed_ptr + tile, summed, mask=mask)
            x = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=in_rows)
        weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + weight_offset
        y = (x * rstd[:, None]) * weight[None, :]
        if HAS_GATE:
            gate_rows = (rows // gate_heads) * gate_token_stride + (rows % gate_heads) * gate_head_stride
            gate = tl.load(gate_ptr + gate_rows[:, None] + cols[None, :], mask=mask, other=0.0)
            gate = gate.to(tl.float32)
            y = y * (gate * tl.sigmoid(gate))
        tl.store(y_ptr + tile, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(
        dy_ptr,
        dsummed_ptr,
        x_ptr,
        gate_ptr,
        weight_ptr,
        rstd_ptr,
        dx_ptr,
        dgate_ptr,
        dweight_partial_ptr,
        dy_row_stride,
        dsummed_row_stride,
        gate_token_stride,
        gate_head_stride,
        gate_heads,
        n_rows,
        n_cols,
        weight_offset,
        HAS_DSUMMED: tl.constexpr,
        HAS_GATE: tl.constexpr,
        COMPUTE_DWEIGHT: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One program walks a block of rows, ROWS at a time, keeping its share of dW in registers."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        dweight = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        row_start = pid.to(tl.int64) * ROWS_PER_PROGRAM
        for i in range(0, ROWS_PER_PROGRAM, ROWS):
            rows = row_start + i + tl.arange(0, ROWS)
            in_rows = rows < n_rows
            mask = in_rows[:, None] & col_mask[None, :]
            tile = rows[:, None] * n_cols + cols[None, :]
            dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            dy = dy.to(tl.float32)
            x = tl.load(x_ptr + tile, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
            x_hat = x * rstd[:, None]
            if HAS_GATE:
                gate_rows = (rows // gate_heads) * gate_token_stride + (rows % gate_heads) * gate_head_stride
                gate = tl.load(gate_ptr + gate_rows[:, None] + cols[None, :], mask=mask, other=0.0)
                gate = gate.to(tl.float32)
                sigmoid = tl.sigmoid(gate)
                dgate = dy * x_hat * weight[None, :] * sigmoid * (1.0 + gate * (1.0 - sigmoid))
                tl.store(dgate_ptr + tile, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
                dy = dy * (gate * sigmoid)
            dy_w = dy * weight[None, :]
            dx = rstd[:, None] * (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=1) / n_cols)[:, None])
            if HAS_DSUMMED:
                dsummed = tl.load(
                    dsummed_ptr + rows[:, None] * dsummed_row_stride + cols[None, :], mask=mask, other=0.0
                )
                dx += dsummed.to(tl.float32)
            tl.store(dx_ptr + tile, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DWEIGHT:
                dweight += dy * x_hat
        if COMPUTE_DWEIGHT:
            tl.store(dweight_partial_ptr + pid * n_cols + cols, tl.sum(dweight, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

_MAX_HIDDEN = 65536


# Values a program's tile holds: rows are grouped until a tile has this many (one row of 4096 and up).
_TILE = 4096


def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): a row padded to a power of two, as many rows as fill a tile."""
    if n_cols > _MAX_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {_MAX_HIDDEN}, got {n_cols}")
    block = triton.next_power_of_2(n_cols)
    rows = max(1, _TILE // block)
    return block, rows, min(max(rows * block // 512, 4), 16)


def _check_gate(x: torch.Tensor, gate: torch.Tensor) -> None:
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(
            f"gate must match x in shape and dtype, got {gate.dtype} {tuple(gate.shape)} "
            f"for {x.dtype} {tuple(x.shape)}"
        )


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    if not x.is_floating_point():
        raise TypeError(f"rms_norm needs a floating-point input, got {x.dtype}")


def zero_centred_offset(zero_centred: bool) -> float:
    """What the kernels add to the stored weight: 1 for a zero-centred norm's (1 + w)."""
    return 1.0 if zero_centred else 0.0


def _rms_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    gate3d: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, summed, rstd) as 2-D rows; summed is x itself when there is no residual.

    gate3d ([tokens, heads, n] of x's shape, from as_head_rows) multiplies the output by silu(gate).
    """
    _check(x, residual, weight)
    x2d = as_rows(x)
    n_rows, n_cols = x2d.shape
    residual2d = as_rows(residual) if residual is not None else x2d
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(y) if residual is not None else x2d
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block, rows, num_warps = _tile(n_cols)
    gate, gate_token_stride, gate_head_stride, gate_heads = _gate_rows(gate3d, x2d)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
        x2d,
        residual2d,
        gate,
        weight,
        y,
        summed,
        rstd,
        x2d.stride(0),
        residual2d.stride(0),
        gate_token_stride,
        gate_head_stride,
        gate_heads,
        n_rows,
        n_cols,
        eps,
        weight_offset,
        HAS_RESIDUAL=residual is not None,
        HAS_GATE=gate3d is not None,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    return y, summed, rstd


def _gate_rows(gate3d: torch.Tensor | None, rows2d: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """The gate's tensor, token and head strides and heads a token; without a gate, rows2d's rows
    (never read)."""
    if gate3d is None:
        return rows2d, rows2d.stride(0), 0, 1
    return gate3d, gate3d.stride(0), gate3d.stride(1), gate3d.shape[1]


def _backward_programs(n_rows: int, device: torch.device) -> int:
    return min(n_rows, 4 * multiprocessors(device))


def _rms_norm_backward(
    dy: torch.Tensor,
    dsummed: torch.Tensor | None,
    summed2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    weight_offset: float,
    compute_dweight: bool,
    gate3d: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dx (2-D, includes the gradient arriving through `summed`), dW (None unless asked) and
    dgate (2-D; None without a gate)."""
    summed2d = summed2d.contiguous()
    n_rows, n_cols = summed2d.shape
    # Gradients may arrive as row-strided views (kernels.linear returns dX beside the LoRA columns).
    dy2d = as_rows(dy)
    dsummed2d = as_rows(dsummed) if dsummed is not None else dy2d
    dx = torch.empty_like(summed2d)
    dgate = torch.empty_like(summed2d) if gate3d is not None else None
    gate, gate_token_stride, gate_head_stride, gate_heads = _gate_rows(gate3d, summed2d)
    block, rows, num_warps = _tile(n_cols)
    # A power of two, so the row-loop bound is a compile-time constant with few distinct values.
    rows_per_program = triton.next_power_of_2(triton.cdiv(n_rows, _backward_programs(n_rows, dy.device)))
    rows_per_program = max(rows, rows_per_program)
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dweight_partial = (
        torch.empty((n_programs, n_cols), dtype=torch.float32, device=dy.device) if compute_dweight else rstd
    )
    _rms_norm_bwd_kernel[(n_programs,)](
        dy2d,
        dsummed2d,
        summed2d,
        gate,
        weight,
        rstd,
        dx,
        dgate if dgate is not None else dx,
        dweight_partial,
        dy2d.stride(0),
        dsummed2d.stride(0),
        gate_token_stride,
        gate_head_stride,
        gate_heads,
        n_rows,
        n_cols,
        weight_offset,
        HAS_DSUMMED=dsummed is not None,
        HAS_GATE=gate3d is not None,
        COMPUTE_DWEIGHT=compute_dweight,
        ROWS_PER_PROGRAM=rows_per_program,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    dweight = dweight_partial.sum(0).to(weight.dtype) if compute_dweight else None
    return dx, dweight, dgate


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
        y, x2d, rstd = _rms_norm_forward(x, None, weight, eps, weight_offset)
        ctx.weight_offset = weight_offset
        ctx.save_for_backward(x2d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dweight, _ = _rms_norm_backward(
            dy, None, x2d, weight, rstd, ctx.weight_offset, ctx.needs_input_grad[1]
        )
        return dx.view(dy.shape), dweight, None, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, summed, rstd = _rms_norm_forward(x, residual, weight, eps, weight_offset)
        ctx.weight_offset = weight_offset
        ctx.save_for_backward(summed, weight, rstd)
        return y.view(x.shape), summed.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dsummed: torch.Tensor):
        summed, weight, rstd = ctx.saved_tensors
        dx, dweight, _ = _rms_norm_backward(
            dy, dsummed, summed, weight, rstd, ctx.weight_offset, ctx.needs_input_grad[2]
        )
        dx = dx.view(dy.shape)
        return dx, dx, dweight, None, None


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        gate3d = as_head_rows(gate)
        y, x2d, rstd = _rms_norm_forward(x, None, weight, eps, 0.0, gate3d)
        ctx.save_for_backward(x2d, gate3d, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, gate3d, weight, rstd = ctx.saved_tensors
        dx, dweight, dgate = _rms_norm_backward(
            dy, None, x2d, weight, rstd, 0.0, ctx.needs_input_grad[2], gate3d
        )
        return dx.view(dy.shape), dgate.view(dy.shape), dweight, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centred: bool = False
) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; dW is computed only when weight requires grad.

    zero_centred scales by (1 + weight) instead (Qwen3.5's norms, weight initialised to 0). The
    Triton path returns x's dtype (the activation dtype) even when weight is wider.
    """
    if use_triton(x):
        return RMSNormFunction.apply(x, weight, eps, zero_centred_offset(zero_centred))
    return rms_norm_reference(x, weight, eps, zero_centred=zero_centred)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is the next residual."""
    if residual is None:
        return rms_norm(x, weight, eps, zero_centred=zero_centred), x
    if use_triton(x):
        return AddRMSNormFunction.apply(x, residual, weight, eps, zero_centred_offset(zero_centred))
    return add_rms_norm_reference(x, residual, weight, eps, zero_centred=zero_centred)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(gate) over the last dim (Qwen3.5's Gated DeltaNet output norm,
    per head: x and gate [..., head_v_dim], weight [head_v_dim] initialised to 1).

    gate matches x in shape and dtype; dW is computed only when weight requires grad.
    """
    _check_gate(x, gate)
    if use_triton(x):
        return GatedRMSNormFunction.apply(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)
