"""The chunk tables: q and k L2-normalised, the log-decay summed within each chunk and document,
T = (I + A)^-1 by a blockwise triangular solve, and W, U and the decayed Q K^T of every chunk."""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE

from .common import CHUNK, _block, _table_dtype

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .common import _chunk_docs, _mma

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
        GROUP: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """d(x r) = r (dy - y (y . dy)) with r = (sum x^2 + eps)^-1/2 and y = x r, recomputed from x;
        dy is the sum of the GROUP consecutive heads of dy_ptr's that read this head."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (rows < n_rows)[:, None] & (dims < dim)
        offsets = rows[:, None] * dim + dims
        dy = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for reader in tl.static_range(GROUP):
            dy += tl.load(dy_ptr + (rows[:, None] * GROUP + reader) * dim + dims, mask=mask, other=0.0)
        dy = dy * scale
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
    def _block_a(k_i, beta_i, b_i, doc_i, rows_i, k_j, b_j, doc_j, rows_j, dtype: tl.constexpr):
        """A[i, j] = beta_i (k_i . k_j) exp(b_i - b_j) for the earlier tokens j of i's document."""
        mask = (doc_i[:, None] == doc_j[None, :]) & (rows_i[:, None] > rows_j[None, :])
        decay = tl.exp(tl.where(mask, b_i[:, None] - b_j[None, :], 0.0))
        return tl.where(mask, _mma(k_i, tl.trans(k_j), dtype) * decay * beta_i[:, None], 0.0)

    @triton.jit
    def _block_a_transposed(k, beta, b, doc, rows, dtype: tl.constexpr):
        """A diagonal block's A^T: [j, i] = A[i, j] (see _block_a), for the substitution's columns."""
        mask = (doc[:, None] == doc[None, :]) & (rows[None, :] > rows[:, None])
        decay = tl.exp(tl.where(mask, b[None, :] - b[:, None], 0.0))
        return tl.where(mask, _mma(k, tl.trans(k), dtype) * decay * beta[None, :], 0.0)

    @triton.jit
    def _substitution_row(a_t, x, rows, i):
        """x with row i set to row i of (I + a)^-1, given a^T and the rows above i final:
        e_i - sum_{j < i} a[i, j] x[j, :]."""
        a_i = tl.sum(tl.where(rows[None, :] == i, a_t, 0.0), axis=1)
        return tl.where(rows[:, None] == i, x - tl.sum(a_i[:, None] * x, axis=0)[None, :], x)

    @triton.jit
    def _unit_lower_inverses(a0_t, a1_t, a2_t, a3_t):
        """(I + a)^-1 for each of four strictly lower 16 x 16 tiles, from their transposes, by forward
        substitution, a row a step: 16 x 16 multiply-adds a row, where a product with the whole tile
        would cost 16 times that. No power of a (whose entries can grow like binomials and cancel) is
        ever formed. The four chains step together, so each step's four updates overlap."""
        rows = tl.arange(0, 16)
        eye = (rows[:, None] == rows[None, :]).to(tl.float32)
        x0, x1, x2, x3 = eye, eye, eye, eye
        for i in range(1, 16):
            x0 = _substitution_row(a0_t, x0, rows, i)
            x1 = _substitution_row(a1_t, x1, rows, i)
            x2 = _substitution_row(a2_t, x2, rows, i)
            x3 = _substitution_row(a3_t, x3, rows, i)
        return x0, x1, x2, x3

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
        k_heads: tl.constexpr,
        v_heads: tl.constexpr,
        k_dim: tl.constexpr,
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
        a00_t = _block_a_transposed(k0, be0, b0, d0, r0, dot)
        a11_t = _block_a_transposed(k1, be1, b1, d1, r1, dot)
        a22_t = _block_a_transposed(k2, be2, b2, d2, r2, dot)
        a33_t = _block_a_transposed(k3, be3, b3, d3, r3, dot)
        a10 = _block_a(k1, be1, b1, d1, r1, k0, b0, d0, r0, dot)
        a20 = _block_a(k2, be2, b2, d2, r2, k0, b0, d0, r0, dot)
        a21 = _block_a(k2, be2, b2, d2, r2, k1, b1, d1, r1, dot)
        a30 = _block_a(k3, be3, b3, d3, r3, k0, b0, d0, r0, dot)
        a31 = _block_a(k3, be3, b3, d3, r3, k1, b1, d1, r1, dot)
        a32 = _block_a(k3, be3, b3, d3, r3, k2, b2, d2, r2, dot)
        t00, t11, t22, t33 = _unit_lower_inverses(a00_t, a11_t, a22_t, a33_t)
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
        k_heads: tl.constexpr,
        v_heads: tl.constexpr,
        k_dim: tl.constexpr,
        v_dim: tl.constexpr,
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
    """dx for x [B, T, H, D] from dy [B, T, H·G, D] contiguous, of the G heads that read each of x's
    (value heads sharing a key head), summed in the kernel."""
    batch, seq, heads, dim = x.shape
    group = dy.shape[2] // heads
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
        GROUP=group,
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


# The solve's tiles are 16 x 16 (its key tiles [16, Dk]), the W/U/Aqk tables' [64, Dk]. On the H200
# (benchmarks.delta_rule, 2026-12-03) 2 warps for the solve (was 4) and 4 for the tables (was 8) each
# took 7% off the forward and 3% off forward + backward, at 4 x 2048 and at 1 x 32768.
_SOLVE_WARPS = 2
_TABLE_WARPS = 4


def _chunk_solve(k, v, beta, b, docs):
    """T = (I + A)^-1 of every chunk and v-head, [B, T, Hv, CHUNK] in the tables' dtype."""
    batch, seq, k_heads, k_dim = k.shape
    v_heads = v.shape[2]
    t = torch.empty(batch, seq, v_heads, CHUNK, dtype=_table_dtype(v), device=v.device)
    _chunk_solve_kernel[(triton.cdiv(seq, CHUNK), batch, v_heads)](
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
        GROUP=v_heads // k_heads,
        CHUNK=CHUNK,
        BLOCK_K=_block(k_dim),
        num_warps=_SOLVE_WARPS,
    )
    return t


def _chunk_tables(q, k, v, beta, b, docs, t):
    """(W, U, Aqk) for normalised q, k (in the tables' dtype), the per-chunk cumulative log-decay b
    and the chunks' T (_chunk_solve): with T, everything of a chunk that does not depend on the
    state entering it."""
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    n_chunks = triton.cdiv(seq, CHUNK)
    device = v.device
    block_k = _block(k_dim)
    per_chunk = (n_chunks, batch, v_heads)
    tables = _table_dtype(v)
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
        num_warps=_TABLE_WARPS,
    )
    return w, u, aqk
