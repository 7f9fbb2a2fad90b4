"""Qwen3.5's Gated DeltaNet recurrence (the gated delta rule), chunked in Triton.

Per value head the state S [Dk, Dv] evolves token by token as in transformers'
torch_recurrent_gated_delta_rule: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q).
The Triton path splits the row into chunks of 64 tokens: inside a chunk the updates are solved at
once as a unit lower-triangular system (the UT/WY form), and only the state crosses chunks, in fp32.
Packed documents (doc_ids) reset the state exactly: every within-chunk quantity is masked to pairs
of tokens of one document and the log-decay is summed per document, never offset by a huge number.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import documents_per_token, unit_last_stride

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

L2NORM_EPS = 1e-6

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3.5 l2norm (the FLA convention), eps inside the square root."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool, True where a new document begins after the first (where doc_ids changes)."""
    starts = torch.zeros(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float, normalize_qk: bool):
    q, k = q.float(), k.float()
    if normalize_qk:
        q, k = l2norm_reference(q), l2norm_reference(k)
    return q * scale, k


def _recurrent_step(state, q, k, v, g, beta):
    """One token for every (batch, v-head): state [B, Hv, Dk, Dv]; q, k [B, Hv, Dk]; v [B, Hv, Dv]."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(-2)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token in fp32, the state zeroed at every document start: the numerical truth."""
    batch, seq, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    q, k = _prepare_qk(q, k, k_dim**-0.5 if scale is None else scale, normalize_qk)
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    values, g, beta = v.float(), g.float(), beta.float()
    if initial_state is None:
        state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()
    starts = None if doc_ids is None else document_starts(doc_ids)
    outputs = []
    for t in range(seq):
        if starts is not None:
            state = torch.where(starts[:, t, None, None, None], 0.0, state)
        state, out = _recurrent_step(state, q[:, t], k[:, t], values[:, t], g[:, t], beta[:, t])
        outputs.append(out)
    o = torch.stack(outputs, dim=1).to(v.dtype)
    return o, state if output_final_state else None


def gated_delta_rule_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
) -> torch.Tensor:
    """One decode token: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; state updated in place."""
    group = v.shape[1] // k.shape[1]
    q, k = _prepare_qk(q, k, k.shape[-1] ** -0.5 if scale is None else scale, normalize_qk)
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    new_state, out = _recurrent_step(state.float(), q, k, v.float(), g.float(), beta.float())
    state.copy_(new_state)
    return out.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

# 64 tokens per chunk: the scan over chunks is T/64 steps long and its products have inner
# dimension 64 (full tensor-core tiles), while the per-chunk T x T-shaped work stays 64 x 64. The
# triangular solve works in four 16-token blocks, the smallest tile tl.dot takes.
CHUNK = 64

# NOTE (tensor cores): for bf16 or fp16 inputs (TENSOR_CORE_DTYPES) the normalised q and k and the
# chunk tables T, W, Aqk, delta and d delta are stored in the inputs' dtype, and every product of the tables and of the
# scans (K K^T, Q K^T, T (beta V), T (beta K), W S, Q S, Aqk delta, K^T delta and their backward
# forms) takes its operands in that dtype with fp32 accumulation (_mma): 8-16x the fp32 FMA rate on
# Hopper. Each operand rounding is relative 2^-9 (bf16) and the state itself stays fp32 across
# chunks, so the error does not compound beyond the recurrence's own contraction (the derivation is
# at BF16_TOL in tests/test_delta_rule.py). fla's kernels make the same choice. Kept in fp32
# (input_precision="ieee"): the triangular solve's inverse and merges, where (I + A)^-1 may amplify
# an operand error by its condition number; the cumulative log-decay (exp(b_i - b_j) needs b to
# fp32); and everything for fp32 inputs, so the interpreter tests compare the algorithm exactly.
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)

# NOTE (Hopper miscompile): no tl.dot here takes tl.trans of a tile computed by another tl.dot.
# Triton 3.4 to 3.7.0 on sm_90 lowers that transposed accumulator layout to wrong values
# (flash-linear-attention issue 640: tl.dot(tl.trans(b_ds.to(bf16)), b_q) corrupted dk and dg in
# its chunk_bwd_dqkwg). A transposed product is computed from loaded tiles instead
# (dk = (dS delta^T)^T is stored transposed; dqk^T and dA^T are recomputed from loaded tiles).

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _l2norm_fwd_kernel(
        x_ptr,
        y_ptr,
        x_stride_b,
        x_stride_t,
        x_stride_h,
        seq,
        n_heads,
        n_rows,
        dim,
        scale,
        NORMALIZE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """(token, head) rows to scale * x / ||x|| (computed in fp32, stored in the tables' dtype),
        the form every later kernel reads."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < n_rows)[:, None] & (dims < dim)
        token, head = rows // n_heads, rows % n_heads
        x_rows = (token // seq) * x_stride_b + (token % seq) * x_stride_t + head * x_stride_h
        x = tl.load(x_ptr + x_rows[:, None] + dims, mask=mask, other=0.0).to(tl.float32)
        if NORMALIZE:
            x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
        tl.store(y_ptr + rows[:, None] * dim + dims, (x * scale).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _l2norm_bwd_kernel(
        x_ptr,
        dy_ptr,
        dx_ptr,
        x_stride_b,
        x_stride_t,
        x_stride_h,
        seq,
        n_heads,
        n_rows,
        dim,
        scale,
        NORMALIZE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """d(x r) = r (dy - y (y . dy)) with r = (sum x^2 + eps)^-1/2 and y = x r, recomputed from x."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < n_rows)[:, None] & (dims < dim)
        offsets = rows[:, None] * dim + dims
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0) * scale
        if NORMALIZE:
            token, head = rows // n_heads, rows % n_heads
            x_rows = (token // seq) * x_stride_b + (token % seq) * x_stride_t + head * x_stride_h
            x = tl.load(x_ptr + x_rows[:, None] + dims, mask=mask, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
            y = x * r
            dy = r * (dy - y * tl.sum(y * dy, axis=1)[:, None])
        tl.store(dx_ptr + offsets, dy.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _chunk_cumsum_kernel(
        x_ptr,
        docs_ptr,
        out_ptr,
        seq,
        n_heads,
        x_stride_b,
        x_stride_t,
        x_stride_h,
        docs_stride_b,
        docs_stride_t,
        REVERSE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """Per head, the sum of x over the tokens of the same chunk and document up to each token
        (REVERSE: from it on), as a product with a 0/1 matrix. Only differences within a document
        and sums in the document the state enters with are ever read, so restarting at a document
        start only keeps |b| small (and exp(b_i - b_j) precise); no large offset ever cancels."""
        batch = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        heads = tl.arange(0, BLOCK_H)
        valid = rows < seq
        doc = tl.load(docs_ptr + batch * docs_stride_b + rows * docs_stride_t, mask=valid, other=-1)
        mask = valid[:, None] & (heads < n_heads)[None, :]
        x_ptrs = x_ptr + batch * x_stride_b + rows[:, None] * x_stride_t + heads[None, :] * x_stride_h
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        order = rows[:, None] <= rows[None, :] if REVERSE else rows[:, None] >= rows[None, :]
        same = (doc[:, None] == doc[None, :]) & order
        out = tl.dot(same.to(tl.float32), x, input_precision="ieee")
        tl.store(out_ptr + (batch * seq + rows[:, None]) * n_heads + heads[None, :], out, mask=mask)

    @triton.jit
    def _block_rows(
        k_ptr,
        beta_ptr,
        b_ptr,
        docs_ptr,
        rows,
        seq,
        k_dim,
        k_stride_t,
        beta_stride_t,
        b_stride_t,
        docs_stride_t,
        BLOCK_K: tl.constexpr,
        DOT: tl.constexpr,
    ):
        valid = rows < seq
        dims = tl.arange(0, BLOCK_K)
        k = tl.load(
            k_ptr + rows[:, None] * k_stride_t + dims[None, :],
            mask=valid[:, None] & (dims < k_dim)[None, :],
            other=0.0,
        ).to(DOT)
        beta = tl.load(beta_ptr + rows * beta_stride_t, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * b_stride_t, mask=valid, other=0.0)
        doc = tl.load(docs_ptr + rows * docs_stride_t, mask=valid, other=-1)
        return k, beta, b, doc

    @triton.jit
    def _mma(a, b, dtype: tl.constexpr):
        """a @ b with operands in dtype (a chunk table's: see TENSOR_CORE_DTYPES), accumulated in fp32."""
        return tl.dot(a.to(dtype), b.to(dtype), input_precision="ieee")

    @triton.jit
    def _block_a(k_i, beta_i, b_i, doc_i, rows_i, k_j, b_j, doc_j, rows_j, dtype: tl.constexpr):
        """A[i, j] = beta_i (k_i . k_j) exp(b_i - b_j) for the earlier tokens j of i's document."""
        mask = (doc_i[:, None] == doc_j[None, :]) & (rows_i[:, None] > rows_j[None, :])
        decay = tl.exp(tl.where(mask, b_i[:, None] - b_j[None, :], 0.0))
        return tl.where(mask, _mma(k_i, tl.trans(k_j), dtype) * decay * beta_i[:, None], 0.0)

    @triton.jit
    def _unit_lower_inverse(a):
        """(I + a)^-1 for a strictly lower 16 x 16 tile: x <- I - a x, fifteen times. Row i is final
        once the rows above it are (a^16 = 0), with forward substitution's arithmetic, so no power
        of a (whose entries can grow like binomials) is ever formed."""
        eye = (tl.arange(0, 16)[:, None] == tl.arange(0, 16)[None, :]).to(tl.float32)
        x = eye
        for _ in range(15):
            x = eye - tl.dot(a, x, input_precision="ieee")
        return x

    @triton.jit
    def _store_block(t_ptr, rows, col, tile, seq, row_stride):
        cols = col + tl.arange(0, 16)
        tl.store(
            t_ptr + rows[:, None] * row_stride + cols[None, :],
            tile.to(t_ptr.dtype.element_ty),
            mask=(rows < seq)[:, None],
        )

    @triton.jit
    def _chunk_solve_kernel(
        k_ptr,
        beta_ptr,
        b_ptr,
        docs_ptr,
        t_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        beta_stride_b,
        beta_stride_t,
        beta_stride_h,
        docs_stride_b,
        docs_stride_t,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """T = (I + A)^-1 for one chunk and v-head, A strictly lower (see _block_a), by 16-token blocks:
        invert the diagonal blocks, then T_ij = -T_ii sum_{j <= m < i} A_im T_mj. Stored [token, 64]."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        k_stride_t = k_heads * k_dim
        k_ptr += batch * seq * k_stride_t + (head // GROUP) * k_dim
        beta_ptr += batch * beta_stride_b + head * beta_stride_h
        b_ptr += batch * seq * v_heads + head
        docs_ptr += batch * docs_stride_b
        t_ptr += (batch * seq * v_heads + head) * CHUNK
        dot = t_ptr.dtype.element_ty
        r0 = tl.program_id(0) * CHUNK + tl.arange(0, 16)
        r1 = r0 + 16
        r2 = r0 + 32
        r3 = r0 + 48
        k0, be0, b0, d0 = _block_rows(
            k_ptr,
            beta_ptr,
            b_ptr,
            docs_ptr,
            r0,
            seq,
            k_dim,
            k_stride_t,
            beta_stride_t,
            v_heads,
            docs_stride_t,
            BLOCK_K,
            dot,
        )
        k1, be1, b1, d1 = _block_rows(
            k_ptr,
            beta_ptr,
            b_ptr,
            docs_ptr,
            r1,
            seq,
            k_dim,
            k_stride_t,
            beta_stride_t,
            v_heads,
            docs_stride_t,
            BLOCK_K,
            dot,
        )
        k2, be2, b2, d2 = _block_rows(
            k_ptr,
            beta_ptr,
            b_ptr,
            docs_ptr,
            r2,
            seq,
            k_dim,
            k_stride_t,
            beta_stride_t,
            v_heads,
            docs_stride_t,
            BLOCK_K,
            dot,
        )
        k3, be3, b3, d3 = _block_rows(
            k_ptr,
            beta_ptr,
            b_ptr,
            docs_ptr,
            r3,
            seq,
            k_dim,
            k_stride_t,
            beta_stride_t,
            v_heads,
            docs_stride_t,
            BLOCK_K,
            dot,
        )
        # Every A block before any inverse, so the key tiles are dead during the solve.
        a00 = _block_a(k0, be0, b0, d0, r0, k0, b0, d0, r0, dot)
        a11 = _block_a(k1, be1, b1, d1, r1, k1, b1, d1, r1, dot)
        a22 = _block_a(k2, be2, b2, d2, r2, k2, b2, d2, r2, dot)
        a33 = _block_a(k3, be3, b3, d3, r3, k3, b3, d3, r3, dot)
        a10 = _block_a(k1, be1, b1, d1, r1, k0, b0, d0, r0, dot)
        a20 = _block_a(k2, be2, b2, d2, r2, k0, b0, d0, r0, dot)
        a21 = _block_a(k2, be2, b2, d2, r2, k1, b1, d1, r1, dot)
        a30 = _block_a(k3, be3, b3, d3, r3, k0, b0, d0, r0, dot)
        a31 = _block_a(k3, be3, b3, d3, r3, k1, b1, d1, r1, dot)
        a32 = _block_a(k3, be3, b3, d3, r3, k2, b2, d2, r2, dot)
        t00 = _unit_lower_inverse(a00)
        t11 = _unit_lower_inverse(a11)
        t22 = _unit_lower_inverse(a22)
        t33 = _unit_lower_inverse(a33)
        t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
        t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
        t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
        t20 = -tl.dot(
            t22,
            tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
            input_precision="ieee",
        )
        t31 = -tl.dot(
            t33,
            tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
            input_precision="ieee",
        )
        t30 = -tl.dot(
            t33,
            tl.dot(a30, t00, input_precision="ieee")
            + tl.dot(a31, t10, input_precision="ieee")
            + tl.dot(a32, t20, input_precision="ieee"),
            input_precision="ieee",
        )
        row_stride = v_heads * CHUNK
        _store_block(t_ptr, r0, 0, t00, seq, row_stride)
        _store_block(t_ptr, r1, 0, t10, seq, row_stride)
        _store_block(t_ptr, r1, 16, t11, seq, row_stride)
        _store_block(t_ptr, r2, 0, t20, seq, row_stride)
        _store_block(t_ptr, r2, 16, t21, seq, row_stride)
        _store_block(t_ptr, r2, 32, t22, seq, row_stride)
        _store_block(t_ptr, r3, 0, t30, seq, row_stride)
        _store_block(t_ptr, r3, 16, t31, seq, row_stride)
        _store_block(t_ptr, r3, 32, t32, seq, row_stride)
        _store_block(t_ptr, r3, 48, t33, seq, row_stride)

    @triton.jit
    def _chunk_docs(docs_ptr, rows, start, seq, docs_stride_t, CHUNK: tl.constexpr):
        """Each token's document (-1 past the end); whether it continues the document of the state
        entering the chunk (the first document of the row for chunk 0, which initial_state belongs
        to); whether it is in the chunk's last document; the last token; whether that one continues."""
        doc = tl.load(docs_ptr + rows * docs_stride_t, mask=rows < seq, other=-1)
        doc_before = tl.load(docs_ptr + tl.maximum(start - 1, 0) * docs_stride_t)
        last = tl.minimum(start + CHUNK, seq) - 1
        doc_last = tl.load(docs_ptr + last * docs_stride_t)
        return doc, doc == doc_before, doc == doc_last, last, doc_last == doc_before

    @triton.jit
    def _chunk_wu_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        beta_ptr,
        b_ptr,
        docs_ptr,
        t_ptr,
        w_ptr,
        u_ptr,
        aqk_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        v_stride_b,
        v_stride_t,
        v_stride_h,
        beta_stride_b,
        beta_stride_t,
        beta_stride_h,
        docs_stride_b,
        docs_stride_t,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Per chunk and v-head, everything that does not depend on the state entering the chunk:
        U = T diag(beta) V and W = T diag(beta exp(b) carry) K (the state-free and state-read parts of
        the corrections delta = U - W S), and the masked, decayed Q K^T of the output."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        start = tl.program_id(0) * CHUNK
        local = tl.arange(0, CHUNK)
        rows = start + local
        valid = rows < seq
        dims = tl.arange(0, BLOCK_K)
        v_cols = tl.arange(0, BLOCK_V)
        k_mask = valid[:, None] & (dims < k_dim)[None, :]
        v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
        qk_offsets = (
            (batch * seq + rows[:, None]) * (k_heads * k_dim) + (head // GROUP) * k_dim + dims[None, :]
        )
        token_head = (batch * seq + rows) * v_heads + head
        doc, carry, _, _, _ = _chunk_docs(
            docs_ptr + batch * docs_stride_b, rows, start, seq, docs_stride_t, CHUNK
        )
        beta = tl.load(
            beta_ptr + batch * beta_stride_b + rows * beta_stride_t + head * beta_stride_h,
            mask=valid,
            other=0.0,
        ).to(tl.float32)
        b = tl.load(b_ptr + token_head, mask=valid, other=0.0)
        dot = t_ptr.dtype.element_ty
        t = tl.load(
            t_ptr + token_head[:, None] * CHUNK + local[None, :],
            mask=valid[:, None] & (local[None, :] <= local[:, None]),
            other=0.0,
        )
        v = tl.load(
            v_ptr + batch * v_stride_b + rows[:, None] * v_stride_t + head * v_stride_h + v_cols[None, :],
            mask=v_mask,
            other=0.0,
        ).to(tl.float32)
        tl.store(
            u_ptr + token_head[:, None] * v_dim + v_cols[None, :],
            _mma(t, v * beta[:, None], dot),
            mask=v_mask,
        )
        k = tl.load(k_ptr + qk_offsets, mask=k_mask, other=0.0)
        k_scale = beta * tl.where(carry, tl.exp(b), 0.0)
        tl.store(
            w_ptr + token_head[:, None] * k_dim + dims[None, :],
            _mma(t, k * k_scale[:, None], dot).to(dot),
            mask=k_mask,
        )
        q = tl.load(q_ptr + qk_offsets, mask=k_mask, other=0.0)
        same = (doc[:, None] == doc[None, :]) & (local[:, None] >= local[None, :])
        decay = tl.exp(tl.where(same, b[:, None] - b[None, :], 0.0))
        aqk = tl.where(same, _mma(q, tl.trans(k), dot) * decay, 0.0)
        tl.store(aqk_ptr + token_head[:, None] * CHUNK + local[None, :], aqk.to(dot), mask=valid[:, None])

    @triton.jit
    def _chunk_scan_fwd_kernel(
        q_ptr,
        k_ptr,
        w_ptr,
        u_ptr,
        aqk_ptr,
        b_ptr,
        docs_ptr,
        h0_ptr,
        o_ptr,
        delta_ptr,
        h_ptr,
        ht_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs_stride_b,
        docs_stride_t,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        HAS_INITIAL: tl.constexpr,
        STORE_FINAL: tl.constexpr,
        STORE_STATES: tl.constexpr,
        STORE_OUTPUT: tl.constexpr,
    ):
        """One (Dv block, batch, v-head) walks the chunks in order, its state slice [Dk, BLOCK_V]
        in fp32 registers (the delta rule is separable over v's columns):
        delta = U - W S;  o = (carry exp(b) Q) S + Aqk delta;
        S <- [last doc carries] exp(b_last) S + (K [last doc] exp(b_last - b))^T delta.
        Backward's rerun stores the entering states (in the tables' dtype: backward only multiplies
        them) and the corrections, and skips o, which it does not read."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        dims = tl.arange(0, BLOCK_K)
        v_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        local = tl.arange(0, CHUNK)
        docs_ptr += batch * docs_stride_b
        dot = w_ptr.dtype.element_ty
        state_offsets = dims[:, None] * v_dim + v_cols[None, :]
        state_mask = (dims < k_dim)[:, None] & (v_cols < v_dim)[None, :]
        state_size = k_dim * v_dim
        if HAS_INITIAL:
            s = tl.load(
                h0_ptr + (batch * v_heads + head) * state_size + state_offsets, mask=state_mask, other=0.0
            )
        else:
            s = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        n_chunks = tl.cdiv(seq, CHUNK)
        # Loop-invariant int32 offsets within a chunk; each chunk adds one int64 scalar base.
        k_tile = local[:, None] * (v_heads * k_dim) + dims[None, :]
        v_tile = local[:, None] * (v_heads * v_dim) + v_cols[None, :]
        qk_tile = local[:, None] * (k_heads * k_dim) + dims[None, :]
        aqk_tile = local[:, None] * (v_heads * CHUNK) + local[None, :]
        qk_base = batch * seq * (k_heads * k_dim) + (head // GROUP) * k_dim
        for n in range(n_chunks):
            start = n * CHUNK
            rows = start + local
            valid = rows < seq
            _, carry, in_last, last, last_carries = _chunk_docs(
                docs_ptr, rows, start, seq, docs_stride_t, CHUNK
            )
            first = (batch * seq + start) * v_heads + head
            b = tl.load(b_ptr + first + local * v_heads, mask=valid, other=0.0)
            b_last = tl.load(b_ptr + (batch * seq + last) * v_heads + head)
            if STORE_STATES:
                tl.store(
                    h_ptr + ((batch * n_chunks + n) * v_heads + head) * state_size + state_offsets,
                    s.to(h_ptr.dtype.element_ty),
                    mask=state_mask,
                )
            k_mask = valid[:, None] & (dims < k_dim)[None, :]
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            qk_at = qk_base + start * (k_heads * k_dim) + qk_tile
            w = tl.load(w_ptr + first * k_dim + k_tile, mask=k_mask, other=0.0)
            v_at = first * v_dim + v_tile
            delta = tl.load(u_ptr + v_at, mask=v_mask, other=0.0) - _mma(w, s, dot)
            if STORE_STATES:
                tl.store(delta_ptr + v_at, delta.to(delta_ptr.dtype.element_ty), mask=v_mask)
            if STORE_OUTPUT:
                q = tl.load(q_ptr + qk_at, mask=k_mask, other=0.0)
                q = q * tl.where(carry, tl.exp(b), 0.0)[:, None]
                aqk = tl.load(aqk_ptr + first * CHUNK + aqk_tile, mask=valid[:, None], other=0.0)
                o = _mma(q, s, dot) + _mma(aqk, delta, dot)
                tl.store(o_ptr + v_at, o.to(o_ptr.dtype.element_ty), mask=v_mask)
            k = tl.load(k_ptr + qk_at, mask=k_mask, other=0.0)
            k = k * tl.where(in_last, tl.exp(b_last - b), 0.0)[:, None]
            s = s * tl.where(last_carries, tl.exp(b_last), 0.0) + _mma(tl.trans(k), delta, dot)
        if STORE_FINAL:
            tl.store(ht_ptr + (batch * v_heads + head) * state_size + state_offsets, s, mask=state_mask)

    @triton.jit
    def _chunk_scan_bwd_kernel(
        q_ptr,
        k_ptr,
        w_ptr,
        aqk_ptr,
        b_ptr,
        docs_ptr,
        do_ptr,
        dht_ptr,
        ddelta_ptr,
        dh_ptr,
        dh0_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs_stride_b,
        docs_stride_t,
        do_stride_b,
        do_stride_t,
        do_stride_h,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        HAS_FINAL_GRAD: tl.constexpr,
        STORE_INITIAL_GRAD: tl.constexpr,
    ):
        """The forward scan in reverse, carrying dS [Dk, BLOCK_V] in fp32: only what the recurrence
        needs, d delta = Aqk^T dO + K~ dS and dS <- decay dS + Q~^T dO - W^T d delta. It stores each
        chunk's d delta and the dS leaving the chunk; the state's shares of dq, dk, dW and db, which
        need no recurrence, follow chunk-parallel in _chunk_bwd_state_kernel."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        dims = tl.arange(0, BLOCK_K)
        v_cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        local = tl.arange(0, CHUNK)
        docs_ptr += batch * docs_stride_b
        dot = w_ptr.dtype.element_ty
        state_offsets = dims[:, None] * v_dim + v_cols[None, :]
        state_mask = (dims < k_dim)[:, None] & (v_cols < v_dim)[None, :]
        state_size = k_dim * v_dim
        if HAS_FINAL_GRAD:
            ds = tl.load(
                dht_ptr + (batch * v_heads + head) * state_size + state_offsets, mask=state_mask, other=0.0
            )
        else:
            ds = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        n_chunks = tl.cdiv(seq, CHUNK)
        # Loop-invariant int32 offsets within a chunk; each chunk adds one int64 scalar base.
        k_tile = local[:, None] * (v_heads * k_dim) + dims[None, :]
        v_tile = local[:, None] * (v_heads * v_dim) + v_cols[None, :]
        qk_tile = local[:, None] * (k_heads * k_dim) + dims[None, :]
        aqk_tile = local[:, None] * (v_heads * CHUNK) + local[None, :]
        do_tile = local[:, None] * do_stride_t + v_cols[None, :]
        qk_base = batch * seq * (k_heads * k_dim) + (head // GROUP) * k_dim
        for i in range(n_chunks):
            n = n_chunks - 1 - i
            start = n * CHUNK
            rows = start + local
            valid = rows < seq
            _, carry, in_last, last, last_carries = _chunk_docs(
                docs_ptr, rows, start, seq, docs_stride_t, CHUNK
            )
            first = (batch * seq + start) * v_heads + head
            b = tl.load(b_ptr + first + local * v_heads, mask=valid, other=0.0)
            b_last = tl.load(b_ptr + (batch * seq + last) * v_heads + head)
            tl.store(
                dh_ptr + ((batch * n_chunks + n) * v_heads + head) * state_size + state_offsets,
                ds.to(dh_ptr.dtype.element_ty),
                mask=state_mask,
            )
            k_mask = valid[:, None] & (dims < k_dim)[None, :]
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            qk_at = qk_base + start * (k_heads * k_dim) + qk_tile
            v_at = first * v_dim + v_tile
            do_at = batch * do_stride_b + start * do_stride_t + head * do_stride_h + do_tile
            do = tl.load(do_ptr + do_at, mask=v_mask, other=0.0)
            aqk = tl.load(aqk_ptr + first * CHUNK + aqk_tile, mask=valid[:, None], other=0.0)
            k = tl.load(k_ptr + qk_at, mask=k_mask, other=0.0)
            k = k * tl.where(in_last, tl.exp(b_last - b), 0.0)[:, None]
            ddelta = _mma(tl.trans(aqk), do, dot) + _mma(k, ds, dot)
            tl.store(ddelta_ptr + v_at, ddelta.to(ddelta_ptr.dtype.element_ty), mask=v_mask)
            q = tl.load(q_ptr + qk_at, mask=k_mask, other=0.0)
            q = q * tl.where(carry, tl.exp(b), 0.0)[:, None]
            w = tl.load(w_ptr + first * k_dim + k_tile, mask=k_mask, other=0.0)
            decay = tl.where(last_carries, tl.exp(b_last), 0.0)
            ds = ds * decay + _mma(tl.trans(q), do, dot) - _mma(tl.trans(w), ddelta, dot)
        if STORE_INITIAL_GRAD:
            tl.store(dh0_ptr + (batch * v_heads + head) * state_size + state_offsets, ds, mask=state_mask)

    @triton.jit
    def _chunk_bwd_state_kernel(
        q_ptr,
        k_ptr,
        b_ptr,
        docs_ptr,
        h_ptr,
        dh_ptr,
        delta_ptr,
        ddelta_ptr,
        do_ptr,
        dq_ptr,
        dk_ptr,
        dw_ptr,
        db_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs_stride_b,
        docs_stride_t,
        do_stride_b,
        do_stride_t,
        do_stride_h,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Per chunk and v-head, the state's share of the gradients, from the state S entering the
        chunk and the dS leaving it (both stored by the scans), over Dv in blocks of BLOCK_V:
        dq = carry exp(b) dO S^T, dk = K~'s scale (delta dS^T), dW = -d delta S^T, and db's terms
        (q . dq - k . dk, with the last token taking the decays' sum and exp(b_last) S . dS).
        Written whole, in fp32, for _chunk_bwd_intra_kernel to add its terms to."""
        n = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        start = n * CHUNK
        local = tl.arange(0, CHUNK)
        rows = start + local
        valid = rows < seq
        dims = tl.arange(0, BLOCK_K)
        k_mask = valid[:, None] & (dims < k_dim)[None, :]
        _, carry, in_last, last, last_carries = _chunk_docs(
            docs_ptr + batch * docs_stride_b, rows, start, seq, docs_stride_t, CHUNK
        )
        token_head = (batch * seq + rows) * v_heads + head
        b = tl.load(b_ptr + token_head, mask=valid, other=0.0)
        b_last = tl.load(b_ptr + (batch * seq + last) * v_heads + head)
        dot = h_ptr.dtype.element_ty
        state_base = ((batch * tl.cdiv(seq, CHUNK) + n) * v_heads + head) * (k_dim * v_dim)
        dq = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
        dk = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
        dw = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
        carried = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        for v_start in range(0, v_dim, BLOCK_V):
            v_cols = v_start + tl.arange(0, BLOCK_V)
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            state_mask = (dims < k_dim)[:, None] & (v_cols < v_dim)[None, :]
            state_at = state_base + dims[:, None] * v_dim + v_cols[None, :]
            s = tl.load(h_ptr + state_at, mask=state_mask, other=0.0)
            ds = tl.load(dh_ptr + state_at, mask=state_mask, other=0.0)
            v_at = token_head[:, None] * v_dim + v_cols[None, :]
            do_at = batch * do_stride_b + rows[:, None] * do_stride_t + head * do_stride_h + v_cols[None, :]
            do = tl.load(do_ptr + do_at, mask=v_mask, other=0.0)
            delta = tl.load(delta_ptr + v_at, mask=v_mask, other=0.0)
            ddelta = tl.load(ddelta_ptr + v_at, mask=v_mask, other=0.0)
            dq += _mma(do, tl.trans(s), dot)
            dk += _mma(delta, tl.trans(ds), dot)
            dw -= _mma(ddelta, tl.trans(s), dot)
            carried += s.to(tl.float32) * ds.to(tl.float32)
        dq *= tl.where(carry, tl.exp(b), 0.0)[:, None]
        dk *= tl.where(in_last, tl.exp(b_last - b), 0.0)[:, None]
        qk_offsets = (
            (batch * seq + rows[:, None]) * (k_heads * k_dim) + (head // GROUP) * k_dim + dims[None, :]
        )
        q = tl.load(q_ptr + qk_offsets, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offsets, mask=k_mask, other=0.0).to(tl.float32)
        dk_terms = tl.sum(dk * k, axis=1)
        decay = tl.where(last_carries, tl.exp(b_last), 0.0)
        db = tl.sum(dq * q, axis=1) - dk_terms
        db += tl.where(
            local == last - start,
            tl.sum(dk_terms, axis=0) + decay * tl.sum(tl.sum(carried, axis=1), axis=0),
            0.0,
        )
        k_offsets = token_head[:, None] * k_dim + dims[None, :]
        tl.store(dq_ptr + k_offsets, dq, mask=k_mask)
        tl.store(dk_ptr + k_offsets, dk, mask=k_mask)
        tl.store(dw_ptr + k_offsets, dw, mask=k_mask)
        tl.store(db_ptr + token_head, db, mask=valid)

    @triton.jit
    def _pair_decay(b, doc, local, valid, TRANSPOSED: tl.constexpr):
        """exp(b_i - b_j) for the pairs j <= i of one document, 0 elsewhere: the decay between two
        tokens of a chunk, as [i, j] or TRANSPOSED as [j, i]."""
        if TRANSPOSED:
            same = (doc[:, None] == doc[None, :]) & (local[:, None] <= local[None, :]) & valid[None, :]
            return tl.where(same, tl.exp(tl.where(same, b[None, :] - b[:, None], 0.0)), 0.0)
        else:
            same = (doc[:, None] == doc[None, :]) & (local[:, None] >= local[None, :]) & valid[:, None]
            return tl.where(same, tl.exp(tl.where(same, b[:, None] - b[None, :], 0.0)), 0.0)

    @triton.jit
    def _chunk_bwd_intra_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        beta_ptr,
        b_ptr,
        docs_ptr,
        t_ptr,
        w_ptr,
        u_ptr,
        delta_ptr,
        do_ptr,
        ddelta_ptr,
        dw_ptr,
        dq_ptr,
        dk_ptr,
        db_ptr,
        dv_ptr,
        dbeta_ptr,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        v_stride_b,
        v_stride_t,
        v_stride_h,
        beta_stride_b,
        beta_stride_t,
        beta_stride_h,
        docs_stride_b,
        docs_stride_t,
        do_stride_b,
        do_stride_t,
        do_stride_h,
        GROUP: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Per chunk and v-head, back through what _chunk_wu_kernel and _chunk_solve_kernel built:
        the output's Aqk, U = T diag(beta) V, W = T diag(beta carry exp(b)) K, and T = (I + A)^-1
        (dA = -T^T (dU U^T + dW W^T) on A's strictly lower same-document support). dq, dk and db
        arrive holding the scan's terms and leave complete. The transposed dqk^T and dA^T that dk
        needs are recomputed from loaded tiles (see the NOTE on the Hopper miscompile)."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        start = tl.program_id(0) * CHUNK
        local = tl.arange(0, CHUNK)
        rows = start + local
        valid = rows < seq
        # Row starts of the [CHUNK, Dk] tiles: q and k per k-head, and the per-v-head W, dW, dq, dk.
        qk_base = (batch * seq + rows[:, None]) * (k_heads * k_dim) + (head // GROUP) * k_dim
        token_head = (batch * seq + rows) * v_heads + head
        k_base = token_head[:, None] * k_dim
        doc, carry, _, _, _ = _chunk_docs(
            docs_ptr + batch * docs_stride_b, rows, start, seq, docs_stride_t, CHUNK
        )
        beta = tl.load(
            beta_ptr + batch * beta_stride_b + rows * beta_stride_t + head * beta_stride_h,
            mask=valid,
            other=0.0,
        ).to(tl.float32)
        b = tl.load(b_ptr + token_head, mask=valid, other=0.0)
        read_scale = tl.where(carry, tl.exp(b), 0.0)
        dot = t_ptr.dtype.element_ty
        t = tl.load(
            t_ptr + token_head[:, None] * CHUNK + local[None, :],
            mask=valid[:, None] & (local[None, :] <= local[:, None]),
            other=0.0,
        )
        # The value side, over Dv in BLOCK_V columns: o += Aqk delta (Aqk = (Q K^T) * decay) and
        # U = T (beta V) give [CHUNK, CHUNK] sums over Dv (dO delta^T and dU U^T, each also
        # transposed), dv and dbeta's V term.
        dqk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dqk_t = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dm = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dm_t = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dbeta = tl.zeros([CHUNK], dtype=tl.float32)
        for v_start in range(0, v_dim, BLOCK_V):
            v_cols = v_start + tl.arange(0, BLOCK_V)
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            v_offsets = token_head[:, None] * v_dim + v_cols[None, :]
            do_at = batch * do_stride_b + rows[:, None] * do_stride_t + head * do_stride_h + v_cols[None, :]
            do = tl.load(do_ptr + do_at, mask=v_mask, other=0.0)
            delta = tl.load(delta_ptr + v_offsets, mask=v_mask, other=0.0)
            dqk += _mma(do, tl.trans(delta), dot)
            dqk_t += _mma(delta, tl.trans(do), dot)
            du = tl.load(ddelta_ptr + v_offsets, mask=v_mask, other=0.0)
            u = tl.load(u_ptr + v_offsets, mask=v_mask, other=0.0)
            dm += _mma(du, tl.trans(u), dot)
            dm_t += _mma(u, tl.trans(du), dot)
            d_beta_v = _mma(tl.trans(t), du, dot)
            v_at = batch * v_stride_b + rows[:, None] * v_stride_t + head * v_stride_h + v_cols[None, :]
            v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)
            tl.store(dv_ptr + v_offsets, (d_beta_v * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=v_mask)
            dbeta += tl.sum(d_beta_v * v, axis=1)
        # The decays (and their transposes) are rebuilt where used, so that they hold no registers
        # across the loops.
        dqk *= _pair_decay(b, doc, local, valid, False)
        dqk_t *= _pair_decay(b, doc, local, valid, True)
        # The key side, over Dk in BLOCK_K columns, twice: first the [CHUNK, CHUNK] sums over Dk
        # (Q K^T, K K^T and W's dW W^T into dM), then, with dA known, dq and dk column by column.
        # W = T diag(beta carry exp(b)) K, so T^T dW is the gradient of W's scaled keys.
        qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        kk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        scale_terms = tl.zeros([CHUNK], dtype=tl.float32)
        for k_start in range(0, k_dim, BLOCK_K):
            dims = k_start + tl.arange(0, BLOCK_K)
            k_mask = valid[:, None] & (dims < k_dim)[None, :]
            q = tl.load(q_ptr + qk_base + dims[None, :], mask=k_mask, other=0.0)
            k = tl.load(k_ptr + qk_base + dims[None, :], mask=k_mask, other=0.0)
            qk += _mma(q, tl.trans(k), dot)
            kk += _mma(k, tl.trans(k), dot)
            dw = tl.load(dw_ptr + k_base + dims[None, :], mask=k_mask, other=0.0)
            w = tl.load(w_ptr + k_base + dims[None, :], mask=k_mask, other=0.0)
            dm += _mma(dw, tl.trans(w), dot)
            dm_t += _mma(w, tl.trans(dw), dot)
            scale_terms += tl.sum(_mma(tl.trans(t), dw, dot) * k.to(tl.float32), axis=1)
        log_terms = dqk * qk
        db = tl.sum(log_terms, axis=1) - tl.sum(log_terms, axis=0)
        scale_terms *= read_scale
        dbeta += scale_terms
        db += scale_terms * beta
        # T = (I + A)^-1, A = beta_i (K K^T) * decay on the strictly lower same-document pairs
        # (where the decay is not zero: its diagonal is 1, so it is kept off that too).
        decay = _pair_decay(b, doc, local, valid, False)
        da = tl.where(local[:, None] > local[None, :], -_mma(tl.trans(t), dm, dot), 0.0) * decay
        dbeta += tl.sum(da * kk, axis=1)
        dkk = da * beta[:, None]
        decay_t = _pair_decay(b, doc, local, valid, True)
        dkk_t = tl.where(local[:, None] < local[None, :], -_mma(dm_t, t, dot), 0.0) * decay_t * beta[None, :]
        log_terms = dkk * kk
        db += tl.sum(log_terms, axis=1) - tl.sum(log_terms, axis=0)
        db += tl.load(db_ptr + token_head, mask=valid, other=0.0)
        tl.store(db_ptr + token_head, db, mask=valid)
        for k_start in range(0, k_dim, BLOCK_K):
            dims = k_start + tl.arange(0, BLOCK_K)
            k_mask = valid[:, None] & (dims < k_dim)[None, :]
            q = tl.load(q_ptr + qk_base + dims[None, :], mask=k_mask, other=0.0)
            k = tl.load(k_ptr + qk_base + dims[None, :], mask=k_mask, other=0.0)
            dq = _mma(dqk, k, dot) + tl.load(dq_ptr + k_base + dims[None, :], mask=k_mask, other=0.0)
            tl.store(dq_ptr + k_base + dims[None, :], dq, mask=k_mask)
            dw = tl.load(dw_ptr + k_base + dims[None, :], mask=k_mask, other=0.0)
            dk = _mma(dqk_t, q, dot) + _mma(tl.trans(t), dw, dot) * (beta * read_scale)[:, None]
            dk += _mma(dkk, k, dot) + _mma(dkk_t, k, dot)
            dk += tl.load(dk_ptr + k_base + dims[None, :], mask=k_mask, other=0.0)
            tl.store(dk_ptr + k_base + dims[None, :], dk, mask=k_mask)
        dbeta_ptrs = dbeta_ptr + (batch * seq + rows) * v_heads + head
        tl.store(dbeta_ptrs, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)

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


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

_MAX_HEAD_DIM = 256
# The per-chunk kernels hold several [64, Dk] fp32 tiles at once; 8 warps keep them in registers at 128.
_WARPS = 8
# The scans' loops: two stages prefetch the next chunk's tables while this one computes; three (the
# default) double the buffers past Hopper's 227 KiB of shared memory per block.
# benchmarks.kernel_resources shows what each setting costs, benchmarks.delta_rule what it gains.
_SCAN_STAGES = 2
_SCAN_WARPS = 4


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"the v-heads ({v_heads}) must be a multiple of the k-heads ({k_heads})")
    if g.shape != (batch, seq, v_heads) or beta.shape != (batch, seq, v_heads):
        raise ValueError(f"g and beta must be [B, T, Hv] = {(batch, seq, v_heads)}")
    if max(k_dim, v_dim) > _MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {_MAX_HEAD_DIM} are supported, got Dk={k_dim}, Dv={v_dim}")
    if initial_state is not None and initial_state.shape != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(batch, v_heads, k_dim, v_dim)}")


def _table_dtype(v: torch.Tensor) -> torch.dtype:
    """The chunk tables' dtype, which is the tensor-core operand dtype (see TENSOR_CORE_DTYPES)."""
    return v.dtype if v.dtype in TENSOR_CORE_DTYPES else torch.float32


def _block(dim: int) -> int:
    """tl.dot takes tiles of 16 and more; smaller and non-power-of-two head dims are zero-padded."""
    return max(16, triton.next_power_of_2(dim))


# The per-chunk backward kernels take Dv (and Dk) in blocks of this many columns: fewer live registers.
_CHUNK_BLOCK = 64
_CHUNK_STAGES = 3


def _block_v(v_dim: int) -> int:
    """The scans run one program per (Dv block, batch, v-head); 32 columns keep the fp32 state slice
    [Dk, 32] in registers and give B*Hv*Dv/32 programs (256 at 9B's B=2) to fill the GPU."""
    return min(32, _block(v_dim))


_L2NORM_ROWS = 32


def _normalized(x: torch.Tensor, scale: float, normalize: bool, dtype: torch.dtype) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    n_rows = batch * seq * heads
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _l2norm_fwd_kernel[(triton.cdiv(n_rows, _L2NORM_ROWS),)](
        x,
        out,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        seq,
        heads,
        n_rows,
        dim,
        scale,
        NORMALIZE=normalize,
        BLOCK_R=_L2NORM_ROWS,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


def _normalized_backward(x: torch.Tensor, dy: torch.Tensor, scale: float, normalize: bool) -> torch.Tensor:
    batch, seq, heads, dim = x.shape
    n_rows = batch * seq * heads
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _l2norm_bwd_kernel[(triton.cdiv(n_rows, _L2NORM_ROWS),)](
        x,
        dy,
        dx,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        seq,
        heads,
        n_rows,
        dim,
        scale,
        NORMALIZE=normalize,
        BLOCK_R=_L2NORM_ROWS,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return dx


def _chunk_cumsum(x: torch.Tensor, docs: torch.Tensor, reverse: bool) -> torch.Tensor:
    batch, seq, heads = x.shape
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _chunk_cumsum_kernel[(triton.cdiv(seq, CHUNK), batch)](
        x,
        docs,
        out,
        seq,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        docs.stride(0),
        docs.stride(1),
        REVERSE=reverse,
        CHUNK=CHUNK,
        BLOCK_H=_block(heads),
    )
    return out


def _chunk_forward(q, k, v, beta, b, docs, initial_state, output_final_state, store_states):
    """The chunked forward on normalised q, k (in the tables' dtype) and the per-chunk cumulative log-decay b; with
    store_states, backward's rerun: the per-chunk entering states and corrections that backward reads,
    and no output."""
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    n_chunks = triton.cdiv(seq, CHUNK)
    device = v.device
    block_k, block_v = _block(k_dim), _block_v(v_dim)
    per_chunk = (n_chunks, batch, v_heads)
    tables = _table_dtype(v)
    t = torch.empty(batch, seq, v_heads, CHUNK, dtype=tables, device=device)
    _chunk_solve_kernel[per_chunk](
        k,
        beta,
        b,
        docs,
        t,
        seq,
        k_heads,
        v_heads,
        k_dim,
        beta.stride(0),
        beta.stride(1),
        beta.stride(2),
        docs.stride(0),
        docs.stride(1),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=block_k,
    )
    w = torch.empty(batch, seq, v_heads, k_dim, dtype=tables, device=device)
    u = torch.empty(batch, seq, v_heads, v_dim, dtype=torch.float32, device=device)
    aqk = torch.empty_like(t)
    _chunk_wu_kernel[per_chunk](
        q,
        k,
        v,
        beta,
        b,
        docs,
        t,
        w,
        u,
        aqk,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        v.stride(0),
        v.stride(1),
        v.stride(2),
        beta.stride(0),
        beta.stride(1),
        beta.stride(2),
        docs.stride(0),
        docs.stride(1),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=block_k,
        BLOCK_V=_block(v_dim),
        num_warps=_WARPS,
    )
    o = torch.empty(batch, seq, v_heads, v_dim, dtype=v.dtype, device=device)
    final = (
        torch.empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
        if output_final_state
        else o
    )
    h = (
        torch.empty(batch, n_chunks, v_heads, k_dim, v_dim, dtype=tables, device=device)
        if store_states
        else o
    )
    delta = torch.empty(u.shape, dtype=tables, device=device) if store_states else o
    _chunk_scan_fwd_kernel[(triton.cdiv(v_dim, block_v), batch, v_heads)](
        q,
        k,
        w,
        u,
        aqk,
        b,
        docs,
        o if initial_state is None else initial_state,
        o,
        delta,
        h,
        final,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs.stride(0),
        docs.stride(1),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        HAS_INITIAL=initial_state is not None,
        STORE_FINAL=output_final_state,
        STORE_STATES=store_states,
        STORE_OUTPUT=not store_states,
        num_warps=_SCAN_WARPS,
        num_stages=_SCAN_STAGES,
    )
    saved = (t, w, u, aqk, h, delta) if store_states else None
    return o, final if output_final_state else None, saved


def _prepare(q, k, v, g, docs, scale, normalize_qk):
    return (
        _normalized(q, scale, normalize_qk, _table_dtype(v)),
        _normalized(k, 1.0, normalize_qk, _table_dtype(v)),
        _chunk_cumsum(g, docs, False),
    )


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


def _chunk_backward(q, k, v, beta, b, docs, initial_state, saved, do, dfinal):
    """(dq, dk) per v-head on the normalised inputs, dv, dbeta, db (the cumulative log-decay's
    gradient) and d initial_state."""
    t, w, u, aqk, h, delta = saved
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    block_k, block_v = _block(k_dim), _block_v(v_dim)
    device = v.device
    do = unit_last_stride(do)
    ddelta = torch.empty(u.shape, dtype=w.dtype, device=device)
    dh = torch.empty_like(h)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else ddelta
    _chunk_scan_bwd_kernel[(triton.cdiv(v_dim, block_v), batch, v_heads)](
        q,
        k,
        w,
        aqk,
        b,
        docs,
        do,
        ddelta if dfinal is None else dfinal.contiguous(),
        ddelta,
        dh,
        dh0,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs.stride(0),
        docs.stride(1),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        HAS_FINAL_GRAD=dfinal is not None,
        STORE_INITIAL_GRAD=initial_state is not None,
        num_warps=_SCAN_WARPS,
        num_stages=_SCAN_STAGES,
    )
    dq, dk, dw = (
        torch.empty(batch, seq, v_heads, k_dim, dtype=torch.float32, device=device) for _ in range(3)
    )
    db = torch.empty(batch, seq, v_heads, dtype=torch.float32, device=device)
    _chunk_bwd_state_kernel[(triton.cdiv(seq, CHUNK), batch, v_heads)](
        q,
        k,
        b,
        docs,
        h,
        dh,
        delta,
        ddelta,
        do,
        dq,
        dk,
        dw,
        db,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        docs.stride(0),
        docs.stride(1),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=block_k,
        BLOCK_V=min(_CHUNK_BLOCK, _block(v_dim)),
        num_warps=_WARPS,
    )
    dv = torch.empty(v.shape, dtype=v.dtype, device=device)
    dbeta = torch.empty(beta.shape, dtype=beta.dtype, device=device)
    _chunk_bwd_intra_kernel[(triton.cdiv(seq, CHUNK), batch, v_heads)](
        q,
        k,
        v,
        beta,
        b,
        docs,
        t,
        w,
        u,
        delta,
        do,
        ddelta,
        dw,
        dq,
        dk,
        db,
        dv,
        dbeta,
        seq,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        v.stride(0),
        v.stride(1),
        v.stride(2),
        beta.stride(0),
        beta.stride(1),
        beta.stride(2),
        docs.stride(0),
        docs.stride(1),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        GROUP=group,
        CHUNK=CHUNK,
        BLOCK_K=min(_CHUNK_BLOCK, block_k),
        BLOCK_V=min(_CHUNK_BLOCK, _block(v_dim)),
        num_warps=_WARPS,
        num_stages=_CHUNK_STAGES,
    )
    return dq, dk, dv, dbeta, db, dh0 if initial_state is not None else None


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class GatedDeltaRuleFunction(torch.autograd.Function):
    """Saves only the inputs: backward recomputes the chunk tables and the per-chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, docs, initial_state, scale, normalize_qk, output_final_state):
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        q_hat, k_hat, b = _prepare(q, k, v, g, docs, scale, normalize_qk)
        o, final, _ = _chunk_forward(q_hat, k_hat, v, beta, b, docs, initial_state, output_final_state, False)
        ctx.save_for_backward(q, k, v, g, beta, docs, initial_state)
        ctx.scale, ctx.normalize_qk = scale, normalize_qk
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, docs, initial_state = ctx.saved_tensors
        q_hat, k_hat, b = _prepare(q, k, v, g, docs, ctx.scale, ctx.normalize_qk)
        _, _, saved = _chunk_forward(q_hat, k_hat, v, beta, b, docs, initial_state, False, True)
        dq_hat, dk_hat, dv, dbeta, db, dh0 = _chunk_backward(
            q_hat, k_hat, v, beta, b, docs, initial_state, saved, do, dfinal
        )
        batch, seq, k_heads, k_dim = q.shape
        per_k_head = (batch, seq, k_heads, v.shape[2] // k_heads, k_dim)
        dq = _normalized_backward(q, dq_hat.view(per_k_head).sum(3), ctx.scale, ctx.normalize_qk)
        dk = _normalized_backward(k, dk_hat.view(per_k_head).sum(3), 1.0, ctx.normalize_qk)
        dg = _chunk_cumsum(db, docs, True).to(g.dtype)
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3.5's chunked gated delta rule; returns (o [B, T, Hv, Dv] in v's dtype, final state or None).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv], Hv a multiple of Hk (v-head h reads k-head h // (Hv/Hk),
    as transformers' repeat_interleave); g (log-decay, <= 0) and beta [B, T, Hv]; doc_ids int [B, T]
    or None: the state restarts from zero where doc_ids changes, and initial_state (fp32
    [B, Hv, Dk, Dv]) seeds each row's first document only. The final state, fp32 [B, Hv, Dk, Dv],
    is the state after each row's last token. scale defaults to Dk**-0.5; normalize_qk L2-normalises
    q and k first (transformers' l2norm). Dk and Dv up to 256, any size (padded to powers of two).
    """
    _check(q, k, v, g, beta, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_triton(v):
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        return GatedDeltaRuleFunction.apply(
            q,
            k,
            v,
            g,
            beta,
            documents_per_token(doc_ids, v),
            initial_state,
            scale,
            normalize_qk,
            output_final_state,
        )
    return gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        doc_ids,
        scale=scale,
        normalize_qk=normalize_qk,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
) -> torch.Tensor:
    """One decode token: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> o [B, Hv, Dv] in v's
    dtype; state (fp32 [B, Hv, Dk, Dv]) is updated in place. No host syncs and no value-dependent
    allocation, so a CUDA graph can capture it. Inference only (no autograd)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_triton(v):
        return _step(q, k, v, g, beta, state, scale, normalize_qk)
    return gated_delta_rule_step_reference(q, k, v, g, beta, state, scale=scale, normalize_qk=normalize_qk)
