"""The chunk-parallel backward: the state's share of dq, dk, dW and db from the stored states and
their gradients, then each chunk back through its tables (Aqk, U, W and the triangular solve)."""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE
from qlora_kernels._layout import unit_last_stride

from .common import _WARPS, CHUNK, _block
from .scan import _scan_backward

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .common import _chunk_docs, _mma

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

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
        k_heads: tl.constexpr,
        v_heads: tl.constexpr,
        k_dim: tl.constexpr,
        v_dim: tl.constexpr,
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
        Written whole for _chunk_bwd_intra_kernel, which adds its terms to dq, dk and db (fp32) and
        reads dW (only ever a product's operand, so stored in the tables' dtype)."""
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
        carried = 0.0
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
            carried += tl.sum(tl.sum(s.to(tl.float32) * ds.to(tl.float32), axis=1), axis=0)
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
            tl.sum(dk_terms, axis=0) + decay * carried,
            0.0,
        )
        k_offsets = token_head[:, None] * k_dim + dims[None, :]
        tl.store(dq_ptr + k_offsets, dq, mask=k_mask)
        tl.store(dk_ptr + k_offsets, dk, mask=k_mask)
        tl.store(dw_ptr + k_offsets, dw.to(dw_ptr.dtype.element_ty), mask=k_mask)
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
        transposes_ptr,
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
        arrive holding the scan's terms and leave complete. The transposed dqk^T and dM^T that dk
        needs are stored to the program's two squares of transposes_ptr and loaded back transposed
        (see the NOTE on the Hopper miscompile), not summed a second time in registers."""
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        start = tl.program_id(0) * CHUNK
        transposes_ptr += ((batch * tl.num_programs(0) + tl.program_id(0)) * v_heads + head) * (
            2 * CHUNK * CHUNK
        )
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
        # U = T (beta V) give [CHUNK, CHUNK] sums over Dv (dO delta^T and dU U^T), dv and dbeta's
        # V term.
        dqk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dm = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        dbeta = tl.zeros([CHUNK], dtype=tl.float32)
        for v_start in range(0, v_dim, BLOCK_V):
            v_cols = v_start + tl.arange(0, BLOCK_V)
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            v_offsets = token_head[:, None] * v_dim + v_cols[None, :]
            do_at = batch * do_stride_b + rows[:, None] * do_stride_t + head * do_stride_h + v_cols[None, :]
            do = tl.load(do_ptr + do_at, mask=v_mask, other=0.0)
            delta = tl.load(delta_ptr + v_offsets, mask=v_mask, other=0.0)
            dqk += _mma(do, tl.trans(delta), dot)
            du = tl.load(ddelta_ptr + v_offsets, mask=v_mask, other=0.0)
            u = tl.load(u_ptr + v_offsets, mask=v_mask, other=0.0)
            dm += _mma(du, tl.trans(u), dot)
            d_beta_v = _mma(tl.trans(t), du, dot)
            v_at = batch * v_stride_b + rows[:, None] * v_stride_t + head * v_stride_h + v_cols[None, :]
            v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)
            tl.store(dv_ptr + v_offsets, (d_beta_v * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=v_mask)
            dbeta += tl.sum(d_beta_v * v, axis=1)
        # The decays (and their transposes) are rebuilt where used, so that they hold no registers
        # across the loops.
        dqk *= _pair_decay(b, doc, local, valid, False)
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
            scale_terms += tl.sum(_mma(tl.trans(t), dw, dot) * k.to(tl.float32), axis=1)
        # dqk and dM in the tables' dtype, which their products take them in, and back transposed.
        square = local[:, None] * CHUNK + local[None, :]
        tl.store(transposes_ptr + square, dqk.to(dot))
        tl.store(transposes_ptr + CHUNK * CHUNK + square, dm.to(dot))
        tl.debug_barrier()
        square_t = local[None, :] * CHUNK + local[:, None]
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
        dm_t = tl.load(transposes_ptr + CHUNK * CHUNK + square_t)
        dkk_t = tl.where(local[:, None] < local[None, :], -_mma(dm_t, t, dot), 0.0) * decay_t * beta[None, :]
        log_terms = dkk * kk
        db += tl.sum(log_terms, axis=1) - tl.sum(log_terms, axis=0)
        db += tl.load(db_ptr + token_head, mask=valid, other=0.0)
        tl.store(db_ptr + token_head, db, mask=valid)
        dqk_t = tl.load(transposes_ptr + square_t)
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


# The per-chunk backward kernels take Dv (and Dk) in blocks of this many columns: fewer live registers.
_CHUNK_BLOCK = 64
_CHUNK_STAGES = 3


def _chunk_backward(q, k, v, beta, b, docs, initial_state, saved, do, dfinal):
    """(dq, dk) per v-head on the normalised inputs, dv, dbeta, db (the cumulative log-decay's
    gradient) and d initial_state."""
    t, w, u, aqk, h, delta = saved
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    block_k = _block(k_dim)
    device = v.device
    do = unit_last_stride(do)
    ddelta, dh, dh0 = _scan_backward(q, k, w, aqk, b, docs, do, dfinal, initial_state, h)
    dq, dk = (torch.empty(batch, seq, v_heads, k_dim, dtype=torch.float32, device=device) for _ in range(2))
    # dW is only ever a product's operand (dW W^T, T^T dW), which takes it in the tables' dtype: stored so,
    # it reads back to the same bits for half the bytes.
    dw = torch.empty(batch, seq, v_heads, k_dim, dtype=t.dtype, device=device)
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
    n_chunks = triton.cdiv(seq, CHUNK)
    transposes = torch.empty(batch, n_chunks, v_heads, 2, CHUNK, CHUNK, dtype=t.dtype, device=device)
    _chunk_bwd_intra_kernel[(n_chunks, batch, v_heads)](
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
        transposes,
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
    return dq, dk, dv, dbeta, db, dh0
