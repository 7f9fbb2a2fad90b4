"""Grouped GEMM over NF4 experts: each expert's rows of the input times that expert's frozen NF4 weight,
dequantized a tile at a time inside the GEMM, never a whole expert, let alone all of them.

A mixture-of-experts MLP sorts its tokens by expert; `expert_offsets` (int [E + 1], on the device)
says where each expert's rows start and the last one ends. The experts are quantized one by one
(GroupedNF4Weight: each expert its own bitsandbytes NF4 layout and nested offset, stacked), so each
loads, saves and merges as a per-expert NF4 weight would. Forward y = x W_e^T; backward dx = dy W_e
(the weights are frozen). The program grid is fixed by the row and expert counts, so no host sync
reads the routing and a CUDA graph can capture it: each program finds its expert on the device.
"""

from collections.abc import Sequence
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

    from qlora_kernels.nf4 import decode_nf4_bytes, load_block_absmax


@dataclass(frozen=True)
class GroupedNF4Weight:
    """E experts' [out, in] weights, each quantized alone, stacked: `packed` uint8 [E, out·in / 2],
    `absmax` [E, blocks] (uint8 codes when double-quantized, `nested_absmax` then fp32 [E, groups]),
    and each expert's nested offset as a host float (`nested_offsets`, as NF4Weight keeps it) and
    on the device (`nested_offset_table`, fp32 [E], which the kernel reads)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    nested_absmax: torch.Tensor | None
    nested_offsets: tuple[float, ...]
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

    def expert(self, index: int) -> NF4Weight:
        """Expert `index` as the NF4 weight it was quantized to (views, no copy)."""
        return NF4Weight(
            packed=self.packed[index],
            absmax=self.absmax[index],
            nested_absmax=None if self.nested_absmax is None else self.nested_absmax[index],
            nested_offset=self.nested_offsets[index],
            shape=self.shape[1:],
            dtype=self.dtype,
            blocksize=self.blocksize,
            nested_blocksize=self.nested_blocksize,
        )

    @classmethod
    def from_experts(cls, experts: Sequence[NF4Weight]) -> "GroupedNF4Weight":
        first = experts[0]
        layout = (first.shape, first.dtype, first.blocksize, first.nested_blocksize, first.double_quant)
        for expert in experts:
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
        if first.shape[-1] % first.blocksize:
            raise ValueError(
                f"grouped NF4 experts need rows of whole quantization blocks: {first.shape[-1]} input "
                f"features are not a multiple of {first.blocksize}"
            )
        offsets = tuple(expert.nested_offset for expert in experts)
        return cls(
            packed=torch.stack([expert.packed for expert in experts]),
            absmax=torch.stack([expert.absmax for expert in experts]),
            nested_absmax=torch.stack([e.nested_absmax for e in experts]) if first.double_quant else None,
            nested_offsets=offsets,
            nested_offset_table=torch.tensor(offsets, dtype=torch.float32, device=first.device),
            shape=torch.Size((len(experts), *first.shape)),
            dtype=first.dtype,
            blocksize=first.blocksize,
            nested_blocksize=first.nested_blocksize,
        )


def quantize_grouped_nf4(weights: torch.Tensor, double_quant: bool = True) -> GroupedNF4Weight:
    """[E, out, in] expert weights to NF4, one expert at a time (a fused 3-D checkpoint tensor, or
    per-expert tensors stacked)."""
    return GroupedNF4Weight.from_experts([quantize_nf4(w, double_quant=double_quant) for w in weights])


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def grouped_nf4_linear_reference(
    x: torch.Tensor, weight: GroupedNF4Weight, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """Each expert's rows of x [N, in] times its dequantized weight, transposed: y [N, out]; rows
    outside every expert's range are zero."""
    bounds = expert_offsets.tolist()
    out = x.new_zeros(x.shape[0], weight.out_features)
    pieces = [out[: bounds[0]]]
    for index in range(weight.experts):
        rows = x[bounds[index] : bounds[index + 1]]
        pieces.append(rows @ dequantize_nf4_reference(weight.expert(index)).to(x.dtype).T)
    pieces.append(out[bounds[-1] :])
    return torch.cat(pieces)


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------

# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _weight_tile(
        packed_ptr,
        absmax_ptr,
        nested_ptr,
        code_ptr,
        dynamic_map_ptr,
        offset,
        w_rows,
        col_start,
        w_out,
        w_in,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
    ):
        """One expert's weight rows `w_rows` (ROWS of them), columns [col_start, col_start + WIDTH) in
        whole quantization blocks, in fp32: each block's absmax loaded once and spread over its bytes,
        then decoded; rows and columns past the weight read as zero."""
        pairs = tl.arange(0, WIDTH // 2)
        row_start = w_rows[:, None].to(tl.int64) * w_in + col_start
        mask = (w_rows < w_out)[:, None] & (col_start + 2 * pairs < w_in)[None, :]
        packed = tl.load(packed_ptr + (row_start + 2 * pairs[None, :]) // 2, mask=mask, other=0).to(tl.int32)
        blocks = tl.arange(0, WIDTH // BLOCKSIZE)
        block_mask = (w_rows < w_out)[:, None] & (col_start + blocks * BLOCKSIZE < w_in)[None, :]
        absmax = load_block_absmax(
            absmax_ptr,
            nested_ptr,
            dynamic_map_ptr,
            offset,
            row_start // BLOCKSIZE + blocks[None, :],
            block_mask,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        absmax = tl.where(block_mask, absmax, 0.0)
        per_byte = tl.broadcast_to(absmax[:, :, None], (ROWS, WIDTH // BLOCKSIZE, BLOCKSIZE // 2))
        return decode_nf4_bytes(packed, tl.reshape(per_byte, (ROWS, WIDTH // 2)), code_ptr)

    @triton.jit
    def _grouped_nf4_matmul_kernel(
        a_ptr,
        packed_ptr,
        absmax_ptr,
        nested_ptr,
        offset_table_ptr,
        code_ptr,
        dynamic_map_ptr,
        expert_offsets_ptr,
        tile_starts_ptr,
        out_ptr,
        n_experts,
        inner,
        out_cols,
        w_out,
        w_in,
        a_row_stride,
        packed_expert_stride,
        absmax_expert_stride,
        nested_expert_stride,
        TRANSPOSED: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
    ):
        """One program: BLOCK_M rows of one expert times BLOCK_N output columns. Its expert is the
        last whose first row tile (tile_starts, exclusive sums of each expert's tiles) is at or
        before the program's; programs past the last tile return. out = a W_e^T, or with
        TRANSPOSED (backward's dx = dy W_e) a W_e."""
        tile = tl.program_id(0)
        experts = tl.arange(0, BLOCK_E)
        starts = tl.load(tile_starts_ptr + experts, mask=experts < n_experts, other=2**30)
        expert = tl.sum((starts <= tile).to(tl.int32)) - 1
        if tile >= tl.load(tile_starts_ptr + n_experts):
            return
        first_row = tl.load(expert_offsets_ptr + expert)
        end_row = tl.load(expert_offsets_ptr + expert + 1)
        rows = first_row + (tile - tl.load(tile_starts_ptr + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < end_row
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        packed_ptr += expert.to(tl.int64) * packed_expert_stride
        absmax_ptr += expert.to(tl.int64) * absmax_expert_stride
        nested_ptr += expert.to(tl.int64) * nested_expert_stride
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
                w = _weight_tile(
                    packed_ptr,
                    absmax_ptr,
                    nested_ptr,
                    code_ptr,
                    dynamic_map_ptr,
                    offset,
                    ks,
                    tl.program_id(1) * BLOCK_N,
                    w_out,
                    w_in,
                    BLOCK_K,
                    BLOCK_N,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                )
                acc += tl.dot(a, w.to(a.dtype))
            else:
                w = _weight_tile(
                    packed_ptr,
                    absmax_ptr,
                    nested_ptr,
                    code_ptr,
                    dynamic_map_ptr,
                    offset,
                    cols,
                    k_start,
                    w_out,
                    w_in,
                    BLOCK_N,
                    BLOCK_K,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                )
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
        mask = row_mask[:, None] & (cols < out_cols)[None, :]
        out_at = out_ptr + rows[:, None].to(tl.int64) * out_cols + cols[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

# Rows a program takes of one expert, and its output columns and inner step: the inner step and the
# backward's output columns are whole quantization blocks (64 values).
_BLOCK_M = 64
_BLOCK_N = 128
_BLOCK_K = 64
# ptxas for sm_90 (benchmarks.kernel_resources): 4 warps at 3 stages spill 28 bytes a thread forward;
# 8 warps at 2 stages take 184 and 102 registers (forward, input gradient) and 66 KB of shared memory.
_WARPS = 8
_STAGES = 2


def _grouped_matmul(
    a: torch.Tensor, weight: GroupedNF4Weight, expert_offsets: torch.Tensor, transposed: bool
):
    """a [N, inner] by each expert's weight: out [N, in] if transposed, else [N, out]; rows outside
    every expert's range are zero."""
    a = a.contiguous()
    experts = weight.experts
    if transposed:
        inner, out_cols = weight.out_features, weight.in_features
    else:
        inner, out_cols = weight.in_features, weight.out_features
    # The weight tile's width is whole quantization blocks: the output columns when transposed, else
    # the inner step.
    block_n = max(weight.blocksize, _BLOCK_N) if transposed else _BLOCK_N
    block_k = _BLOCK_K if transposed else max(weight.blocksize, _BLOCK_K)
    tiles = (expert_offsets[1:] - expert_offsets[:-1] + _BLOCK_M - 1) // _BLOCK_M
    tile_starts = torch.zeros(experts + 1, dtype=torch.int32, device=a.device)
    torch.cumsum(tiles, 0, out=tile_starts[1:])
    out = torch.zeros(a.shape[0], out_cols, dtype=a.dtype, device=a.device)
    code, _, dynamic_map = _tables(a.device)
    nested = weight.nested_absmax if weight.double_quant else weight.absmax
    grid = (triton.cdiv(a.shape[0], _BLOCK_M) + experts, triton.cdiv(out_cols, block_n))
    _grouped_nf4_matmul_kernel[grid](
        a,
        weight.packed,
        weight.absmax,
        nested,
        weight.nested_offset_table,
        code,
        dynamic_map,
        expert_offsets,
        tile_starts,
        out,
        experts,
        inner,
        out_cols,
        weight.out_features,
        weight.in_features,
        a.stride(0),
        weight.packed.stride(0),
        weight.absmax.stride(0),
        nested.stride(0),
        TRANSPOSED=transposed,
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCKSIZE=weight.blocksize,
        NESTED_BLOCKSIZE=weight.nested_blocksize,
        DOUBLE_QUANT=weight.double_quant,
        num_warps=_WARPS,
        num_stages=_STAGES,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class GroupedNF4LinearFunction(torch.autograd.Function):
    """Saves the offsets alone: backward runs the same grouped GEMM against the weight, untransposed."""

    @staticmethod
    def forward(ctx, x, weight: GroupedNF4Weight, expert_offsets):
        ctx.weight = weight
        ctx.save_for_backward(expert_offsets)
        return _grouped_matmul(x, weight, expert_offsets, transposed=False)

    @staticmethod
    def backward(ctx, dy):
        (expert_offsets,) = ctx.saved_tensors
        return _grouped_matmul(dy, ctx.weight, expert_offsets, transposed=True), None, None


# ---------------------------------------------------------------------------------------------
# Public
# ---------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: GroupedNF4Weight, expert_offsets: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [rows, {weight.in_features}], got {tuple(x.shape)}")
    if expert_offsets.shape != (weight.experts + 1,) or expert_offsets.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"expert_offsets must be int [{weight.experts + 1}], got {expert_offsets.dtype} {tuple(expert_offsets.shape)}"
        )


def grouped_nf4_linear(
    x: torch.Tensor, weight: GroupedNF4Weight, expert_offsets: torch.Tensor
) -> torch.Tensor:
    """y [N, out]: rows expert_offsets[e] to expert_offsets[e + 1] of x [N, in] (sorted by expert)
    times expert e's weight, transposed; rows no expert covers are zero. Differentiable in x."""
    _check(x, weight, expert_offsets)
    if use_triton(x):
        return GroupedNF4LinearFunction.apply(x, weight, expert_offsets)
    return grouped_nf4_linear_reference(x, weight, expert_offsets)


def dequantize_grouped_nf4(weight: GroupedNF4Weight) -> torch.Tensor:
    """All experts at once, [E, out, in]: for merging and tests, never in a training step."""
    return torch.stack([dequantize_nf4(weight.expert(index)) for index in range(weight.experts)])
