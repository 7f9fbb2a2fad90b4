"""Rotate-half RoPE on Q and K in one launch, with Qwen3's optional per-head QK-norm fused in.

Positions come per token, so packed documents restart at 0 without any extra masking. The kernel
computes the angles itself (fp32) instead of reading cos/sin tables, and backward rotates the
gradient by the negative angle, so nothing but the inputs (only when QK-norm is on) is saved.
Qwen3.5's variants are options: partial rotary (inv_freq covers only the first rotary_dim dims
of each head; the rest pass through, though QK-norm still spans the whole head), a zero-centred
QK-norm weight, and yarn/longrope's attention_scaling on cos and sin.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import unit_last_stride

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
from qlora_kernels.rmsnorm import rms_norm_reference, zero_centred_offset

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    zero_centred_norm: bool = False,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's Qwen3 (Qwen3.5 when zero_centred_norm) q_norm/k_norm, then apply_rotary_pos_emb.

    As HF, cos/sin are scaled in fp32 and cast to the activation dtype, and the rotary part is as
    wide as cos: the first 2 * len(inv_freq) dims of each head, the rest passing through.
    """
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps, zero_centred=zero_centred_norm)
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps, zero_centred=zero_centred_norm)
    angle = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((angle, angle), dim=-1)
    cos = (emb.cos() * attention_scaling).to(q.dtype).unsqueeze(2)
    sin = (emb.sin() * attention_scaling).to(q.dtype).unsqueeze(2)
    rotary_dim = emb.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _rope_heads_fwd(
        x_ptr,
        out_ptr,
        weight_ptr,
        head_stride,
        n_heads,
        cos,
        sin,
        eps,
        weight_offset,
        NORM: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY_HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        """All heads of one token, as [heads, first half] and [heads, second half] tiles of the
        rotary dims, and a [heads, rest] tile of the dims that pass through (partial rotary)."""
        half: tl.constexpr = ROTARY_HALF
        pass_start: tl.constexpr = 2 * ROTARY_HALF
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        dims = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < n_heads) & (dims < half)
        x_ptrs = x_ptr + heads * head_stride + dims
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32)
        if pass_start < HEAD_DIM:
            pass_dims = pass_start + tl.arange(0, BLOCK_PASS)[None, :]
            pass_mask = (heads < n_heads) & (pass_dims < HEAD_DIM)
            x3 = tl.load(x_ptr + heads * head_stride + pass_dims, mask=pass_mask, other=0.0).to(tl.float32)
        if NORM:
            sum_squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if pass_start < HEAD_DIM:
                sum_squares += tl.sum(x3 * x3, axis=1)
            rstd = 1.0 / tl.sqrt(sum_squares / HEAD_DIM + eps)
            w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32) + weight_offset
            w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32) + weight_offset
            x1 = (x1 * rstd[:, None]) * w1
            x2 = (x2 * rstd[:, None]) * w2
            if pass_start < HEAD_DIM:
                w3 = tl.load(weight_ptr + pass_dims, mask=pass_dims < HEAD_DIM, other=0.0).to(tl.float32)
                x3 = (x3 * rstd[:, None]) * (w3 + weight_offset)
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        out_ptrs = out_ptr + heads * HEAD_DIM + dims
        tl.store(out_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + half, out2.to(out_ptr.dtype.element_ty), mask=mask)
        if pass_start < HEAD_DIM:
            tl.store(out_ptr + heads * HEAD_DIM + pass_dims, x3.to(out_ptr.dtype.element_ty), mask=pass_mask)

    @triton.jit
    def _rope_heads_bwd(
        dout_ptr,
        x_ptr,
        dx_ptr,
        weight_ptr,
        dweight_partial_ptr,
        dout_head_stride,
        x_head_stride,
        n_heads,
        cos,
        sin,
        eps,
        weight_offset,
        NORM: tl.constexpr,
        COMPUTE_DWEIGHT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY_HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        """Rotate the gradient back by -angle, then (with QK-norm) through the per-head RMSNorm;
        the pass-through dims' gradient goes to the norm unrotated."""
        half: tl.constexpr = ROTARY_HALF
        pass_start: tl.constexpr = 2 * ROTARY_HALF
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        dims = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < n_heads) & (dims < half)
        dout_ptrs = dout_ptr + heads * dout_head_stride + dims
        dout1 = tl.load(dout_ptrs, mask=mask, other=0.0).to(tl.float32)
        dout2 = tl.load(dout_ptrs + half, mask=mask, other=0.0).to(tl.float32)
        grad1 = dout1 * cos + dout2 * sin
        grad2 = dout2 * cos - dout1 * sin
        if pass_start < HEAD_DIM:
            pass_offsets = pass_start + tl.arange(0, BLOCK_PASS)
            pass_dims = pass_offsets[None, :]
            pass_mask = (heads < n_heads) & (pass_dims < HEAD_DIM)
            grad3 = tl.load(dout_ptr + heads * dout_head_stride + pass_dims, mask=pass_mask, other=0.0)
            grad3 = grad3.to(tl.float32)
        if NORM:
            x_ptrs = x_ptr + heads * x_head_stride + dims
            x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32)
            sum_squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if pass_start < HEAD_DIM:
                x3 = tl.load(x_ptr + heads * x_head_stride + pass_dims, mask=pass_mask, other=0.0)
                x3 = x3.to(tl.float32)
                sum_squares += tl.sum(x3 * x3, axis=1)
            rstd = (1.0 / tl.sqrt(sum_squares / HEAD_DIM + eps))[:, None]
            x1_hat = x1 * rstd
            x2_hat = x2 * rstd
            if pass_start < HEAD_DIM:
                x3_hat = x3 * rstd
            if COMPUTE_DWEIGHT:
                dim_offsets = tl.arange(0, BLOCK_HALF)
                dim_mask = dim_offsets < half
                tl.store(dweight_partial_ptr + dim_offsets, tl.sum(grad1 * x1_hat, axis=0), mask=dim_mask)
                tl.store(
                    dweight_partial_ptr + half + dim_offsets, tl.sum(grad2 * x2_hat, axis=0), mask=dim_mask
                )
                if pass_start < HEAD_DIM:
                    tl.store(
                        dweight_partial_ptr + pass_offsets,
                        tl.sum(grad3 * x3_hat, axis=0),
                        mask=pass_offsets < HEAD_DIM,
                    )
            w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32) + weight_offset
            w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32) + weight_offset
            grad1 = grad1 * w1
            grad2 = grad2 * w2
            dot = tl.sum(grad1 * x1_hat, axis=1) + tl.sum(grad2 * x2_hat, axis=1)
            if pass_start < HEAD_DIM:
                w3 = tl.load(weight_ptr + pass_dims, mask=pass_dims < HEAD_DIM, other=0.0).to(tl.float32)
                grad3 = grad3 * (w3 + weight_offset)
                dot += tl.sum(grad3 * x3_hat, axis=1)
            mean_dot = dot / HEAD_DIM
            grad1 = rstd * (grad1 - x1_hat * mean_dot[:, None])
            grad2 = rstd * (grad2 - x2_hat * mean_dot[:, None])
            if pass_start < HEAD_DIM:
                grad3 = rstd * (grad3 - x3_hat * mean_dot[:, None])
        dx_ptrs = dx_ptr + heads * HEAD_DIM + dims
        tl.store(dx_ptrs, grad1.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptrs + half, grad2.to(dx_ptr.dtype.element_ty), mask=mask)
        if pass_start < HEAD_DIM:
            tl.store(dx_ptr + heads * HEAD_DIM + pass_dims, grad3.to(dx_ptr.dtype.element_ty), mask=pass_mask)

    @triton.jit
    def _token_angles(
        positions_ptr,
        inv_freq_ptr,
        token,
        attention_scaling,
        ROTARY_HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        """cos and sin of position * inv_freq for one token, times attention_scaling, as
        [1, BLOCK_HALF] rows (fp32 as HF)."""
        dims = tl.arange(0, BLOCK_HALF)
        inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < ROTARY_HALF, other=0.0)
        angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
        return (tl.cos(angle) * attention_scaling)[None, :], (tl.sin(angle) * attention_scaling)[None, :]

    @triton.jit
    def _rope_fwd_kernel(
        q_ptr,
        k_ptr,
        q_out_ptr,
        k_out_ptr,
        positions_ptr,
        inv_freq_ptr,
        q_weight_ptr,
        k_weight_ptr,
        seq_len,
        q_stride_b,
        q_stride_s,
        q_stride_h,
        k_stride_b,
        k_stride_s,
        k_stride_h,
        n_q_heads,
        n_k_heads,
        eps,
        weight_offset,
        attention_scaling,
        Q_NORM: tl.constexpr,
        K_NORM: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY_HALF: tl.constexpr,
        BLOCK_Q_HEADS: tl.constexpr,
        BLOCK_K_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        """One program per token: every Q head and every K head share its cos/sin."""
        token = tl.program_id(0).to(tl.int64)
        batch = token // seq_len
        pos = token % seq_len
        cos, sin = _token_angles(
            positions_ptr, inv_freq_ptr, token, attention_scaling, ROTARY_HALF, BLOCK_HALF
        )
        _rope_heads_fwd(
            q_ptr + batch * q_stride_b + pos * q_stride_s,
            q_out_ptr + token * n_q_heads * HEAD_DIM,
            q_weight_ptr,
            q_stride_h,
            n_q_heads,
            cos,
            sin,
            eps,
            weight_offset,
            Q_NORM,
            HEAD_DIM,
            ROTARY_HALF,
            BLOCK_Q_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
        )
        _rope_heads_fwd(
            k_ptr + batch * k_stride_b + pos * k_stride_s,
            k_out_ptr + token * n_k_heads * HEAD_DIM,
            k_weight_ptr,
            k_stride_h,
            n_k_heads,
            cos,
            sin,
            eps,
            weight_offset,
            K_NORM,
            HEAD_DIM,
            ROTARY_HALF,
            BLOCK_K_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
        )

    @triton.jit
    def _rope_bwd_kernel(
        dq_out_ptr,
        dk_out_ptr,
        q_ptr,
        k_ptr,
        dq_ptr,
        dk_ptr,
        positions_ptr,
        inv_freq_ptr,
        q_weight_ptr,
        k_weight_ptr,
        dq_weight_partial_ptr,
        dk_weight_partial_ptr,
        seq_len,
        dq_out_stride_b,
        dq_out_stride_s,
        dq_out_stride_h,
        dk_out_stride_b,
        dk_out_stride_s,
        dk_out_stride_h,
        q_stride_b,
        q_stride_s,
        q_stride_h,
        k_stride_b,
        k_stride_s,
        k_stride_h,
        n_q_heads,
        n_k_heads,
        eps,
        weight_offset,
        attention_scaling,
        Q_NORM: tl.constexpr,
        K_NORM: tl.constexpr,
        Q_DWEIGHT: tl.constexpr,
        K_DWEIGHT: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROTARY_HALF: tl.constexpr,
        BLOCK_Q_HEADS: tl.constexpr,
        BLOCK_K_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
    ):
        """One program per token; norm-weight gradients go to a per-token row, summed afterwards."""
        token = tl.program_id(0).to(tl.int64)
        batch = token // seq_len
        pos = token % seq_len
        cos, sin = _token_angles(
            positions_ptr, inv_freq_ptr, token, attention_scaling, ROTARY_HALF, BLOCK_HALF
        )
        _rope_heads_bwd(
            dq_out_ptr + batch * dq_out_stride_b + pos * dq_out_stride_s,
            q_ptr + batch * q_stride_b + pos * q_stride_s,
            dq_ptr + token * n_q_heads * HEAD_DIM,
            q_weight_ptr,
            dq_weight_partial_ptr + token * HEAD_DIM,
            dq_out_stride_h,
            q_stride_h,
            n_q_heads,
            cos,
            sin,
            eps,
            weight_offset,
            Q_NORM,
            Q_DWEIGHT,
            HEAD_DIM,
            ROTARY_HALF,
            BLOCK_Q_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
        )
        _rope_heads_bwd(
            dk_out_ptr + batch * dk_out_stride_b + pos * dk_out_stride_s,
            k_ptr + batch * k_stride_b + pos * k_stride_s,
            dk_ptr + token * n_k_heads * HEAD_DIM,
            k_weight_ptr,
            dk_weight_partial_ptr + token * HEAD_DIM,
            dk_out_stride_h,
            k_stride_h,
            n_k_heads,
            cos,
            sin,
            eps,
            weight_offset,
            K_NORM,
            K_DWEIGHT,
            HEAD_DIM,
            ROTARY_HALF,
            BLOCK_K_HEADS,
            BLOCK_HALF,
            BLOCK_PASS,
        )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _check(q, k, positions, inv_freq, q_norm_weight, k_norm_weight) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be [batch, seq, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    batch, seq_len, _, head_dim = q.shape
    if k.shape[:2] != (batch, seq_len) or k.shape[3] != head_dim or k.dtype != q.dtype:
        raise ValueError("k must match q in batch, seq, head_dim and dtype")
    if positions.shape != (batch, seq_len) or positions.is_floating_point():
        raise ValueError(
            f"positions must be integer [{batch}, {seq_len}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if inv_freq.dim() != 1 or not 0 < inv_freq.numel() <= head_dim // 2 or inv_freq.dtype != torch.float32:
        raise ValueError(
            f"inv_freq must be fp32 [rotary_dim / 2], at most [{head_dim // 2}], "
            f"got {inv_freq.dtype} {tuple(inv_freq.shape)}"
        )
    for weight in (q_norm_weight, k_norm_weight):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"QK-norm weights must be [{head_dim}], got {tuple(weight.shape)}")


def _blocks(n_q_heads: int, n_k_heads: int, head_dim: int, rotary_half: int) -> dict:
    block_q_heads = triton.next_power_of_2(n_q_heads)
    return {
        "HEAD_DIM": head_dim,
        "ROTARY_HALF": rotary_half,
        "BLOCK_Q_HEADS": block_q_heads,
        "BLOCK_K_HEADS": triton.next_power_of_2(n_k_heads),
        "BLOCK_HALF": triton.next_power_of_2(rotary_half),
        "BLOCK_PASS": triton.next_power_of_2(max(head_dim - 2 * rotary_half, 1)),
        "num_warps": 8 if block_q_heads * head_dim >= 4096 else 4,
    }


def _rope_forward(
    q, k, positions, inv_freq, q_norm_weight, k_norm_weight, eps, weight_offset, attention_scaling
):
    _check(q, k, positions, inv_freq, q_norm_weight, k_norm_weight)
    q, k = unit_last_stride(q), unit_last_stride(k)
    batch, seq_len, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[2]
    q_out = torch.empty((batch, seq_len, n_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((batch, seq_len, n_k_heads, head_dim), dtype=k.dtype, device=k.device)
    _rope_fwd_kernel[(batch * seq_len,)](
        q,
        k,
        q_out,
        k_out,
        positions.reshape(-1).contiguous(),
        inv_freq.contiguous(),
        q_norm_weight if q_norm_weight is not None else inv_freq,
        k_norm_weight if k_norm_weight is not None else inv_freq,
        seq_len,
        *q.stride()[:3],
        *k.stride()[:3],
        n_q_heads,
        n_k_heads,
        eps,
        weight_offset,
        attention_scaling,
        Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None,
        **_blocks(n_q_heads, n_k_heads, head_dim, inv_freq.numel()),
    )
    return q_out, k_out


def _rope_backward(
    dq_out,
    dk_out,
    q,
    k,
    positions,
    inv_freq,
    q_norm_weight,
    k_norm_weight,
    eps,
    weight_offset,
    attention_scaling,
    dweights,
):
    """dq, dk and the QK-norm weight gradients asked for in `dweights` (q, k), else None."""
    dq_out, dk_out = unit_last_stride(dq_out), unit_last_stride(dk_out)
    q, k = unit_last_stride(q), unit_last_stride(k)
    batch, seq_len, n_q_heads, head_dim = dq_out.shape
    n_k_heads = dk_out.shape[2]
    n_tokens = batch * seq_len
    dq = torch.empty_like(dq_out, memory_format=torch.contiguous_format)
    dk = torch.empty_like(dk_out, memory_format=torch.contiguous_format)
    partials = [
        torch.empty((n_tokens, head_dim), dtype=torch.float32, device=q.device) if wanted else inv_freq
        for wanted in dweights
    ]
    _rope_bwd_kernel[(n_tokens,)](
        dq_out,
        dk_out,
        q,
        k,
        dq,
        dk,
        positions.reshape(-1).contiguous(),
        inv_freq.contiguous(),
        q_norm_weight if q_norm_weight is not None else inv_freq,
        k_norm_weight if k_norm_weight is not None else inv_freq,
        partials[0],
        partials[1],
        seq_len,
        *dq_out.stride()[:3],
        *dk_out.stride()[:3],
        *q.stride()[:3],
        *k.stride()[:3],
        n_q_heads,
        n_k_heads,
        eps,
        weight_offset,
        attention_scaling,
        Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None,
        Q_DWEIGHT=dweights[0],
        K_DWEIGHT=dweights[1],
        **_blocks(n_q_heads, n_k_heads, head_dim, inv_freq.numel()),
    )
    dq_weight, dk_weight = (
        partial.sum(0).to(weight.dtype) if wanted else None
        for partial, weight, wanted in zip(partials, (q_norm_weight, k_norm_weight), dweights, strict=True)
    )
    return dq, dk, dq_weight, dk_weight


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, positions, inv_freq, q_norm_weight, k_norm_weight, eps, weight_offset, attention_scaling
    ):
        ctx.eps = eps
        ctx.weight_offset = weight_offset
        ctx.attention_scaling = attention_scaling
        ctx.q_norm = q_norm_weight is not None
        ctx.k_norm = k_norm_weight is not None
        # The pre-norm inputs are only needed to backpropagate through QK-norm.
        ctx.save_for_backward(
            q if ctx.q_norm else None,
            k if ctx.k_norm else None,
            positions,
            inv_freq,
            q_norm_weight,
            k_norm_weight,
        )
        return _rope_forward(
            q, k, positions, inv_freq, q_norm_weight, k_norm_weight, eps, weight_offset, attention_scaling
        )

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, positions, inv_freq, q_norm_weight, k_norm_weight = ctx.saved_tensors
        dweights = (ctx.q_norm and ctx.needs_input_grad[4], ctx.k_norm and ctx.needs_input_grad[5])
        dq, dk, dq_weight, dk_weight = _rope_backward(
            dq_out,
            dk_out,
            q if q is not None else dq_out,
            k if k is not None else dk_out,
            positions,
            inv_freq,
            q_norm_weight,
            k_norm_weight,
            ctx.eps,
            ctx.weight_offset,
            ctx.attention_scaling,
            dweights,
        )
        return dq, dk, None, None, dq_weight, dk_weight, None, None, None


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    zero_centred_norm: bool = False,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(QK-norm, then) RoPE on q [B, S, Hq, D] and k [B, S, Hk, D]; returns contiguous copies.

    q and k may be strided views into a fused QKV output. positions [B, S] restart at 0 for each
    packed document. inv_freq [rotary_dim / 2] is fp32: with rotary_dim < D only the first
    rotary_dim dims of each head rotate (Qwen3.5's partial rotary) and the rest pass through;
    QK-norm spans all D. zero_centred_norm scales the QK-norm by (1 + weight) (Qwen3.5);
    attention_scaling multiplies cos and sin (yarn, longrope).
    """
    args = (q, k, positions, inv_freq, q_norm_weight, k_norm_weight, eps)
    if use_triton(q):
        return RopeFunction.apply(*args, zero_centred_offset(zero_centred_norm), attention_scaling)
    return rope_reference(*args, zero_centred_norm=zero_centred_norm, attention_scaling=attention_scaling)
