"""The state pass: the chunks in order, each (Dv block, row, v-head) carrying its slice of the fp32
state, with the output formed on the way (or, for backward's rerun, the states stored instead); and
the same in reverse for the state's gradient."""

import math

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, multiprocessors

from .common import CHUNK, _block

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .common import _chunk_docs, _mma

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

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
        k_heads: tl.constexpr,
        v_heads: tl.constexpr,
        k_dim: tl.constexpr,
        v_dim: tl.constexpr,
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
        DECAYS_ON_TILES: tl.constexpr,
    ):
        """One (Dv block, batch, v-head) walks the chunks in order, its state slice [Dk, BLOCK_V]
        in fp32 registers (the delta rule is separable over v's columns):
        delta = U - W S;  o = carry exp(b) (Q S) + Aqk delta;
        S <- [last doc carries] exp(b_last) S + K^T ([last doc] exp(b_last - b) delta).
        The per-token decays scale the [CHUNK, BLOCK_V] side of each product, so q and k go from
        memory to the tensor cores as loaded (a quarter of the multiplies at Dk 128 and 32 columns,
        off the chain of products that carries S); with DECAYS_ON_TILES they scale the q and k
        tiles in registers instead, which holds less in shared memory (see _decays_on_tiles). With
        STORE_STATES it stores the entering states (in the tables' dtype: only products read them)
        and the corrections, and skips o: for backward's rerun, which does not read o."""
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
                q_scale = tl.where(carry, tl.exp(b), 0.0)[:, None]
                aqk = tl.load(aqk_ptr + first * CHUNK + aqk_tile, mask=valid[:, None], other=0.0)
                if DECAYS_ON_TILES:
                    o = _mma(q * q_scale, s, dot) + _mma(aqk, delta, dot)
                else:
                    o = _mma(q, s, dot) * q_scale + _mma(aqk, delta, dot)
                tl.store(o_ptr + v_at, o.to(o_ptr.dtype.element_ty), mask=v_mask)
            k = tl.load(k_ptr + qk_at, mask=k_mask, other=0.0)
            k_scale = tl.where(in_last, tl.exp(b_last - b), 0.0)[:, None]
            if DECAYS_ON_TILES and STORE_OUTPUT:
                k = k * k_scale
            else:
                delta = delta * k_scale
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
        HAS_FINAL_GRAD: tl.constexpr,
        STORE_INITIAL_GRAD: tl.constexpr,
        DECAYS_ON_TILES: tl.constexpr,
    ):
        """The forward scan in reverse, carrying dS [Dk, BLOCK_V] in fp32: only what the recurrence
        needs, d delta = Aqk^T dO + K~ dS and dS <- decay dS + Q~^T dO - W^T d delta (K~'s and Q~'s
        decays scale K dS's rows and dO's, or the tiles, as in the forward). It stores each chunk's
        d delta and the dS leaving the chunk; the state's shares of dq, dk, dW and db, which need no
        recurrence, follow chunk-parallel in _chunk_bwd_state_kernel."""
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
            k_scale = tl.where(in_last, tl.exp(b_last - b), 0.0)[:, None]
            if DECAYS_ON_TILES:
                ddelta = _mma(tl.trans(aqk), do, dot) + _mma(k * k_scale, ds, dot)
            else:
                ddelta = _mma(tl.trans(aqk), do, dot) + _mma(k, ds, dot) * k_scale
            tl.store(ddelta_ptr + v_at, ddelta.to(ddelta_ptr.dtype.element_ty), mask=v_mask)
            q = tl.load(q_ptr + qk_at, mask=k_mask, other=0.0)
            q_scale = tl.where(carry, tl.exp(b), 0.0)[:, None]
            if DECAYS_ON_TILES:
                q = q * q_scale
            else:
                do = do * q_scale
            w = tl.load(w_ptr + first * k_dim + k_tile, mask=k_mask, other=0.0)
            decay = tl.where(last_carries, tl.exp(b_last), 0.0)
            ds = ds * decay + _mma(tl.trans(q), do, dot) - _mma(tl.trans(w), ddelta, dot)
        if STORE_INITIAL_GRAD:
            tl.store(dh0_ptr + (batch * v_heads + head) * state_size + state_offsets, ds, mask=state_mask)


# The scans' loops: two stages prefetch the next chunk's tables while this one computes. Three were
# 1.10x faster at one 32K row on the H200 but are wrong there: with triton 3.6 the forward scan's
# output store then reaches past the block's shared memory (compute-sanitizer: "out-of-range shared
# address" at the o store, in the per-document calls of test_gpu_packed_row_equals_documents_one_by_one,
# then an illegal memory access), whether for every launch or only where the programs fit one wave.
# benchmarks.kernel_resources shows what each setting costs, benchmarks.delta_rule what it gains.
_SCAN_STAGES = 2
_SCAN_WARPS = 4


def _block_v(v_dim: int) -> int:
    """The scans run one program per (Dv block, batch, v-head); 32 columns keep the fp32 state slice
    [Dk, 32] in registers and give B*Hv*Dv/32 programs (256 at 9B's B=2) to fill the GPU."""
    return min(32, _block(v_dim))


def _decays_on_tiles(programs: int, device: torch.device) -> bool:
    """Where the programs outnumber the SMs, the decays scale the q and k tiles: the scans then hold
    115 KB of shared memory, and two programs share an SM, where scaling the [CHUNK, BLOCK_V] side
    holds 132 KB and leaves one. Where they fit one wave (a 32K row), the narrow side is faster. On
    the H100 (benchmarks.delta_rule, ms): at 4 x 2048 (512 programs) the forward scan 0.234 against
    0.320 and the backward 0.259 against 0.336; at 1 x 32768 (128) 1.479 against 1.316 and 1.540
    against 1.340. The backward's rerun, 86 KB either way, always takes the narrow side."""
    return programs > multiprocessors(device)


def _scan_forward(q, k, w, u, aqk, b, docs, v, initial_state, output_final_state, store_states):
    """o, the final state (or None) and, with store_states (backward's rerun), no o but the state
    entering each chunk and the corrections delta = U - W S."""
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    n_chunks = triton.cdiv(seq, CHUNK)
    device = v.device
    tables = w.dtype
    if store_states:
        h = torch.empty(batch, n_chunks, v_heads, k_dim, v_dim, dtype=tables, device=device)
        o = delta = torch.empty(u.shape, dtype=tables, device=device)
    else:
        o = h = delta = torch.empty(batch, seq, v_heads, v_dim, dtype=v.dtype, device=device)
    # The kernel skips what it is not asked to write: unused pointers take a tensor it has anyway.
    final = (
        torch.empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
        if output_final_state
        else o
    )
    grid = (triton.cdiv(v_dim, _block_v(v_dim)), batch, v_heads)
    _chunk_scan_fwd_kernel[grid](
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
        GROUP=v_heads // k_heads,
        CHUNK=CHUNK,
        BLOCK_K=_block(k_dim),
        BLOCK_V=_block_v(v_dim),
        HAS_INITIAL=initial_state is not None,
        STORE_FINAL=output_final_state,
        STORE_STATES=store_states,
        STORE_OUTPUT=not store_states,
        DECAYS_ON_TILES=_decays_on_tiles(math.prod(grid), device),
        num_warps=_SCAN_WARPS,
        num_stages=_SCAN_STAGES,
    )
    if store_states:
        return None, final if output_final_state else None, (h, delta)
    return o, final if output_final_state else None, None


def _scan_backward(q, k, w, aqk, b, docs, do, dfinal, initial_state, h):
    """d delta (for every chunk), dS leaving each chunk (h's layout and dtype) and d initial_state."""
    batch, seq, k_heads = q.shape[:3]
    v_heads, k_dim, v_dim = h.shape[2:]
    device = q.device
    ddelta = torch.empty(batch, seq, v_heads, v_dim, dtype=w.dtype, device=device)
    dh = torch.empty_like(h)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else ddelta
    grid = (triton.cdiv(v_dim, _block_v(v_dim)), batch, v_heads)
    _chunk_scan_bwd_kernel[grid](
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
        GROUP=v_heads // k_heads,
        CHUNK=CHUNK,
        BLOCK_K=_block(k_dim),
        BLOCK_V=_block_v(v_dim),
        HAS_FINAL_GRAD=dfinal is not None,
        STORE_INITIAL_GRAD=initial_state is not None,
        DECAYS_ON_TILES=_decays_on_tiles(math.prod(grid), device),
        num_warps=_SCAN_WARPS,
        num_stages=_SCAN_STAGES,
    )
    return ddelta, dh, dh0 if initial_state is not None else None
