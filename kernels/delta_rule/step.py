"""One decode token: each (Dv block, row, v-head) reads its slice of the fp32 state, applies the
token and writes it back in place, with no host sync, so that a CUDA graph can capture it."""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE
from qlora_kernels._layout import unit_last_stride

from .scan import _block_v

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _step_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        o_ptr,
        v_heads,
        k_dim,
        v_dim,
        q_stride_b,
        q_stride_h,
        k_stride_b,
        k_stride_h,
        v_stride_b,
        v_stride_h,
        g_stride_b,
        g_stride_h,
        beta_stride_b,
        beta_stride_h,
        state_stride_b,
        state_stride_h,
        state_stride_k,
        scale,
        NORMALIZE: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One decode token for a [Dk, BLOCK_V] slice of one state, read and written by this program only."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        dims = tl.arange(0, BLOCK_K)
        v_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_mask = dims < k_dim
        v_mask = v_cols < v_dim
        q = tl.load(q_ptr + batch * q_stride_b + (head // GROUP) * q_stride_h + dims, mask=k_mask, other=0.0)
        k = tl.load(k_ptr + batch * k_stride_b + (head // GROUP) * k_stride_h + dims, mask=k_mask, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if NORMALIZE:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + batch * v_stride_b + head * v_stride_h + v_cols, mask=v_mask, other=0.0).to(
            tl.float32
        )
        g = tl.load(g_ptr + batch * g_stride_b + head * g_stride_h).to(tl.float32)
        beta = tl.load(beta_ptr + batch * beta_stride_b + head * beta_stride_h).to(tl.float32)
        state_ptrs = state_ptr + batch * state_stride_b + head * state_stride_h
        state_ptrs += dims[:, None] * state_stride_k + v_cols[None, :]
        state_mask = k_mask[:, None] & v_mask[None, :]
        s = tl.load(state_ptrs, mask=state_mask, other=0.0) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s += k[:, None] * delta[None, :]
        tl.store(state_ptrs, s, mask=state_mask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (batch * v_heads + head) * v_dim + v_cols, o.to(o_ptr.dtype.element_ty), mask=v_mask)


def _step(q, k, v, g, beta, state, scale, normalize_qk) -> torch.Tensor:
    batch, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != batch or g.shape != (batch, v_heads) or beta.shape != g.shape:
        raise ValueError("q, k must be [B, Hk, Dk], v [B, Hv, Dv] and g, beta [B, Hv]")
    if state.shape != (batch, v_heads, k_dim, v_dim) or state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(
            f"state must be fp32 [B, Hv, Dk, Dv] = {(batch, v_heads, k_dim, v_dim)}, unit last stride"
        )
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    o = torch.empty(batch, v_heads, v_dim, dtype=v.dtype, device=v.device)
    block_v = _block_v(v_dim)
    _step_kernel[(triton.cdiv(v_dim, block_v), batch, v_heads)](
        q,
        k,
        v,
        g,
        beta,
        state,
        o,
        v_heads,
        k_dim,
        v_dim,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        scale,
        NORMALIZE=normalize_qk,
        GROUP=v_heads // k_heads,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=block_v,
    )
    return o
