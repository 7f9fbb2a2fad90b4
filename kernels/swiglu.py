"""SwiGLU on the fused gate/up projection output: silu(gate) * up.

Backward recomputes silu from the saved gate/up input instead of keeping activations, and writes
the gradient of the whole fused [gate | up] tensor in one kernel.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """HF Qwen2MLP's act_fn(gate) * up, on gate and up laid side by side in the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_fwd_kernel(gate_up_ptr, out_ptr, gate_up_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dout_ptr, gate_up_ptr, dgate_up_ptr, dout_row_stride, gate_up_row_stride, n_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + row * dout_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * silu
    dgate_ptrs = dgate_up_ptr + row * (2 * n_cols) + cols
    tl.store(dgate_ptrs, dgate.to(dgate_up_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptrs + n_cols, dup.to(dgate_up_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

_BLOCK = 1024


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] as [rows, n] with a unit stride along n."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _grid_and_block(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int]:
    block = min(_BLOCK, triton.next_power_of_2(n_cols))
    return (n_rows, triton.cdiv(n_cols, block)), block


def _swiglu_forward(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    if not gate_up.is_floating_point():
        raise TypeError(f"swiglu needs a floating-point input, got {gate_up.dtype}")
    gate_up2d = _rows(gate_up)
    n_rows, n_cols = gate_up2d.shape[0], gate_up2d.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    grid, block = _grid_and_block(n_rows, n_cols)
    _swiglu_fwd_kernel[grid](gate_up2d, out, gate_up2d.stride(0), n_cols, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n_cols)


def _swiglu_backward(dout: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up2d = _rows(gate_up)
    n_rows, n_cols = gate_up2d.shape[0], gate_up2d.shape[1] // 2
    dout2d = _rows(dout)
    dgate_up = torch.empty((n_rows, 2 * n_cols), dtype=gate_up.dtype, device=gate_up.device)
    grid, block = _grid_and_block(n_rows, n_cols)
    _swiglu_bwd_kernel[grid](
        dout2d, gate_up2d, dgate_up, dout2d.stride(0), gate_up2d.stride(0), n_cols, BLOCK=block
    )
    return dgate_up.view(gate_up.shape)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return _swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        return _swiglu_backward(dout, gate_up)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., gate | up]; returns [..., I] in gate_up's dtype."""
    if use_triton(gate_up):
        return SwiGLUFunction.apply(gate_up)
    return swiglu_reference(gate_up)
