"""The output formed chunk-parallel from the states the forward scan stored, so that the scan's
serial loop keeps only the two products the recurrence needs (delta = U - W S and the state's
update) where its programs are too few to hide the output's two more."""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE

from .common import _WARPS, CHUNK, _block

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .common import _chunk_docs, _mma

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _chunk_output_kernel(
        q_ptr,
        aqk_ptr,
        b_ptr,
        docs_ptr,
        h_ptr,
        delta_ptr,
        o_ptr,
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
    ):
        """Per chunk and v-head, over Dv in blocks of BLOCK_V: o = (carry exp(b) Q) S + Aqk delta, from
        the state S entering the chunk and the corrections delta, stored in the tables' dtype: rounded
        as the scan rounds them for its own products, so o comes out as the scan's would (to the bit
        in the interpreter tests)."""
        n = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)
        head = tl.program_id(2)
        start = n * CHUNK
        local = tl.arange(0, CHUNK)
        rows = start + local
        valid = rows < seq
        dims = tl.arange(0, BLOCK_K)
        _, carry, _, _, _ = _chunk_docs(
            docs_ptr + batch * docs_stride_b, rows, start, seq, docs_stride_t, CHUNK
        )
        token_head = (batch * seq + rows) * v_heads + head
        dot = h_ptr.dtype.element_ty
        b = tl.load(b_ptr + token_head, mask=valid, other=0.0)
        q_at = (batch * seq + rows[:, None]) * (k_heads * k_dim) + (head // GROUP) * k_dim + dims[None, :]
        q = tl.load(q_ptr + q_at, mask=valid[:, None] & (dims < k_dim)[None, :], other=0.0)
        q = (q * tl.where(carry, tl.exp(b), 0.0)[:, None]).to(dot)
        aqk = tl.load(aqk_ptr + token_head[:, None] * CHUNK + local[None, :], mask=valid[:, None], other=0.0)
        state_base = ((batch * tl.cdiv(seq, CHUNK) + n) * v_heads + head) * (k_dim * v_dim)
        for v_start in range(0, v_dim, BLOCK_V):
            v_cols = v_start + tl.arange(0, BLOCK_V)
            state_mask = (dims < k_dim)[:, None] & (v_cols < v_dim)[None, :]
            s = tl.load(
                h_ptr + state_base + dims[:, None] * v_dim + v_cols[None, :], mask=state_mask, other=0.0
            )
            v_mask = valid[:, None] & (v_cols < v_dim)[None, :]
            v_at = token_head[:, None] * v_dim + v_cols[None, :]
            delta = tl.load(delta_ptr + v_at, mask=v_mask, other=0.0)
            o = _mma(q, s, dot) + _mma(aqk, delta, dot)
            tl.store(o_ptr + v_at, o.to(o_ptr.dtype.element_ty), mask=v_mask)


# Dv columns a program forms at once: the [Dk, 64] state slice and [64, 64] corrections beside the
# chunk's queries, as the backward's chunk-parallel state pass reads them.
_OUTPUT_BLOCK = 64


def _chunk_output(q, aqk, b, docs, h, delta, dtype: torch.dtype) -> torch.Tensor:
    """o [B, T, Hv, Dv] in `dtype` from the normalised q, the chunks' Aqk and log-decay b, and what the
    forward scan stored with store_states: the state entering each chunk and the corrections."""
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = delta.shape[2:]
    o = torch.empty(batch, seq, v_heads, v_dim, dtype=dtype, device=q.device)
    _chunk_output_kernel[(triton.cdiv(seq, CHUNK), batch, v_heads)](
        q,
        aqk,
        b,
        docs,
        h,
        delta,
        o,
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
        BLOCK_V=min(_OUTPUT_BLOCK, _block(v_dim)),
        num_warps=_WARPS,
    )
    return o
