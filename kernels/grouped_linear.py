"""Grouped GEMM over a mixture-of-experts layer's frozen experts: each expert's rows of the input times
that expert's weight. NF4 experts are dequantized a tile at a time inside the GEMM, never a whole expert,
let alone all of them; plain experts ([E, out, in] in a compute dtype) are read as they are.

A mixture-of-experts MLP sorts its tokens by expert; `expert_offsets` (int [E + 1], on the device)
says where each expert's rows start and the last one ends. NF4 experts are quantized one by one
(GroupedNF4Weight: each expert its own bitsandbytes NF4 layout and nested offset, stacked), so each
loads, saves and merges as a per-expert NF4 weight would. Forward y = x W_e^T; backward dx = dy W_e
(the weights are frozen). The program grid is fixed by the row and expert counts, so no host sync
reads the routing and a CUDA graph can capture it: each program finds its expert on the device.
"""

from dataclasses import dataclass

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels.nf4 import (
    BLOCKSIZE,
    NESTED_BLOCKSIZE,
    NF4Weight,
    _tables,
    dequantize_nf4,
    dequantize_nf4_reference,
    quantize_nf4,
)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from qlora_kernels.nf4 import nf4_tile


@dataclass(frozen=True)
class GroupedNF4Weight:
    """E experts' [out, in] weights, each quantized alone, stacked: `packed` uint8 [E, out·in / 2],
    `absmax` [E, blocks] (uint8 codes when double-quantized, `nested_absmax` then fp32 [E, groups]),
    and each expert's nested offset, fp32 [E] on the device (`nested_offset_table`, which the kernel
    reads; 0 without double quantization)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    nested_absmax: torch.Tensor | None
    nested_offset_table: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int = BLOCKSIZE
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def experts(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    @property
    def in_features(self) -> int:
        return self.shape[2]

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @classmethod
    def empty(cls, experts: int, like: NF4Weight) -> "GroupedNF4Weight":
        """Room for `experts` weights laid out as `like`, filled by `put` as a checkpoint streams in, so
        a layer's experts are never held twice."""
        if like.shape[-1] % 2:
            raise ValueError(
                f"grouped NF4 experts need an even number of input features, got {like.shape[-1]}: "
                "a byte's two codes must lie in one row"
            )

        def slots(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.new_empty((experts, *tensor.shape))

        return cls(
            packed=slots(like.packed),
            absmax=slots(like.absmax),
            nested_absmax=None if like.nested_absmax is None else slots(like.nested_absmax),
            nested_offset_table=torch.zeros(experts, dtype=torch.float32, device=like.device),
            shape=torch.Size((experts, *like.shape)),
            dtype=like.dtype,
            blocksize=like.blocksize,
            nested_blocksize=like.nested_blocksize,
        )

    def put(self, index: int, expert: NF4Weight) -> None:
        """Copy expert `index`, quantized alone, into its slot."""
        layout = (self.shape[1:], self.dtype, self.blocksize, self.nested_blocksize, self.double_quant)
        if (
            expert.shape,
            expert.dtype,
            expert.blocksize,
            expert.nested_blocksize,
            expert.double_quant,
        ) != layout:
            raise ValueError(
                "grouped NF4 experts must share shape, dtype, block sizes and double quantization"
            )
        self.packed[index].copy_(expert.packed)
        self.absmax[index].copy_(expert.absmax)
        if self.double_quant:
            self.nested_absmax[index].copy_(expert.nested_absmax)
        self.nested_offset_table[index] = expert.nested_offset

    def expert(self, index: int, offset_on_host: bool = True) -> NF4Weight:
        """Expert `index` as the NF4 weight it was quantized to (views, no copy). Its nested offset is
        read back to the host, as kernels take it, or left a 0-d device tensor for the torch reference's
        arithmetic, which then reads nothing on the host."""
        offset = self.nested_offset_table[index]
        return NF4Weight(
            packed=self.packed[index],
            absmax=self.absmax[index],
            nested_absmax=None if self.nested_absmax is None else self.nested_absmax[index],
            nested_offset=float(offset) if offset_on_host else offset,
            shape=self.shape[1:],
            dtype=self.dtype,
            blocksize=self.blocksize,
            nested_blocksize=self.nested_blocksize,
        )

    @classmethod
    def from_experts(cls, experts: list[NF4Weight]) -> "GroupedNF4Weight":
        grouped = cls.empty(len(experts), experts[0])
        for index, expert in enumerate(experts):
            grouped.put(index, expert)
        return grouped


# A layer's routed experts as the grouped GEMM takes them: NF4, or a plain [E, out, in] tensor.
GroupedWeight = GroupedNF4Weight | torch.Tensor


def quantize_grouped_nf4(weights: torch.Tensor, double_quant: bool = True) -> GroupedNF4Weight:
    """[E, out, in] expert weights to NF4, one expert at a time (a fused 3-D checkpoint tensor, or
    per-expert tensors stacked)."""
    return GroupedNF4Weight.from_experts([quantize_nf4(w, double_quant=double_quant) for w in weights])


def expert_weight(weight: GroupedWeight, index: int, reference: bool = False) -> torch.Tensor:
    """Expert `index`'s dense [out, in] weight in its dtype (through the NF4 reference's plain torch ops
    when `reference`): for the reference, merging and tests, never in a training step."""
    if isinstance(weight, torch.Tensor):
        return weight[index]
    if reference:
        return dequantize_nf4_reference(weight.expert(index, offset_on_host=False))
    return dequantize_nf4(weight.expert(index))


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _shape(weight: GroupedWeight) -> tuple[int, int, int]:
    """(experts, out, in)."""
    experts, out_features, in_features = weight.shape
    return experts, out_features, in_features


def grouped_linear_reference(
    x: torch.Tensor, weight: GroupedWeight, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """Each expert's rows of x [N, in] times its dense weight, transposed: y [N, out]; rows outside every
    expert's range are zero. Every expert multiplies every row and keeps its own, so the routing is
    never read on the host (a CUDA graph captures this too)."""
    experts, out_features, _ = _shape(weight)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    out = x.new_zeros(x.shape[0], out_features)
    for index in range(experts):
        mine = (rows >= expert_offsets[index]) & (rows < expert_offsets[index + 1])
        out = torch.where(mine, x @ expert_weight(weight, index, reference=True).to(x.dtype).T, out)
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _expert_tile(
        weight_ptr,
        absmax_ptr,
        nested_ptr,
        code_ptr,
        dynamic_map_ptr,
        offset,
        w_rows,
        col_start,
        w_out,
        w_in,
        dtype: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
        QUANTIZED: tl.constexpr,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        WHOLE_BLOCKS: tl.constexpr,
        GATHER_CODES: tl.constexpr,
    ):
        """The weight tile [ROWS, WIDTH] at rows `w_rows` and columns from `col_start`, in `dtype`:
        decoded from NF4 when QUANTIZED, else read from the plain weight."""
        if QUANTIZED:
            tile = nf4_tile(
                weight_ptr,
                absmax_ptr,
                nested_ptr,
                code_ptr,
                dynamic_map_ptr,
                offset,
                w_rows,
                col_start,
                w_rows < w_out,
                w_in,
                BLOCKSIZE,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                WHOLE_BLOCKS,
                ROWS,
                WIDTH,
                GATHER_CODES,
            )
        else:
            cols = col_start + tl.arange(0, WIDTH)
            mask = (w_rows < w_out)[:, None] & (cols < w_in)[None, :]
            tile = tl.load(
                weight_ptr + w_rows[:, None].to(tl.int64) * w_in + cols[None, :], mask=mask, other=0.0
            )
        return tile.to(dtype)

    @triton.jit
    def _zero_uncovered_rows(
        out_ptr,
        expert_offsets_ptr,
        n_experts,
        n_rows,
        out_cols,
        out_row_stride,
        spare,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Spare program `spare` (counted from the first past the last tile) zeroes BLOCK_M rows that no
        expert covers: those before the first expert's, then those after the last's. The launcher's
        two extra programs make the spare ones enough for both (each expert adds at most one partial
        tile), so the output needs no zeroed allocation."""
        covered_start = tl.load(expert_offsets_ptr)
        covered_end = tl.load(expert_offsets_ptr + n_experts)
        head_tiles = tl.cdiv(covered_start, BLOCK_M)
        local = tl.arange(0, BLOCK_M)
        in_head = spare < head_tiles
        rows = tl.where(
            in_head, spare * BLOCK_M + local, covered_end + (spare - head_tiles) * BLOCK_M + local
        )
        row_mask = tl.where(in_head, rows < covered_start, rows < n_rows)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < out_cols)[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :], zeros, mask=mask)

    @triton.jit
    def _grouped_matmul_kernel(
        a_ptr,
        weight_ptr,
        absmax_ptr,
        nested_ptr,
        offset_table_ptr,
        code_ptr,
        dynamic_map_ptr,
        expert_offsets_ptr,
        tile_starts_ptr,
        out_ptr,
        n_experts,
        n_rows,
        inner,
        out_cols,
        w_out,
        w_in,
        a_row_stride,
        out_row_stride,
        weight_expert_stride,
        absmax_expert_stride,
        nested_expert_stride,
        TRANSPOSED: tl.constexpr,
        QUANTIZED: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        WHOLE_BLOCKS: tl.constexpr,
        GATHER_CODES: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        """One program: BLOCK_M rows of one expert times BLOCK_N output columns. Its expert is the
        last whose first row tile (tile_starts, exclusive sums of each expert's tiles) is at or
        before the program's; programs past the last tile zero the rows no expert covers (unless
        ACCUMULATE) and return. out = a W_e^T, or with TRANSPOSED (backward's dx = dy W_e) a W_e;
        ACCUMULATE adds it to what out holds."""
        tile = tl.program_id(0)
        experts = tl.arange(0, BLOCK_E)
        starts = tl.load(tile_starts_ptr + experts, mask=experts < n_experts, other=2**30)
        expert = tl.sum((starts <= tile).to(tl.int32)) - 1
        n_tiles = tl.load(tile_starts_ptr + n_experts)
        if tile >= n_tiles:
            if not ACCUMULATE:
                _zero_uncovered_rows(
                    out_ptr,
                    expert_offsets_ptr,
                    n_experts,
                    n_rows,
                    out_cols,
                    out_row_stride,
                    tile - n_tiles,
                    BLOCK_M,
                    BLOCK_N,
                )
            return
        first_row = tl.load(expert_offsets_ptr + expert)
        end_row = tl.load(expert_offsets_ptr + expert + 1)
        rows = first_row + (tile - tl.load(tile_starts_ptr + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        weight_ptr += expert.to(tl.int64) * weight_expert_stride
        absmax_ptr += expert.to(tl.int64) * absmax_expert_stride
        nested_ptr += expert.to(tl.int64) * nested_expert_stride
        offset = 0.0
        if QUANTIZED:
            offset = tl.load(offset_table_ptr + expert)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, inner, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + rows[:, None].to(tl.int64) * a_row_stride + ks[None, :],
                mask=row_mask[:, None] & (ks < inner)[None, :],
                other=0.0,
            )
            if TRANSPOSED:
                w = _expert_tile(
                    weight_ptr,
                    absmax_ptr,
                    nested_ptr,
                    code_ptr,
                    dynamic_map_ptr,
                    offset,
                    ks,
                    tl.program_id(1) * BLOCK_N,
                    w_out,
                    w_in,
                    a.dtype,
                    BLOCK_K,
                    BLOCK_N,
                    QUANTIZED,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                    WHOLE_BLOCKS,
                    GATHER_CODES,
                )
                acc += tl.dot(a, w)
            else:
                w = _expert_tile(
                    weight_ptr,
                    absmax_ptr,
                    nested_ptr,
                    code_ptr,
                    dynamic_map_ptr,
                    offset,
                    cols,
                    k_start,
                    w_out,
                    w_in,
                    a.dtype,
                    BLOCK_N,
                    BLOCK_K,
                    QUANTIZED,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                    WHOLE_BLOCKS,
                    GATHER_CODES,
                )
                acc += tl.dot(a, tl.trans(w))
        mask = row_mask[:, None] & (cols < out_cols)[None, :]
        out_at = out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :]
        if ACCUMULATE:
            acc += tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

# A program's output columns and inner step: with rows of whole quantization blocks, the inner step
# and the backward's output columns are whole blocks too.
_BLOCK_N = 128
_BLOCK_K = 64
# (rows of one expert a program takes, warps, stages) for plain and NF4 experts. Plain tiles stream
# in through two stages at 8 warps. An NF4 tile is decoded once for every program that multiplies
# it, so 128 rows a program decode half as often as 64: 1.122 -> 1.009 ms (gate/up forward) and
# 0.628 -> 0.584 (down) at 35B-A3B, 1.495 -> 1.274 and 0.869 -> 0.711 at 30B-A3B on the H200
# (benchmarks.grouped_nf4, 2026-12-04); 8 warps or wider or deeper tiles lost beside it.
# NF4 codes are picked from the 16 values (nf4.py's nf4_code_values, GATHER). Loading each code's
# value instead made a pipelined stage copy every such load into shared memory ahead, one value at a
# time (13.17 against 1.11 ms at one stage, gate/up forward, 2026-12-03). With the gather the loop
# loads no value per weight, only the rows, the bytes and the blocks' absmaxes (with double
# quantization, their codes' values from the dynamic map), so the stages prefetch only those and one
# tile's decode runs beside the previous tiles' products. Three stages against two, H100, one call
# (benchmarks.grouped_nf4 --variant stages=3, 2026-12-05), forward and input gradient: 35B-A3B gate/up
# 0.886 -> 0.733 and 1.012 -> 0.840 ms, down 0.524 -> 0.459 and 0.492 -> 0.414; 30B-A3B gate/up
# 1.108 -> 0.929 and 1.224 -> 1.010, down 0.626 -> 0.544 and 0.623 -> 0.518. Four stages, 8 warps,
# 64 rows and the per-load codes at one stage (gather=0,stages=1) each lost beside it; compute-sanitizer found no access
# out of bounds at three.
_PLAIN_ROWS, _PLAIN_WARPS, _PLAIN_STAGES = 64, 8, 2
_NF4_ROWS, _NF4_WARPS, _NF4_STAGES = 128, 4, 3
_NF4_GATHER_CODES = True


def _grouped_matmul(
    a: torch.Tensor,
    weight: GroupedWeight,
    expert_offsets: torch.Tensor,
    transposed: bool,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """a [N, inner] (rows may be strided) by each expert's weight: [N, in] if transposed, else [N, out];
    rows outside every expert's range are zero. Into `out` (a view whose rows may be strided) when
    given, all of it written, or added to what it holds with `accumulate`."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    experts, w_out, w_in = _shape(weight)
    inner, out_cols = (w_out, w_in) if transposed else (w_in, w_out)
    quantized = isinstance(weight, GroupedNF4Weight)
    block_n, block_k = _BLOCK_N, _BLOCK_K
    if quantized:
        tensors = (
            weight.packed,
            weight.absmax,
            weight.nested_absmax if weight.double_quant else weight.absmax,
        )
        offset_table, blocksize, nested_blocksize = (
            weight.nested_offset_table,
            weight.blocksize,
            weight.nested_blocksize,
        )
        whole_blocks = w_in % blocksize == 0
        if whole_blocks:
            # The weight tile's width is whole quantization blocks: the output columns when
            # transposed, else the inner step.
            block_n, block_k = (
                (max(blocksize, block_n), block_k) if transposed else (block_n, max(blocksize, block_k))
            )
    else:
        weight = weight.contiguous()
        tensors, offset_table = (weight, weight, weight), weight
        blocksize, nested_blocksize, whole_blocks = BLOCKSIZE, NESTED_BLOCKSIZE, False
    block_m, warps, stages = (
        (_NF4_ROWS, _NF4_WARPS, _NF4_STAGES) if quantized else (_PLAIN_ROWS, _PLAIN_WARPS, _PLAIN_STAGES)
    )
    tiles = (expert_offsets[1:] - expert_offsets[:-1] + block_m - 1) // block_m
    tile_starts = torch.zeros(experts + 1, dtype=torch.int32, device=a.device)
    torch.cumsum(tiles, 0, out=tile_starts[1:])
    if out is None:
        out = torch.empty(a.shape[0], out_cols, dtype=a.dtype, device=a.device)
    code, _, dynamic_map = _tables(a.device)
    # Every expert's tiles, and spare programs that zero the rows no expert covers (_zero_uncovered_rows).
    grid = (triton.cdiv(a.shape[0], block_m) + experts + 2, triton.cdiv(out_cols, block_n))
    _grouped_matmul_kernel[grid](
        a,
        *tensors,
        offset_table,
        code,
        dynamic_map,
        expert_offsets,
        tile_starts,
        out,
        experts,
        a.shape[0],
        inner,
        out_cols,
        w_out,
        w_in,
        a.stride(0),
        out.stride(0),
        *(tensor.stride(0) for tensor in tensors),
        TRANSPOSED=transposed,
        QUANTIZED=quantized,
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCKSIZE=blocksize,
        NESTED_BLOCKSIZE=nested_blocksize,
        DOUBLE_QUANT=quantized and weight.double_quant,
        WHOLE_BLOCKS=whole_blocks,
        GATHER_CODES=_NF4_GATHER_CODES,
        ACCUMULATE=accumulate,
        num_warps=warps,
        num_stages=stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class GroupedLinearFunction(torch.autograd.Function):
    """Saves the offsets alone: backward runs the same grouped GEMM against the weight, untransposed."""

    @staticmethod
    def forward(ctx, x, weight: GroupedWeight, expert_offsets):
        ctx.weight = weight
        ctx.save_for_backward(expert_offsets)
        return _grouped_matmul(x, weight, expert_offsets, transposed=False)

    @staticmethod
    def backward(ctx, dy):
        (expert_offsets,) = ctx.saved_tensors
        return _grouped_matmul(dy, ctx.weight, expert_offsets, transposed=True), None, None


class GroupedPairFunction(torch.autograd.Function):
    """Two weights' products of the same rows written side by side, [first | second]; backward adds
    both input gradients in one buffer (the second GEMM accumulates into the first's output)."""

    @staticmethod
    def forward(ctx, x, first: GroupedWeight, second: GroupedWeight, expert_offsets):
        ctx.weights = first, second
        ctx.save_for_backward(expert_offsets)
        split = _shape(first)[1]
        out = torch.empty(x.shape[0], split + _shape(second)[1], dtype=x.dtype, device=x.device)
        _grouped_matmul(x, first, expert_offsets, transposed=False, out=out[:, :split])
        _grouped_matmul(x, second, expert_offsets, transposed=False, out=out[:, split:])
        return out

    @staticmethod
    def backward(ctx, dy):
        (expert_offsets,) = ctx.saved_tensors
        first, second = ctx.weights
        split = _shape(first)[1]
        dx = _grouped_matmul(dy[:, :split], first, expert_offsets, transposed=True)
        _grouped_matmul(dy[:, split:], second, expert_offsets, transposed=True, out=dx, accumulate=True)
        return dx, None, None, None


# ---------------------------------------------------------------------------------------------
# Public
# ---------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: GroupedWeight, expert_offsets: torch.Tensor) -> None:
    experts, _, in_features = _shape(weight)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [rows, {in_features}], got {tuple(x.shape)}")
    if expert_offsets.shape != (experts + 1,) or expert_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"expert_offsets must be int [{experts + 1}], got {expert_offsets.dtype} {tuple(expert_offsets.shape)}"
        )


def grouped_linear(x: torch.Tensor, weight: GroupedWeight, expert_offsets: torch.Tensor) -> torch.Tensor:
    """y [N, out]: rows expert_offsets[e] to expert_offsets[e + 1] of x [N, in] (sorted by expert)
    times expert e's weight, transposed; rows no expert covers are zero. Differentiable in x."""
    _check(x, weight, expert_offsets)
    if use_triton(x):
        return GroupedLinearFunction.apply(x, weight, expert_offsets)
    return grouped_linear_reference(x, weight, expert_offsets)


def grouped_linear_pair(
    x: torch.Tensor, first: GroupedWeight, second: GroupedWeight, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """[grouped_linear(x, first) | grouped_linear(x, second)] (a MoE's gate and up, which SwiGLU reads
    side by side), written in place and differentiated in x with one input-gradient buffer."""
    _check(x, first, expert_offsets)
    _check(x, second, expert_offsets)
    if use_triton(x):
        return GroupedPairFunction.apply(x, first, second, expert_offsets)
    return torch.cat(
        [
            grouped_linear_reference(x, first, expert_offsets),
            grouped_linear_reference(x, second, expert_offsets),
        ],
        -1,
    )


def dequantize_grouped_nf4(weight: GroupedNF4Weight) -> torch.Tensor:
    """All experts at once, [E, out, in]: for merging and tests, never in a training step."""
    return torch.stack([expert_weight(weight, index) for index in range(weight.experts)])
