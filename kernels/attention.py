"""Causal grouped-query attention with packed-document masking, forward and backward.

Query i of a row may see key j when j <= i and both tokens belong to the same document; with a sliding
window W, also only when i - j < W (the W latest keys, itself included, as transformers' Mistral). The
Triton path is flash-attention style: scores never exist as an S x S tensor; the forward keeps
only the output and the per-row logsumexp, and the backward recomputes scores block by block.
A window shorter than the row runs on torch's attention a block of queries at a time.
"""

import functools
import math

import torch
import torch.nn.functional as F

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import unit_last_stride

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl


def _allowed_mask(
    seq_len: int, doc_ids: torch.Tensor | None, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Boolean [B or 1, 1, S, S] mask, True where query i may attend key j."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    if doc_ids is None:
        return causal[None, None]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (causal[None] & same_doc)[:, None]


def attention_reference(q, k, v, doc_ids=None, scale=None, window=None):
    """Scores materialized in fp32: the numerical truth, and the CPU path for small runs."""
    _, seq_len, n_q_heads, head_dim = q.shape
    group = n_q_heads // k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_allowed_mask(seq_len, doc_ids, q.device, window), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(1, 2).contiguous().to(q.dtype)


def attention_windowed(q, k, v, doc_ids, window: int, scale=None):
    """Sliding-window attention on torch's fused attention, `window` queries at a time over the keys they
    can reach (the previous window - 1 and their own), so no mask is larger than W x 2W. Only generation
    needs it, for prompts longer than the window; training stays within the window (refused otherwise)."""
    seq_len, group = q.shape[1], q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    # Explicit kv heads keep the memory-efficient kernel usable with a boolean mask.
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    positions = torch.arange(seq_len, device=q.device)
    blocks = []
    for start in range(0, seq_len, window):
        end, first = min(start + window, seq_len), max(0, start - window + 1)
        distance = positions[start:end, None] - positions[None, first:end]
        mask = ((distance >= 0) & (distance < window))[None, None]
        if doc_ids is not None:
            mask = mask & (doc_ids[:, start:end, None] == doc_ids[:, None, first:end])[:, None]
        blocks.append(
            F.scaled_dot_product_attention(
                qt[:, :, start:end], kt[:, :, first:end], vt[:, :, first:end], attn_mask=mask, scale=scale
            )
        )
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous()


def _check_inputs(q, k, v, doc_ids):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects q, k, v shaped [batch, seq, heads, head_dim]")
    batch, seq_len, n_q_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[:2] != (batch, seq_len) or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if n_q_heads % k.shape[2] != 0:
        raise ValueError(f"{n_q_heads} query heads are not a multiple of {k.shape[2]} kv heads")
    if doc_ids is not None and (doc_ids.shape != (batch, seq_len) or doc_ids.is_floating_point()):
        raise ValueError(
            f"doc_ids must be integers shaped [batch, seq] = {(batch, seq_len)}, got {doc_ids.shape}"
        )


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous. torch 2.11's cuDNN attention
    (sdpa's first choice on Hopper) keeps the plan its first backward at a shape built, with that
    gradient's strides: a later gradient laid out otherwise is read as if it had them (on an H200,
    dq, dk and dv 1.4 off, and illegal memory accesses). kernels.linear hands the o projection's
    input gradient on as a row-strided view, an FP8 or LoRA-free o contiguously, so one process
    can meet both. A copy of the gradient costs far less than the attention."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def attention_sdpa(q, k, v, doc_ids=None, scale=None):
    """torch's fused attention on the same inputs, for comparison and as an alternative backend."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if doc_ids is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        # Explicit kv heads keep the memory-efficient kernel usable with a boolean mask.
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        mask = _allowed_mask(q.shape[1], doc_ids, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return _ContiguousGradient.apply(out.transpose(1, 2).contiguous())


@functools.cache
def _flex_attention(compiled: bool):
    """flex_attention, compiled once per process for CUDA (uncompiled it materializes the scores);
    imported on first use, so this module loads where flex attention is missing."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


FLEX_BLOCK = 128


def document_block_mask(
    doc_ids: torch.Tensor | None, batch: int, seq_len: int, device, block: int = FLEX_BLOCK
):
    """FlexAttention's BlockMask for causal attention within documents, built from the document
    starts with tensor ops alone (no mask evaluation over S x S, no host sync, so a CUDA graph can
    capture it).

    Query block m reads the key blocks from its first query's document start up to m; documents are
    contiguous, so that first query's start is the earliest in the block. Of those, the blocks below
    the diagonal from its last query's document start on are full: every pair in them is allowed, so
    the kernel skips the mask function there. The rest (across a document start, and the diagonal)
    are partial, where it evaluates it."""
    from torch.nn.attention.flex_attention import BlockMask

    n_blocks = -(-seq_len // block)
    blocks = torch.arange(n_blocks, device=device, dtype=torch.int32)
    if doc_ids is None:
        first = full_first = torch.zeros(batch, n_blocks, device=device, dtype=torch.int32)

        def allowed(b, h, q, kv):
            return q >= kv
    else:
        starts = _document_bounds(doc_ids)[0]
        first = starts[:, ::block] // block
        last_query = (blocks * block + block - 1).clamp(max=seq_len - 1)
        full_first = (starts[:, last_query] + block - 1) // block

        def allowed(b, h, q, kv):
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    # Partial: [first, lo) and the diagonal m; full: [lo, m), where lo = min(full_first, m).
    lo = torch.minimum(full_first, blocks)
    j = blocks  # the slot in a row of indices
    before = (lo - first)[..., None]
    partial_count = (before[..., 0] + 1).to(torch.int32)
    partial = torch.where(j < before, first[..., None] + j, torch.where(j == before, blocks[:, None], 0))
    full_count = (blocks - lo).to(torch.int32)
    full = torch.where(j < full_count[..., None], lo[..., None] + j, 0)
    return BlockMask.from_kv_blocks(
        partial_count[:, None],
        partial.to(torch.int32)[:, None],
        full_count[:, None],
        full.to(torch.int32)[:, None],
        BLOCK_SIZE=block,
        mask_mod=allowed,
        seq_lengths=(seq_len, seq_len),
    )


class _BlockMaskCache:
    """The block mask of the last doc_ids tensor seen: every layer of a forward, and its recompute in
    backward, read the same tensor, so the mask is built once per micro-batch. The tensor is held, so
    no other tensor can take its identity while it is cached; a write to it changes its version."""

    key: tuple | None = None
    doc_ids: torch.Tensor | None = None
    mask = None

    @classmethod
    def get(cls, doc_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device):
        key = (batch, seq_len, device, None if doc_ids is None else doc_ids._version)
        if key != cls.key or doc_ids is not cls.doc_ids:
            cls.mask = document_block_mask(doc_ids, batch, seq_len, device)
            cls.key, cls.doc_ids = key, doc_ids
        return cls.mask


def attention_flex(q, k, v, doc_ids=None, scale=None):
    """torch's FlexAttention with a causal document mask; its kernel skips the key blocks the mask
    empties, as ours does. Training needs CUDA: its CPU kernel has no backward (torch 2.13)."""
    flex_attention = _flex_attention(q.is_cuda)
    mask = _BlockMaskCache.get(doc_ids, q.shape[0], q.shape[1], q.device)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    out = flex_attention(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=group > 1)
    return out.transpose(1, 2).contiguous()


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _fwd_block(
        acc,
        row_max,
        row_sum,
        q,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        offs_m,
        row_doc_start,
        start_n,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One key block of the online softmax."""
        offs_d = tl.arange(0, D_PAD)
        d_valid = offs_d < HEAD_DIM
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_len
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        if CAUSAL:
            allowed = (offs_n[None, :] <= offs_m[:, None]) & n_valid[None, :]
            if HAS_DOCS:
                allowed = allowed & (offs_n[None, :] >= row_doc_start[:, None])
            scores = tl.where(allowed, scores, float("-inf"))
        elif HAS_DOCS:
            scores = tl.where(offs_n[None, :] >= row_doc_start[:, None], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.math.exp2(scores - new_max[:, None])
        correction = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
        return acc, row_max, row_sum

    @triton.jit
    def _fwd_block_loop(
        acc,
        row_max,
        row_sum,
        q,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        offs_m,
        row_doc_start,
        key_lo,
        key_hi,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Online softmax over key blocks [key_lo, key_hi); CAUSAL blocks straddle the diagonal.

        The three block loops run one `for` form both ways: compiled, Triton software-pipelines it;
        interpreted, its tensor bounds need a Triton newer than 3.6 under NumPy 2.4.
        """
        for start_n in range(key_lo, key_hi, BLOCK_N):
            acc, row_max, row_sum = _fwd_block(
                acc,
                row_max,
                row_sum,
                q,
                k_base,
                v_base,
                stride_ks,
                stride_vs,
                offs_m,
                row_doc_start,
                start_n,
                seq_len,
                qk_scale_log2,
                CAUSAL,
                HAS_DOCS,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                PRECISION,
            )
        return acc, row_max, row_sum

    @triton.jit
    def _attention_fwd_kernel(
        Q,
        K,
        V,
        OUT,
        LSE,
        DOC_START,
        stride_qb,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_ob,
        stride_os,
        stride_oh,
        seq_len,
        n_q_heads,
        qk_scale_log2,
        GROUP: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (query block, batch x query head); writes O and the base-2 logsumexp."""
        start_m = tl.program_id(0) * BLOCK_M
        batch = tl.program_id(1) // n_q_heads
        head = tl.program_id(1) % n_q_heads
        kv_head = head // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_valid = offs_m < seq_len
        q_mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_base = Q + batch.to(tl.int64) * stride_qb + head * stride_qh
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)

        if HAS_DOCS:
            doc_start_row = DOC_START + batch.to(tl.int64) * seq_len
            row_doc_start = tl.load(doc_start_row + offs_m, mask=m_valid, other=0)
            # Documents are contiguous, so the block's first query has the earliest document start.
            key_lo = (tl.load(doc_start_row + start_m) // BLOCK_N) * BLOCK_N
        else:
            row_doc_start = offs_m
            key_lo = 0

        # A finite start keeps exp2(row_max - new_max) defined while a row has seen only masked keys.
        row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        acc, row_max, row_sum = _fwd_block_loop(
            acc,
            row_max,
            row_sum,
            q,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            offs_m,
            row_doc_start,
            key_lo,
            start_m,
            seq_len,
            qk_scale_log2,
            False,
            HAS_DOCS,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            PRECISION,
        )
        acc, row_max, row_sum = _fwd_block_loop(
            acc,
            row_max,
            row_sum,
            q,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            offs_m,
            row_doc_start,
            tl.maximum(key_lo, start_m),
            tl.minimum(start_m + BLOCK_M, seq_len),
            seq_len,
            qk_scale_log2,
            True,
            HAS_DOCS,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            PRECISION,
        )

        out = acc / row_sum[:, None]
        out_base = OUT + batch.to(tl.int64) * stride_ob + head * stride_oh
        tl.store(
            out_base + offs_m[:, None] * stride_os + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=q_mask,
        )
        lse_base = LSE + (batch.to(tl.int64) * n_q_heads + head) * seq_len
        tl.store(lse_base + offs_m, row_max + tl.math.log2(row_sum), mask=m_valid)

    @triton.jit
    def _attention_bwd_delta_kernel(
        OUT,
        D_OUT,
        DELTA,
        stride_ob,
        stride_os,
        stride_oh,
        stride_dob,
        stride_dos,
        stride_doh,
        seq_len,
        n_q_heads,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """delta = rowsum(dO * O), the softmax-backward term shared by every key of a row."""
        start_m = tl.program_id(0) * BLOCK_M
        batch = tl.program_id(1) // n_q_heads
        head = tl.program_id(1) % n_q_heads
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_valid = offs_m < seq_len
        mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        out_base = OUT + batch.to(tl.int64) * stride_ob + head * stride_oh
        dout_base = D_OUT + batch.to(tl.int64) * stride_dob + head * stride_doh
        out = tl.load(out_base + offs_m[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)
        dout = tl.load(dout_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0)
        delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), axis=1)
        tl.store(DELTA + (batch.to(tl.int64) * n_q_heads + head) * seq_len + offs_m, delta, mask=m_valid)

    @triton.jit
    def _dkdv_block(
        dk,
        dv,
        k,
        v,
        q_base,
        dout_base,
        lse_base,
        delta_base,
        doc_start_base,
        stride_qs,
        stride_dos,
        offs_n,
        start_m,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One query block's contribution to dK and dV."""
        offs_d = tl.arange(0, D_PAD)
        d_valid = offs_d < HEAD_DIM
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_valid = offs_m < seq_len
        qt = tl.load(
            q_base + offs_m[None, :] * stride_qs + offs_d[:, None],
            mask=m_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        dout = tl.load(
            dout_base + offs_m[:, None] * stride_dos + offs_d[None, :],
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        lse = tl.load(lse_base + offs_m, mask=m_valid, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=m_valid, other=0.0)
        probs_t = tl.math.exp2(tl.dot(k, qt, input_precision=PRECISION) * qk_scale_log2 - lse[None, :])
        # Rows past the sequence end add nothing even unmasked: their dO and delta load as zero.
        if CAUSAL or HAS_DOCS:
            allowed = m_valid[None, :]
            if CAUSAL:
                allowed = allowed & (offs_m[None, :] >= offs_n[:, None])
            if HAS_DOCS:
                row_doc_start = tl.load(doc_start_base + offs_m, mask=m_valid, other=0)
                allowed = allowed & (offs_n[:, None] >= row_doc_start[None, :])
            probs_t = tl.where(allowed, probs_t, 0.0)
        dv += tl.dot(probs_t.to(dout.dtype), dout, input_precision=PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])
        dk += tl.dot(dscores_t.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
        return dk, dv

    @triton.jit
    def _dkdv_block_loop(
        dk,
        dv,
        k,
        v,
        q_base,
        dout_base,
        lse_base,
        delta_base,
        doc_start_base,
        stride_qs,
        stride_dos,
        offs_n,
        query_lo,
        query_hi,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Accumulate one query head's dK, dV contribution over query blocks [query_lo, query_hi).

        Works on transposed tiles (keys x queries) so both products contract without extra transposes.
        """
        for start_m in range(query_lo, query_hi, BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                q_base,
                dout_base,
                lse_base,
                delta_base,
                doc_start_base,
                stride_qs,
                stride_dos,
                offs_n,
                start_m,
                seq_len,
                qk_scale_log2,
                CAUSAL,
                HAS_DOCS,
                HEAD_DIM,
                D_PAD,
                BLOCK_M,
                PRECISION,
            )
        return dk, dv

    @triton.jit
    def _attention_bwd_dkdv_kernel(
        Q,
        K,
        V,
        D_OUT,
        LSE,
        DELTA,
        DOC_START,
        DOC_END,
        DK,
        DV,
        stride_qb,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_dob,
        stride_dos,
        stride_doh,
        stride_dkb,
        stride_dks,
        stride_dkh,
        stride_dvb,
        stride_dvs,
        stride_dvh,
        seq_len,
        n_q_heads,
        scale,
        qk_scale_log2,
        GROUP: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (key block, batch x kv head); loops over the group's query heads, so no atomics."""
        start_n = tl.program_id(0) * BLOCK_N
        n_kv_heads = n_q_heads // GROUP
        batch = tl.program_id(1) // n_kv_heads
        kv_head = tl.program_id(1) % n_kv_heads
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        kv_mask = (offs_n[:, None] < seq_len) & (offs_d[None, :] < HEAD_DIM)
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)

        doc_start_base = DOC_START + batch.to(tl.int64) * seq_len
        diag_lo = (start_n // BLOCK_M) * BLOCK_M
        diag_hi = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, seq_len)
        if HAS_DOCS:
            # The block's last key ends the latest document, so no later query can see the block.
            last_key = tl.minimum(start_n + BLOCK_N, seq_len) - 1
            query_hi = tl.load(DOC_END + batch.to(tl.int64) * seq_len + last_key)
        else:
            query_hi = seq_len
        diag_hi = tl.minimum(diag_hi, query_hi)

        dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        for group_index in range(GROUP):
            head = kv_head * GROUP + group_index
            q_base = Q + batch.to(tl.int64) * stride_qb + head * stride_qh
            dout_base = D_OUT + batch.to(tl.int64) * stride_dob + head * stride_doh
            lse_base = LSE + (batch.to(tl.int64) * n_q_heads + head) * seq_len
            delta_base = DELTA + (batch.to(tl.int64) * n_q_heads + head) * seq_len
            dk, dv = _dkdv_block_loop(
                dk,
                dv,
                k,
                v,
                q_base,
                dout_base,
                lse_base,
                delta_base,
                doc_start_base,
                stride_qs,
                stride_dos,
                offs_n,
                diag_lo,
                diag_hi,
                seq_len,
                qk_scale_log2,
                True,
                HAS_DOCS,
                HEAD_DIM,
                D_PAD,
                BLOCK_M,
                PRECISION,
            )
            dk, dv = _dkdv_block_loop(
                dk,
                dv,
                k,
                v,
                q_base,
                dout_base,
                lse_base,
                delta_base,
                doc_start_base,
                stride_qs,
                stride_dos,
                offs_n,
                diag_hi,
                query_hi,
                seq_len,
                qk_scale_log2,
                False,
                HAS_DOCS,
                HEAD_DIM,
                D_PAD,
                BLOCK_M,
                PRECISION,
            )

        dk_base = DK + batch.to(tl.int64) * stride_dkb + kv_head * stride_dkh
        dv_base = DV + batch.to(tl.int64) * stride_dvb + kv_head * stride_dvh
        tl.store(
            dk_base + offs_n[:, None] * stride_dks + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=kv_mask,
        )
        tl.store(
            dv_base + offs_n[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask
        )

    @triton.jit
    def _dq_block(
        dq,
        q,
        dout,
        lse,
        delta,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        offs_m,
        row_doc_start,
        start_n,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One key block's contribution to dQ."""
        offs_d = tl.arange(0, D_PAD)
        d_valid = offs_d < HEAD_DIM
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < seq_len
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        probs = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2 - lse[:, None])
        if CAUSAL:
            allowed = (offs_n[None, :] <= offs_m[:, None]) & n_valid[None, :]
            if HAS_DOCS:
                allowed = allowed & (offs_n[None, :] >= row_doc_start[:, None])
            probs = tl.where(allowed, probs, 0.0)
        elif HAS_DOCS:
            probs = tl.where(offs_n[None, :] >= row_doc_start[:, None], probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        return dq

    @triton.jit
    def _dq_block_loop(
        dq,
        q,
        dout,
        lse,
        delta,
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        offs_m,
        row_doc_start,
        key_lo,
        key_hi,
        seq_len,
        qk_scale_log2,
        CAUSAL: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Accumulate dQ of one query block over key blocks [key_lo, key_hi)."""
        for start_n in range(key_lo, key_hi, BLOCK_N):
            dq = _dq_block(
                dq,
                q,
                dout,
                lse,
                delta,
                k_base,
                v_base,
                stride_ks,
                stride_vs,
                offs_m,
                row_doc_start,
                start_n,
                seq_len,
                qk_scale_log2,
                CAUSAL,
                HAS_DOCS,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                PRECISION,
            )
        return dq

    @triton.jit
    def _attention_bwd_dq_kernel(
        Q,
        K,
        V,
        D_OUT,
        LSE,
        DELTA,
        DOC_START,
        DQ,
        stride_qb,
        stride_qs,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_dob,
        stride_dos,
        stride_doh,
        stride_dqb,
        stride_dqs,
        stride_dqh,
        seq_len,
        n_q_heads,
        scale,
        qk_scale_log2,
        GROUP: tl.constexpr,
        HAS_DOCS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (query block, batch x query head), walking the same key range as the forward."""
        start_m = tl.program_id(0) * BLOCK_M
        batch = tl.program_id(1) // n_q_heads
        head = tl.program_id(1) % n_q_heads
        kv_head = head // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_valid = offs_m < seq_len
        q_mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        q_base = Q + batch.to(tl.int64) * stride_qb + head * stride_qh
        dout_base = D_OUT + batch.to(tl.int64) * stride_dob + head * stride_doh
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
        dout = tl.load(dout_base + offs_m[:, None] * stride_dos + offs_d[None, :], mask=q_mask, other=0.0)
        row_offset = (batch.to(tl.int64) * n_q_heads + head) * seq_len
        lse = tl.load(LSE + row_offset + offs_m, mask=m_valid, other=0.0)
        delta = tl.load(DELTA + row_offset + offs_m, mask=m_valid, other=0.0)

        if HAS_DOCS:
            doc_start_row = DOC_START + batch.to(tl.int64) * seq_len
            row_doc_start = tl.load(doc_start_row + offs_m, mask=m_valid, other=0)
            key_lo = (tl.load(doc_start_row + start_m) // BLOCK_N) * BLOCK_N
        else:
            row_doc_start = offs_m
            key_lo = 0

        dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        dq = _dq_block_loop(
            dq,
            q,
            dout,
            lse,
            delta,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            offs_m,
            row_doc_start,
            key_lo,
            start_m,
            seq_len,
            qk_scale_log2,
            False,
            HAS_DOCS,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            PRECISION,
        )
        dq = _dq_block_loop(
            dq,
            q,
            dout,
            lse,
            delta,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            offs_m,
            row_doc_start,
            tl.maximum(key_lo, start_m),
            tl.minimum(start_m + BLOCK_M, seq_len),
            seq_len,
            qk_scale_log2,
            True,
            HAS_DOCS,
            HEAD_DIM,
            D_PAD,
            BLOCK_N,
            PRECISION,
        )
        dq_base = DQ + batch.to(tl.int64) * stride_dqb + head * stride_dqh
        tl.store(
            dq_base + offs_m[:, None] * stride_dqs + offs_d[None, :],
            (dq * scale).to(DQ.dtype.element_ty),
            mask=q_mask,
        )


_LOG2_E = 1.4426950408889634
# Qwen3.5's attention layers have head_dim 256, the largest of the families trained here.
MAX_HEAD_DIM = 256


def _document_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the first position of its document and one past its last (int32, [B, S]).

    Computed with scans, so no host sync; assumes each document's tokens are contiguous in the row.
    """
    seq_len = doc_ids.shape[1]
    positions = torch.arange(seq_len, device=doc_ids.device, dtype=torch.int32).expand(doc_ids.shape)
    starts_doc = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    doc_start = torch.where(starts_doc, positions, 0).cummax(dim=1).values
    ends_doc = torch.ones_like(starts_doc)
    ends_doc[:, :-1] = starts_doc[:, 1:]
    doc_end = torch.where(ends_doc, positions + 1, seq_len).flip(1).cummin(dim=1).values.flip(1)
    return doc_start.to(torch.int32).contiguous(), doc_end.to(torch.int32).contiguous()


def _block_config(head_dim_pad: int, dtype: torch.dtype, is_cuda: bool) -> dict:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: 16-wide tiles in the interpreter.

    The GPU values won sweeps on an H200 (benchmarks.packed_attention --sweep, benchmarks/RESULTS.md):
    D 64 and 128 at Qwen2.5 7B and 0.5B shapes, D 256 at Qwen3.5's, bf16 on packed rows.
    """
    if not is_cuda:
        return {"fwd": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}
    if dtype == torch.float32 and head_dim_pad > 64:
        # NOTE: fp32 dots run "ieee", as FMA loops on tiles held in registers. With the bf16 tiles, D 128
        # spilled 60-68 KB a thread on sm_90 and each kernel took 70-140 s to compile (the GPU tests'
        # largest cost); these spill at most 0.4 KB and compile in under 12 s (benchmarks.kernel_resources).
        tile = (32, 32, 8, 1) if head_dim_pad <= 128 else (16, 16, 8, 1)
        return {"fwd": tile, "dkdv": tile, "dq": tile}
    if head_dim_pad > 128:
        # Twice a 128-wide head's accumulators: 8 warps; on packed 4 x 2048 rows these took 0.32 ms
        # forward against 0.64 for (64, 32, 8, 3), and 1.09 / 1.15 ms in the backward against 1.32 / 1.31.
        config = {"fwd": (128, 32, 8, 2), "dkdv": (32, 64, 8, 2), "dq": (128, 32, 8, 2)}
    else:
        config = {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 64, 4, 2)}
    if dtype == torch.float32:
        # fp32 tiles are twice as large: one pipeline stage less keeps them in shared memory.
        config = {kind: (m, n, warps, max(1, stages - 1)) for kind, (m, n, warps, stages) in config.items()}
    return config


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full precision (tf32 would cost about three digits); 16-bit ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_forward(q, k, v, doc_start, scale):
    """Returns the output [B, S, Hq, D] and the base-2 logsumexp [B, Hq, S] in fp32."""
    batch, seq_len, n_q_heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is above the supported {MAX_HEAD_DIM}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    group = n_q_heads // k.shape[2]
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _block_config(d_pad, q.dtype, q.is_cuda)["fwd"]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_q_heads, seq_len), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seq_len, block_m), batch * n_q_heads)
    _attention_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        doc_start if doc_start is not None else lse,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        seq_len,
        n_q_heads,
        scale * _LOG2_E,
        GROUP=group,
        HAS_DOCS=doc_start is not None,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse


def _launch_backward(dout, q, k, v, out, lse, doc_start, doc_end, scale):
    """Returns dq, dk, dv shaped and typed like q, k, v."""
    batch, seq_len, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    group = n_q_heads // n_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    config = _block_config(d_pad, q.dtype, q.is_cuda)
    dout = unit_last_stride(dout)
    has_docs = doc_start is not None
    doc_start_arg = doc_start if has_docs else lse
    doc_end_arg = doc_end if has_docs else lse
    precision = _dot_precision(q.dtype)

    delta = torch.empty_like(lse)
    delta_block = 16 if not q.is_cuda else 128
    _attention_bwd_delta_kernel[(triton.cdiv(seq_len, delta_block), batch * n_q_heads)](
        out,
        dout,
        delta,
        *out.stride()[:3],
        *dout.stride()[:3],
        seq_len,
        n_q_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_M=delta_block,
    )

    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_m, block_n, num_warps, num_stages = config["dkdv"]
    _attention_bwd_dkdv_kernel[(triton.cdiv(seq_len, block_n), batch * n_kv_heads)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        doc_start_arg,
        doc_end_arg,
        dk,
        dv,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *dout.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        seq_len,
        n_q_heads,
        scale,
        scale * _LOG2_E,
        GROUP=group,
        HAS_DOCS=has_docs,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, block_n, num_warps, num_stages = config["dq"]
    _attention_bwd_dq_kernel[(triton.cdiv(seq_len, block_m), batch * n_q_heads)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        doc_start_arg,
        dq,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *dout.stride()[:3],
        *dq.stride()[:3],
        seq_len,
        n_q_heads,
        scale,
        scale * _LOG2_E,
        GROUP=group,
        HAS_DOCS=has_docs,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return dq, dk, dv


class TritonAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the logsumexp; the backward recomputes scores blockwise."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, scale):
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        doc_start, doc_end = _document_bounds(doc_ids) if doc_ids is not None else (None, None)
        out, lse = _launch_forward(q, k, v, doc_start, scale)
        ctx.save_for_backward(q, k, v, out, lse, doc_start, doc_end)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_start, doc_end = ctx.saved_tensors
        dq, dk, dv = _launch_backward(dout, q, k, v, out, lse, doc_start, doc_end, ctx.scale)
        return dq, dk, dv, None, None


def attention(q, k, v, doc_ids=None, *, scale=None, backend="triton", window=None):
    """Causal GQA attention; q [B, S, Hq, D], k and v [B, S, Hk, D], doc_ids [B, S] or None.

    Query head h reads kv head h // (Hq // Hk). With doc_ids, a token sees only earlier tokens of
    its own document; the Triton path expects each document's tokens to be contiguous in the row,
    as packing lays them out. With a sliding `window`, only the `window` latest of them, itself
    included. Returns [B, S, Hq, D] contiguous in q's dtype. backend "triton" is our
    kernel (the torch reference on CPU outside the interpreter); "sdpa" is torch's fused attention;
    "flex" is torch's FlexAttention on CUDA (the reference on the CPU, where flex has no backward).
    A window shorter than the row takes attention_windowed whatever the backend; one as long cuts
    nothing.
    """
    _check_inputs(q, k, v, doc_ids)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one key, got {window}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    if window is not None and window < q.shape[1]:
        return attention_windowed(q, k, v, doc_ids, window, scale)
    if backend == "sdpa":
        return attention_sdpa(q, k, v, doc_ids, scale)
    if backend == "flex":
        return (
            attention_flex(q, k, v, doc_ids, scale)
            if q.is_cuda
            else attention_reference(q, k, v, doc_ids, scale)
        )
    if backend != "triton":
        raise ValueError(f"unknown attention backend {backend!r}; expected 'triton', 'sdpa' or 'flex'")
    if not use_triton(q):
        return attention_reference(q, k, v, doc_ids, scale)
    return TritonAttention.apply(q, k, v, doc_ids, scale)
