"""FP8 (e4m3) products with frozen NF4 weights, for the FP8 tensor cores of Ada and Hopper GPUs.

The two products of a frozen projection that read its weight, y = x @ W^T and dX = dY @ W, run
as rowwise-scaled FP8 GEMMs (torch._scaled_mm): the left operand (activations, or the incoming
gradient) is quantized per row, one fp32 scale a token, and W goes from NF4 straight to e4m3,
with one scale per output channel for the forward and one per input channel for the input
gradient: the only layouts in which rowwise scaling keeps the scales outside the sum. LoRA, its
gradients and everything outside the frozen products stay in the compute dtype (kernels.linear).

The weight scales come from NF4's block absmaxes: a block's largest value is stored as the code
+-1, so a row's largest dequantized magnitude is its largest block absmax, known without a pass
over the weight. They are computed once, when the weights load (`fp8_scales`). Every scale maps
the largest magnitude it covers to e4m3's largest finite value, 448.

Rounding: values are multiplied by the reciprocal of their scale (the same fp32 products in the
kernels and the references, so both give the same bytes), clamped to +-448 and rounded to the
nearest e4m3. With three mantissa bits each operand then carries a relative error of at most 2^-4
in e4m3's normal range, from which the tests derive their tolerance.

There is no autograd Function here: the weights are frozen and kernels.linear's Functions call
these products from their forward and backward.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, interpreting, use_triton
from qlora_kernels.formats import frozen_format
from qlora_kernels.nf4 import NF4Weight, _tables, dequantize_absmax_reference, dequantize_nf4_reference

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from qlora_kernels.nf4 import decode_nf4_bytes, load_block_absmax

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SMALLEST_SCALE = 2.0**-120
# cuBLAS's FP8 GEMMs take inner and output sizes in multiples of 16.
GEMM_MULTIPLE = 16


@dataclass(frozen=True)
class FP8Scales:
    """e4m3 scales of a projection group's weights stacked as [sum(out), in], fp32, and their
    reciprocals, which the quantizers multiply by.

    `row` [sum(out)] is each output channel's (the forward's weight scale); `column` [in] each
    input channel's across every stacked row (the input gradient's weight scale).
    """

    row: torch.Tensor
    column: torch.Tensor
    row_inverse: torch.Tensor
    column_inverse: torch.Tensor


def _scale_of(largest: torch.Tensor) -> torch.Tensor:
    """largest * (1 / 448), a product (the kernels form the same one; a division by a constant is
    not the same on every device), and at least 2^-120: the reciprocal the quantizers multiply by
    stays finite for a row of zeros or of values near fp32's smallest normal one, which then round
    to e4m3's subnormal steps, off by at most 2^-130."""
    return torch.clamp_min(largest * (1.0 / E4M3_MAX), SMALLEST_SCALE)


def fp8_shape_error(weights: Sequence[object]) -> str | None:
    """Why a group's weights cannot take FP8 products, or None."""
    in_features = weights[0].shape[1]
    rows = sum(w.shape[0] for w in weights)
    for weight in weights:
        if error := frozen_format(weight).fp8_problem(weight, in_features):
            return error
    if in_features % GEMM_MULTIPLE or rows % GEMM_MULTIPLE:
        return f"FP8 GEMMs need sizes in multiples of {GEMM_MULTIPLE}, this group is {rows} x {in_features}"
    return None


def fp8_scales(weights: Sequence[NF4Weight]) -> FP8Scales:
    """The row and column scales of weights that share one input, from their block absmaxes."""
    if error := fp8_shape_error(weights):
        raise ValueError(error)
    in_features = weights[0].shape[1]
    row_largest, column_largest = [], []
    for weight in weights:
        blocks = dequantize_absmax_reference(weight).view(weight.shape[0], in_features // weight.blocksize)
        row_largest.append(blocks.amax(dim=1))
        column_largest.append(blocks.amax(dim=0).repeat_interleave(weight.blocksize))
    row = _scale_of(torch.cat(row_largest))
    column = _scale_of(torch.stack(column_largest).amax(dim=0))
    return FP8Scales(row, column, 1.0 / row, 1.0 / column)


# ----------------------------------------------------------------------------- reference


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M]) with x ~= q * scale[:, None]."""
    values = x.float()
    scale = _scale_of(values.abs().amax(dim=1))
    return _to_e4m3(values * (1.0 / scale)[:, None]), scale


def nf4_to_e4m3_reference(
    weights: Sequence[NF4Weight], scales: FP8Scales, *, transposed: bool
) -> torch.Tensor:
    """The stacked weights in e4m3: [sum(out), in] over the row scales, or, transposed,
    [in, sum(out)] over the column scales."""
    stacked = torch.cat([dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights])
    if transposed:
        return _to_e4m3(stacked * scales.column_inverse[None, :]).T.contiguous()
    return _to_e4m3(stacked * scales.row_inverse[:, None])


def scaled_matmul_reference(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """(a * a_scale[:, None]) @ (b * b_scale[:, None])^T in fp32, for a [M, K] and b [N, K]:
    what a rowwise-scaled FP8 GEMM computes, up to the order of its sums."""
    return (a.float() * a_scale[:, None]) @ (b.float() * b_scale[:, None]).T


# ----------------------------------------------------------------------------- Triton kernels


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _to_e4m3_tile(scaled, ROUND_FIRST: tl.constexpr):
        """Clamped to +-448 and cast to e4m3, rounding to nearest even. GPUs round in the cast; Triton's
        interpreter rounds wrongly next to a power of two, so there (ROUND_FIRST) the value is first
        rounded to e4m3's grid in fp32, and the cast is exact."""
        scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
        if ROUND_FIRST:
            bits = scaled.to(tl.int32, bitcast=True)
            # Normal range: keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent.
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)
            # Below 2^-6 e4m3 is subnormal, in steps of 2^-9: adding 1.5 * 2^23 to the magnitude rounds
            # it to a whole step, and the sign bit goes back on (a tiny negative value becomes -0).
            magnitude = tl.abs(scaled)
            steps = ((magnitude * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
            sign = bits & -2147483648
            subnormal = (steps.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            scaled = tl.where(magnitude < 0.015625, subnormal, normal)
        return scaled.to(tl.float8e4nv)

    @triton.jit
    def _row_scale(row_largest):
        return tl.maximum(row_largest * (1.0 / 448.0), 7.52316384526264e-37)  # SMALLEST_SCALE

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        columns,
        x_row_stride,
        BLOCK: tl.constexpr,
        WHOLE_ROW: tl.constexpr,
        ROUND_FIRST: tl.constexpr,
    ):
        """One program per row: its largest magnitude, then the row times its scale's reciprocal.
        A row of at most BLOCK values (WHOLE_ROW) is read once and kept; a longer one is read twice."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        q_row = q_ptr + row * columns
        if WHOLE_ROW:
            offsets = tl.arange(0, BLOCK)
            mask = offsets < columns
            values = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
            scale = _row_scale(tl.max(tl.abs(values), axis=0))
            tl.store(scale_ptr + row, scale)
            inverse = tl.math.div_rn(1.0, scale)
            tl.store(q_row + offsets, _to_e4m3_tile(values * inverse, ROUND_FIRST), mask=mask)
        else:
            largest = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, columns, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                values = tl.load(x_row + offsets, mask=offsets < columns, other=0.0).to(tl.float32)
                largest = tl.maximum(largest, tl.abs(values))
            scale = _row_scale(tl.max(largest, axis=0))
            tl.store(scale_ptr + row, scale)
            inverse = tl.math.div_rn(1.0, scale)
            for start in range(0, columns, BLOCK):
                offsets = start + tl.arange(0, BLOCK)
                mask = offsets < columns
                values = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_row + offsets, _to_e4m3_tile(values * inverse, ROUND_FIRST), mask=mask)

    @triton.jit
    def _nf4_to_e4m3_rows_kernel(
        packed_ptr,
        absmax_ptr,
        nested_absmax_ptr,
        code_ptr,
        dynamic_map_ptr,
        inverse_ptr,
        out_ptr,
        offset,
        blocks_total,
        blocks_per_row,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
        ROUND_FIRST: tl.constexpr,
    ):
        """[out, in] in the weight's own order: one row of the tile is one NF4 block, scaled by the
        reciprocal of its output channel's scale."""
        blocks = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        mask = blocks < blocks_total
        absmax = load_block_absmax(
            absmax_ptr,
            nested_absmax_ptr,
            dynamic_map_ptr,
            offset,
            blocks,
            mask,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        inverse = tl.load(inverse_ptr + blocks // blocks_per_row, mask=mask, other=0.0)[:, None]
        byte_offsets = blocks[:, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, :]
        packed = tl.load(packed_ptr + byte_offsets, mask=mask[:, None], other=0).to(tl.int32)
        values = decode_nf4_bytes(packed, absmax[:, None], code_ptr, False) * inverse
        offsets = blocks[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
        tl.store(out_ptr + offsets, _to_e4m3_tile(values, ROUND_FIRST), mask=mask[:, None])

    @triton.jit
    def _nf4_to_e4m3_columns_kernel(
        packed_ptr,
        absmax_ptr,
        nested_absmax_ptr,
        code_ptr,
        dynamic_map_ptr,
        inverse_ptr,
        out_ptr,
        offset,
        rows,
        blocks_per_row,
        out_row_stride,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
        ROUND_FIRST: tl.constexpr,
    ):
        """[in, out]: a tile of ROWS_PER_PROGRAM rows by BLOCKS_PER_PROGRAM blocks of each, stored
        transposed, so that each input channel gets ROWS_PER_PROGRAM consecutive bytes; scaled by the
        reciprocal of its input channel's scale."""
        row = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        block_column = tl.program_id(1) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        row_mask = row < rows
        mask = row_mask[:, None] & (block_column < blocks_per_row)[None, :]
        blocks = row[:, None] * blocks_per_row + block_column[None, :]
        absmax = load_block_absmax(
            absmax_ptr,
            nested_absmax_ptr,
            dynamic_map_ptr,
            offset,
            blocks,
            mask,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        half = tl.arange(0, BLOCKSIZE // 2)[None, None, :]
        packed = tl.load(
            packed_ptr + blocks[:, :, None] * (BLOCKSIZE // 2) + half, mask=mask[:, :, None], other=0
        )
        packed = packed.to(tl.int32)
        values = tl.reshape(
            decode_nf4_bytes(packed, absmax[:, :, None], code_ptr, False),
            (ROWS_PER_PROGRAM, BLOCKS_PER_PROGRAM * BLOCKSIZE),
        )
        columns = tl.program_id(1).to(tl.int64) * (BLOCKS_PER_PROGRAM * BLOCKSIZE) + tl.arange(
            0, BLOCKS_PER_PROGRAM * BLOCKSIZE
        )
        column_mask = columns < blocks_per_row * BLOCKSIZE
        inverse = tl.load(inverse_ptr + columns, mask=column_mask, other=0.0)[None, :]
        destinations = columns[None, :] * out_row_stride + row[:, None]
        tl.store(
            out_ptr + destinations,
            _to_e4m3_tile(values * inverse, ROUND_FIRST),
            mask=row_mask[:, None] & column_mask[None, :],
        )


# ----------------------------------------------------------------------------- launchers

# Tile sizes timed on an H200 at Qwen2.5-7B's shapes (benchmarks/RESULTS.md): 8192 values a program
# for the forward layout, 128 rows of one block for the transposed one, 4096-value chunks of long rows.
_ROW_BLOCK = 4096
# Rows up to this long (hidden sizes, q/k/v outputs) are held whole and read once.
_WHOLE_ROW = 8192
_ELEMENTS_PER_PROGRAM = 8192
_TRANSPOSED_ROWS = 128
_TRANSPOSED_BLOCKS = 1


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = x.shape
    q = torch.empty(rows, columns, dtype=E4M3, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        whole_row = columns <= _WHOLE_ROW
        block = triton.next_power_of_2(columns) if whole_row else _ROW_BLOCK
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            columns,
            x.stride(0),
            BLOCK=block,
            WHOLE_ROW=whole_row,
            ROUND_FIRST=interpreting(),
            num_warps=8 if block >= 4096 else 4,
        )
    return q, scale


def _nf4_to_e4m3_triton(
    weight: NF4Weight, inverse: torch.Tensor, out: torch.Tensor, transposed: bool
) -> None:
    """`weight` into `out`: its rows of the contiguous stack [sum(out), in], with `inverse` the
    reciprocals of its rows' scales; or, transposed, its columns of [in, sum(out)], with `inverse`
    those of every input channel's scale."""
    code, _, dynamic_map = _tables(weight.device)
    rows, in_features = weight.shape
    blocks_per_row = in_features // weight.blocksize
    tables = (weight.packed, weight.absmax, weight.nested_absmax if weight.double_quant else weight.absmax)
    common = {
        "BLOCKSIZE": weight.blocksize,
        "NESTED_BLOCKSIZE": weight.nested_blocksize,
        "DOUBLE_QUANT": weight.double_quant,
        "ROUND_FIRST": interpreting(),
        # The absmax product and the offset add are rounded separately, as kernels.nf4 does.
        "enable_fp_fusion": False,
    }
    if transposed:
        grid = (triton.cdiv(rows, _TRANSPOSED_ROWS), triton.cdiv(blocks_per_row, _TRANSPOSED_BLOCKS))
        _nf4_to_e4m3_columns_kernel[grid](
            *tables,
            code,
            dynamic_map,
            inverse,
            out,
            weight.nested_offset,
            rows,
            blocks_per_row,
            out.stride(0),
            ROWS_PER_PROGRAM=_TRANSPOSED_ROWS,
            BLOCKS_PER_PROGRAM=_TRANSPOSED_BLOCKS,
            **common,
        )
        return
    per_program = max(1, _ELEMENTS_PER_PROGRAM // weight.blocksize)
    blocks_total = rows * blocks_per_row
    _nf4_to_e4m3_rows_kernel[(triton.cdiv(blocks_total, per_program),)](
        *tables,
        code,
        dynamic_map,
        inverse,
        out,
        weight.nested_offset,
        blocks_total,
        blocks_per_row,
        BLOCKS_PER_PROGRAM=per_program,
        **common,
    )


def _e4m3_scratch(buffer: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A [shape] e4m3 view of the start of `buffer` (any dtype, contiguous), or a new tensor."""
    numel = shape[0] * shape[1]
    if buffer is None:
        return torch.empty(shape, dtype=E4M3, device=device)
    scratch = buffer.reshape(-1).view(torch.uint8)
    if scratch.numel() < numel:
        raise ValueError(f"buffer holds {scratch.numel()} bytes, the e4m3 weights need {numel}")
    return scratch[:numel].view(E4M3).view(shape)


# ----------------------------------------------------------------------------- public


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M]), one scale a row."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if use_triton(x):
        return _quantize_rows_triton(x)
    return quantize_rows_reference(x)


def nf4_to_e4m3(
    weights: Sequence[NF4Weight],
    scales: FP8Scales,
    *,
    transposed: bool,
    buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stacked weights in e4m3 ([sum(out), in], or [in, sum(out)] transposed), written into
    the start of `buffer` (a scratch shared across layers, of any dtype) when one is given."""
    in_features = weights[0].shape[1]
    rows = sum(w.shape[0] for w in weights)
    device = weights[0].device
    if not use_triton(weights[0].packed):
        out = nf4_to_e4m3_reference(weights, scales, transposed=transposed)
        return _e4m3_scratch(buffer, tuple(out.shape), device).copy_(out)
    out = _e4m3_scratch(buffer, (in_features, rows) if transposed else (rows, in_features), device)
    start = 0
    for weight in weights:
        stop = start + weight.shape[0]
        if transposed:
            _nf4_to_e4m3_triton(weight, scales.column_inverse, out[:, start:stop], transposed=True)
        else:
            _nf4_to_e4m3_triton(weight, scales.row_inverse[start:stop], out[start:stop], transposed=False)
        start = stop
    return out


def _scaled_mm(a, a_scale, b, b_scale, out_dtype):
    """a [M, K] @ b[N, K]^T with rowwise scales; b's transpose is the column-major operand cuBLAS takes."""
    return torch._scaled_mm(a, b.T, scale_a=a_scale[:, None], scale_b=b_scale[None, :], out_dtype=out_dtype)


def fp8_linear(
    x: torch.Tensor,
    weights: Sequence[NF4Weight],
    scales: FP8Scales,
    buffer: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) -> [M, sum(out)] in x.dtype, both operands in e4m3."""
    q, x_scale = quantize_rows(x)
    stacked = nf4_to_e4m3(weights, scales, transposed=False, buffer=buffer)
    out = _scaled_mm(q, x_scale, stacked, scales.row, x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_input_grad(
    dy: torch.Tensor, weights: Sequence[NF4Weight], scales: FP8Scales, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """dY [M, sum(out)] @ W -> [M, in] in dy.dtype, both operands in e4m3."""
    q, dy_scale = quantize_rows(dy)
    stacked_t = nf4_to_e4m3(weights, scales, transposed=True, buffer=buffer)
    return _scaled_mm(q, dy_scale, stacked_t, scales.column, dy.dtype)
