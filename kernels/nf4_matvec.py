"""Decode-time projections: a few rows of activations times frozen NF4 (or plain) weights.

    y = concat_p( x @ dequant(W_p)^T + bias_p )        x: [M, K], M the rows of a decode step

At batch 1 a step multiplies one row by every weight once, so the time is the time to read the
weights. Dequantizing a whole matrix first (kernels.nf4) also writes it at bf16 and reads it
back, nine times the bytes of the codes alone; the Triton kernel here decodes the codes and their
block absmaxes (double-quantized or plain fp32) in registers, tile by tile, and multiplies them
straight into fp32 accumulators.

Several rows take kernels.nf4's dequantize and a cuBLAS matmul instead. Decoding the codes in
registers costs a table read per value; with tl.dot over rows padded to 16 that made the kernel
6x slower than dequantize + matmul at 16 rows on an H200, whatever the rows (benchmarks/RESULTS.md).

Numerics: each weight value is code * absmax in fp32, products are summed in fp32 and the result
is cast to x.dtype once, after the bias. The reference, and the several-row path, round the
weight to x.dtype first, as `x @ dequantize_nf4(W).T` does; the kernel keeps it in fp32 (fewer
instructions, and no less accurate), so there a bf16 result can differ from the reference by the
weights' bf16 rounding.

Each program owns a tile of output features (N) of one row and walks its share of K; when the N
tiles alone would leave the GPU idle (k/v, or o/down whose N is small), K is split across
programs that write fp32 partial sums, and a second small kernel adds them in a fixed order (no
atomics, so a decode is repeatable). Weights of a group (q/k/v, gate/up) run one launch each,
writing their column slice of one output.

There is no autograd Function: decoding is inference only, nothing flows back through here.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, multiprocessors, use_triton
from qlora_kernels.formats import FrozenWeight, frozen_format
from qlora_kernels.nf4 import NF4Weight, _tables

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from qlora_kernels.nf4 import (
        decode_nested_absmax,
        nf4_tile,
        tile_blocks,
    )


# ----------------------------------------------------------------------------- reference


def _biases_or_none(
    biases: Sequence[torch.Tensor | None] | None, count: int
) -> Sequence[torch.Tensor | None]:
    return [None] * count if biases is None else biases


def nf4_matvec_reference(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None] | None,
) -> torch.Tensor:
    """[M, K] x P weights [N_p, K] -> [M, sum N_p] in x.dtype, weights in x.dtype, fp32 sums."""
    outputs = []
    for weight, bias in zip(weights, _biases_or_none(biases, len(weights)), strict=True):
        weight = frozen_format(weight).dequantize_reference(weight, x.dtype)
        y = x.float() @ weight.float().T
        if bias is not None:
            y = y + bias.float()
        outputs.append(y.to(x.dtype))
    return torch.cat(outputs, dim=-1)


# ----------------------------------------------------------------------------- Triton kernels


# Defined only where triton is installed; without it use_triton() is False and the reference runs.
if TRITON_AVAILABLE:

    @triton.jit
    def _fetch_blocks(
        packed_ptr,
        absmax_ptr,
        nested_ptr,
        x_ptr,
        rows,
        k_start,
        k_end,
        row_mask,
        K,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The raw bytes of a tile of whole blocks and of its x slice, nothing computed from them:
        issued a step ahead of their use, they are in flight while the previous tile computes."""
        blocks, mask = tile_blocks(rows, k_start, row_mask, K, k_end, BLOCKSIZE, BLOCK_K)
        byte_offsets = blocks[:, :, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, None, :]
        packed = tl.load(packed_ptr + byte_offsets, mask=mask[:, :, None], other=0)
        if DOUBLE_QUANT:
            absmax = tl.load(absmax_ptr + blocks, mask=mask, other=0)
            nested = tl.load(nested_ptr + blocks // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        else:
            absmax = tl.load(absmax_ptr + blocks, mask=mask, other=0.0)
            nested = absmax
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + ks, mask=ks < k_end, other=0.0)
        return packed, absmax, nested, x

    @triton.jit
    def _blocks_dot_x(
        packed,
        absmax,
        nested,
        x,
        code_ptr,
        dynamic_map_ptr,
        offset,
        BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One x row against a fetched tile of whole blocks: [rows, blocks] of absmax * sum(code * x).

        The absmax multiplies once per block instead of once per value, and the codes meet x's
        even and odd values straight from the nibbles, unshuffled: per value one nibble, one
        table read and one fma, which keeps batch 1 bound by memory, not by instructions.
        """
        if DOUBLE_QUANT:
            absmax = decode_nested_absmax(absmax, nested, dynamic_map_ptr, offset)
        packed = packed.to(tl.int32)
        x_high, x_low = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_K // BLOCKSIZE, BLOCKSIZE // 2, 2)))
        high = tl.load(code_ptr + (packed >> 4)) * x_high[None, :, :]
        sums = tl.sum(high + tl.load(code_ptr + (packed & 0xF)) * x_low[None, :, :], axis=2)
        return sums * absmax

    @triton.jit
    def _nf4_matvec_kernel(
        x_ptr,
        weight_ptr,
        absmax_ptr,
        nested_ptr,
        code_ptr,
        dynamic_map_ptr,
        bias_ptr,
        out_ptr,
        offset,
        N,
        K,
        weight_row_stride,
        out_split_stride,
        k_per_split,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        PLAIN: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """out[split, n] = sum over this split's K of x[k] * W[n, k] (+ bias in split 0).

        Grid: (N tiles, K splits). Sums in fp32 lanes with the weights in fp32: per block
        with whole blocks (`_blocks_dot_x`), else per value.
        """
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        k_begin = pid_k * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        BLOCK_SUMS: tl.constexpr = ALIGNED and not PLAIN
        if BLOCK_SUMS:
            sums = tl.zeros([BLOCK_N, BLOCK_K // BLOCKSIZE], dtype=tl.float32)
        else:
            row_sums = tl.zeros([BLOCK_N], dtype=tl.float32)
        if BLOCK_SUMS:
            # The next tile's bytes are fetched before this one computes (a software pipeline by
            # hand: Triton pipelines only loops with tl.dot by itself, and for this one it would
            # also stage the code-table reads through shared memory).
            fetched = _fetch_blocks(
                weight_ptr,
                absmax_ptr,
                nested_ptr,
                x_ptr,
                rows,
                k_begin,
                k_end,
                row_mask,
                K,
                BLOCKSIZE,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                BLOCK_K,
            )
        for k_start in range(k_begin, k_end, BLOCK_K):
            if BLOCK_SUMS:
                packed, absmax, nested, x = fetched
                fetched = _fetch_blocks(
                    weight_ptr,
                    absmax_ptr,
                    nested_ptr,
                    x_ptr,
                    rows,
                    k_start + BLOCK_K,
                    k_end,
                    row_mask,
                    K,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                    BLOCK_K,
                )
                sums += _blocks_dot_x(
                    packed,
                    absmax,
                    nested,
                    x,
                    code_ptr,
                    dynamic_map_ptr,
                    offset,
                    BLOCKSIZE,
                    DOUBLE_QUANT,
                    BLOCK_K,
                )
            else:
                ks = k_start + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                if PLAIN:
                    w_offsets = rows[:, None] * weight_row_stride + ks[None, :]
                    w_mask = row_mask[:, None] & k_mask[None, :]
                    weights = tl.load(weight_ptr + w_offsets, mask=w_mask, other=0.0).to(tl.float32)
                else:
                    weights = nf4_tile(
                        weight_ptr,
                        absmax_ptr,
                        nested_ptr,
                        code_ptr,
                        dynamic_map_ptr,
                        offset,
                        rows,
                        k_start,
                        row_mask,
                        K,
                        BLOCKSIZE,
                        NESTED_BLOCKSIZE,
                        DOUBLE_QUANT,
                        ALIGNED,
                        BLOCK_N,
                        BLOCK_K,
                        False,
                    )
                x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
                row_sums += tl.sum(weights * x.to(tl.float32)[None, :], axis=1)
        acc = tl.sum(sums, axis=1) if BLOCK_SUMS else row_sums
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            acc += bias * (pid_k == 0).to(tl.float32)
        out_offsets = pid_k * out_split_stride + rows
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _sum_splits_kernel(partial_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """out = sum over splits of partial[split], in split order, cast to out's dtype."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            total += tl.load(partial_ptr + split * numel + offsets, mask=mask, other=0.0)
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class MatvecConfig:
    """Tile sizes of one call. `split_k` None splits K so that no program walks more than
    `k_tiles_per_program` tiles and the narrowest weight still gets `programs_per_sm` programs."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    k_tiles_per_program: int = 4
    split_k: int | None = None


def default_config() -> MatvecConfig:
    """N tiles of 32 rows by 256 values (4 KB of codes a step, fp32 lanes, no tensor cores).

    K is split so that programs walk a few tiles each (with the next tile's bytes fetched while
    one computes) rather than one long program per N tile: bytes in flight come from programs in
    flight, and many shorter programs also leave a smaller last wave."""
    return MatvecConfig(block_n=32, block_k=256, k_tiles_per_program=8)


# Split partial sums (fp32, written and read back once) may cost at most half the bytes of the
# NF4 codes: splits * N * 8 <= N * K / 4.
_PARTIAL_K = 32
_SUM_BLOCK = 1024


def _split_k(config: MatvecConfig, weights: Sequence[FrozenWeight], device) -> tuple[int, int]:
    """(splits, K per split), one split for the whole group (one sum kernel after it): programs of
    at most k_tiles_per_program tiles, and enough of them for the group's narrowest weight to fill
    the GPU (k/v, whose launches are otherwise a few dozen programs), within _PARTIAL_K."""
    k = weights[0].shape[1]
    k_tiles = triton.cdiv(k, config.block_k)
    if config.split_k is not None:
        wanted = config.split_k
    else:
        n_tiles = triton.cdiv(min(w.shape[0] for w in weights), config.block_n)
        wanted = max(
            triton.cdiv(config.programs_per_sm * multiprocessors(device), n_tiles),
            triton.cdiv(k_tiles, config.k_tiles_per_program),
        )
        wanted = min(wanted, max(1, k // _PARTIAL_K))
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(wanted, k_tiles)))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split * config.block_k


def _check_nf4(weight: NF4Weight, index: int) -> None:
    if weight.packed.dtype != torch.uint8 or not weight.packed.is_contiguous():
        raise ValueError(f"weight {index}: NF4Weight.packed must be a contiguous uint8 tensor")
    expected = torch.uint8 if weight.double_quant else torch.float32
    if weight.absmax.dtype != expected:
        raise ValueError(f"weight {index}: NF4Weight.absmax must be {expected}, got {weight.absmax.dtype}")
    if weight.blocksize < 2 or weight.blocksize & (weight.blocksize - 1):
        raise ValueError(f"weight {index}: blocksize must be a power of two >= 2, got {weight.blocksize}")


def _nf4_matvec_triton(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None],
    config: MatvecConfig | None = None,
) -> torch.Tensor:
    """x [1, K] -> [1, sum N] in x.dtype."""
    if x.shape[0] != 1:
        raise ValueError(f"the NF4 GEMV kernel takes one row, got {x.shape[0]}")
    k = x.shape[1]
    config = config or default_config()
    x = x.contiguous()
    splits, k_per_split = _split_k(config, weights, x.device)
    total = sum(w.shape[0] for w in weights)
    out = torch.empty(1, total, dtype=x.dtype, device=x.device)
    partial = out if splits == 1 else torch.empty(splits, 1, total, dtype=torch.float32, device=x.device)
    code, _, dynamic_map = _tables(x.device)
    column = 0
    for index, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        n = weight.shape[0]
        plain = not frozen_format(weight).quantized
        if plain:
            if weight.stride(1) != 1:
                weight = weight.contiguous()
            tensors = (weight, weight, weight)
            offset, blocksize, nested_blocksize, double_quant = 0.0, 2, 2, False
        else:
            _check_nf4(weight, index)
            nested = weight.nested_absmax if weight.double_quant else weight.absmax
            tensors = (weight.packed, weight.absmax, nested)
            offset, blocksize, double_quant = weight.nested_offset, weight.blocksize, weight.double_quant
            nested_blocksize = weight.nested_blocksize
        aligned = not plain and k % blocksize == 0 and config.block_k % blocksize == 0
        grid = (triton.cdiv(n, config.block_n), splits)
        _nf4_matvec_kernel[grid](
            x,
            *tensors,
            code,
            dynamic_map,
            x if bias is None else bias,
            partial[..., column:],
            offset,
            n,
            k,
            weight.stride(0) if plain else 0,
            total if splits > 1 else 0,
            k_per_split,
            BLOCKSIZE=blocksize,
            NESTED_BLOCKSIZE=nested_blocksize,
            PLAIN=plain,
            DOUBLE_QUANT=double_quant,
            ALIGNED=aligned,
            HAS_BIAS=bias is not None,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        column += n
    if splits > 1:
        numel = out.numel()
        _sum_splits_kernel[(triton.cdiv(numel, _SUM_BLOCK),)](
            partial, out, numel, SPLITS=splits, BLOCK=_SUM_BLOCK
        )
    return out


# ----------------------------------------------------------------------------- public


def _plain_matvec(
    x: torch.Tensor, weights: Sequence[FrozenWeight], biases: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Weights in x.dtype through torch's matmul (fp32 accumulation inside it); quantized weights
    are dequantized first, one at a time, so at most one matrix is held at x.dtype."""
    outputs = []
    for weight, bias in zip(weights, biases, strict=True):
        weight = frozen_format(weight).dequantize(weight, x.dtype)
        outputs.append(torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype)))
    return torch.cat(outputs, dim=-1)


def _check_arguments(x: torch.Tensor, weights: Sequence[FrozenWeight], biases) -> None:
    if not weights:
        raise ValueError("nf4_matvec needs at least one weight")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
    for index, weight in enumerate(weights):
        if len(weight.shape) != 2 or weight.shape[1] != x.shape[-1]:
            raise ValueError(f"weight {index} has shape {tuple(weight.shape)}, x has {x.shape[-1]} features")
        bias = None if biases is None else biases[index]
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias {index} has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")


def nf4_matvec(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """x [..., K] times each weight, outputs side by side: [..., sum N_p] in x.dtype.

    One row of a group with a quantized weight takes the Triton kernel when every weight's format
    lets it read the weight as stored. A group with no quantized weight (quantization off) goes to
    torch's matmul (cuBLAS GEMV), which reads plain weights as fast as the kernel could; several
    rows, or a format the kernel cannot read, dequantize and multiply (see the module docstring).
    """
    _check_arguments(x, weights, biases)
    rows = x.reshape(-1, x.shape[-1])
    biases = _biases_or_none(biases, len(weights))
    if rows.shape[0] == 0:
        out = rows.new_empty(0, sum(w.shape[0] for w in weights))
    elif not any(frozen_format(w).quantized for w in weights):
        out = _plain_matvec(rows, weights, biases)
    elif not use_triton(x):
        out = nf4_matvec_reference(rows, weights, biases)
    elif rows.shape[0] == 1 and all(frozen_format(w).reads_in_gemv(w) for w in weights):
        out = _nf4_matvec_triton(rows, weights, biases)
    else:
        out = _plain_matvec(rows, weights, biases)
    return out.reshape(*x.shape[:-1], out.shape[-1])
