"""What every stage of the chunked delta rule shares: the chunk, the tables' dtype, the tile sizes
and the two Triton helpers each stage calls (the tensor-core product and a chunk's documents)."""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# 64 tokens per chunk: the scan over chunks is T/64 steps long and its products have inner
# dimension 64 (full tensor-core tiles), while the per-chunk T x T-shaped work stays 64 x 64. The
# triangular solve works in four 16-token blocks, the smallest tile tl.dot takes.
CHUNK = 64

# NOTE (tensor cores): for bf16 or fp16 inputs (TENSOR_CORE_DTYPES) the normalised q and k and the
# chunk tables T, W, Aqk, delta, d delta and dW, the states and their gradients are stored in the
# inputs' dtype, and every product of the tables and of the
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


def _table_dtype(v: torch.Tensor) -> torch.dtype:
    """The chunk tables' dtype, which is the tensor-core operand dtype (see TENSOR_CORE_DTYPES)."""
    return v.dtype if v.dtype in TENSOR_CORE_DTYPES else torch.float32


def _block(dim: int) -> int:
    """tl.dot takes tiles of 16 and more; smaller and non-power-of-two head dims are zero-padded."""
    return max(16, triton.next_power_of_2(dim))


# The per-chunk kernels hold several [64, Dk] fp32 tiles at once; 8 warps keep them in registers at 128.
_WARPS = 8

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _mma(a, b, dtype: tl.constexpr):
        """a @ b with operands in dtype (a chunk table's: see TENSOR_CORE_DTYPES), accumulated in fp32."""
        return tl.dot(a.to(dtype), b.to(dtype), input_precision="ieee")

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
