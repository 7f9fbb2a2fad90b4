"""x * sigmoid(gate) elementwise: Qwen3.5's attention output gate, fused forward and backward.

q_proj's output holds each head's query and gate side by side, so the gate arrives as a strided
view [B, S, H, D] (stride 2 * D between heads); the kernels read it, the attention output and the
incoming gradient through their strides, computing in fp32 and storing once in the input dtype.
Backward recomputes sigmoid(gate) from the saved inputs.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import unit_last_stride

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """HF Qwen3_5Attention's `attn_output * torch.sigmoid(gate)`, in the input dtype."""
    return x * torch.sigmoid(gate)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _head_tile(ptr, stride_b, stride_s, stride_h, batch, pos, heads, dims, mask):
        """[heads, dims] of one token from a [B, S, H, D] tensor with unit stride along D, in fp32."""
        offsets = batch * stride_b + pos * stride_s + heads * stride_h + dims
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _sigmoid_gate_fwd_kernel(
        x_ptr,
        gate_ptr,
        out_ptr,
        x_stride_b,
        x_stride_s,
        x_stride_h,
        gate_stride_b,
        gate_stride_s,
        gate_stride_h,
        seq_len,
        n_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (token, block of heads)."""
        token = tl.program_id(0).to(tl.int64)
        batch = token // seq_len
        pos = token % seq_len
        heads = (tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS))[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < n_heads) & (dims < HEAD_DIM)
        x = _head_tile(x_ptr, x_stride_b, x_stride_s, x_stride_h, batch, pos, heads, dims, mask)
        gate = _head_tile(
            gate_ptr, gate_stride_b, gate_stride_s, gate_stride_h, batch, pos, heads, dims, mask
        )
        out = x * tl.sigmoid(gate)
        out_offsets = (token * n_heads + heads) * HEAD_DIM + dims
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sigmoid_gate_bwd_kernel(
        dout_ptr,
        x_ptr,
        gate_ptr,
        dx_ptr,
        dgate_ptr,
        dout_stride_b,
        dout_stride_s,
        dout_stride_h,
        x_stride_b,
        x_stride_s,
        x_stride_h,
        gate_stride_b,
        gate_stride_s,
        gate_stride_h,
        seq_len,
        n_heads,
        HEAD_DIM: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """dx = dout * s and dgate = dout * x * s * (1 - s), with s = sigmoid(gate)."""
        token = tl.program_id(0).to(tl.int64)
        batch = token // seq_len
        pos = token % seq_len
        heads = (tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS))[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < n_heads) & (dims < HEAD_DIM)
        dout = _head_tile(
            dout_ptr, dout_stride_b, dout_stride_s, dout_stride_h, batch, pos, heads, dims, mask
        )
        x = _head_tile(x_ptr, x_stride_b, x_stride_s, x_stride_h, batch, pos, heads, dims, mask)
        gate = _head_tile(
            gate_ptr, gate_stride_b, gate_stride_s, gate_stride_h, batch, pos, heads, dims, mask
        )
        sigmoid = tl.sigmoid(gate)
        dx = dout * sigmoid
        dgate = dx * x * (1.0 - sigmoid)
        out_offsets = (token * n_heads + heads) * HEAD_DIM + dims
        tl.store(dx_ptr + out_offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_ptr + out_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

# Elements one program holds per tensor: a tile of heads for small head_dim, one head for large.
_TILE_ELEMENTS = 4096


def _check(x: torch.Tensor, gate: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got {tuple(x.shape)}")
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(
            f"gate must match x in shape and dtype, got {gate.dtype} {tuple(gate.shape)} "
            f"for {x.dtype} {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"sigmoid_gate needs a floating-point input, got {x.dtype}")


def _grid_and_blocks(shape: torch.Size) -> tuple[tuple[int, int], dict]:
    batch, seq_len, n_heads, head_dim = shape
    block_d = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(n_heads), max(_TILE_ELEMENTS // block_d, 1))
    grid = (batch * seq_len, triton.cdiv(n_heads, block_heads))
    blocks = {"HEAD_DIM": head_dim, "BLOCK_HEADS": block_heads, "BLOCK_D": block_d, "num_warps": 4}
    return grid, blocks


def _sigmoid_gate_forward(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    x, gate = unit_last_stride(x), unit_last_stride(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid, blocks = _grid_and_blocks(x.shape)
    _sigmoid_gate_fwd_kernel[grid](
        x, gate, out, *x.stride()[:3], *gate.stride()[:3], x.shape[1], x.shape[2], **blocks
    )
    return out


def _sigmoid_gate_backward(
    dout: torch.Tensor, x: torch.Tensor, gate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dout, x, gate = unit_last_stride(dout), unit_last_stride(x), unit_last_stride(gate)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dgate = torch.empty_like(dx)
    grid, blocks = _grid_and_blocks(x.shape)
    _sigmoid_gate_bwd_kernel[grid](
        dout,
        x,
        gate,
        dx,
        dgate,
        *dout.stride()[:3],
        *x.stride()[:3],
        *gate.stride()[:3],
        x.shape[1],
        x.shape[2],
        **blocks,
    )
    return dx, dgate


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class SigmoidGateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, gate)
        return _sigmoid_gate_forward(x, gate)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, gate = ctx.saved_tensors
        return _sigmoid_gate_backward(dout, x, gate)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x and gate [B, S, H, D] of one dtype; returns a contiguous tensor.

    Either may be a strided view (the gate half of q_proj's per-head [query | gate] output).
    """
    _check(x, gate)
    if use_triton(x):
        return SigmoidGateFunction.apply(x, gate)
    return sigmoid_gate_reference(x, gate)
