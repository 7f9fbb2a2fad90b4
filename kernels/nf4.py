"""NF4 quantization of frozen weights, bit-compatible with bitsandbytes.

Layout (bitsandbytes' own): the weight is flattened row-major and cut into blocks of `blocksize`
values; each block keeps its absmax and every value the index of the nearest of 16 NormalFloat
codes to value/absmax, two indices per byte, element 2i in the high nibble. With double
quantization the block absmaxes are centred on their mean and stored as 8-bit indices into the
signed dynamic map, in blocks of 256 with an fp32 absmax each.

Rounding follows bitsandbytes' CUDA kernels, so checkpoints quantized here and there agree byte
for byte: a value goes to the upper of two codes only when strictly above their midpoint, and
the 8-bit map uses bitsandbytes' binary search with its midpoint rule. An all-zero block scales
by 1/0 and, as in bitsandbytes' CUDA kernel, lands on code 0 (it dequantizes to zero anyway).

There is no autograd Function here: quantized weights are frozen, nothing flows back into them.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256

# The 16 NormalFloat4 code values of bitsandbytes (QLoRA paper), as fp32.
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
# A value scaled into [-1, 1] takes code i + 1 when strictly above NF4_MIDPOINTS[i].
NF4_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2


def signed_dynamic_map() -> torch.Tensor:
    """bitsandbytes' 8-bit signed dynamic map (7 exponent bits), 256 sorted fp32 values.

    Computed the way bitsandbytes computes it (fp32 linspace means times a power of ten, in
    fp32) so the values match to the bit.
    """
    values = []
    for exponent in range(7):
        edges = torch.linspace(0.1, 1, 2**exponent + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (exponent - 6)
        values += (scale * means).tolist() + (-scale * means).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC_MAP = signed_dynamic_map()


@cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NF4 codes, NF4 midpoints and the dynamic map on `device`, copied there once."""
    return NF4_CODE.to(device), NF4_MIDPOINTS.to(device), DYNAMIC_MAP.to(device)


@dataclass
class NF4Weight:
    """A frozen weight in bitsandbytes' NF4 layout.

    `packed` is uint8 [ceil(numel / 2)]. `absmax` holds uint8 indices into the dynamic map when
    double-quantized (`nested_absmax` is then fp32 [ceil(blocks / nested_blocksize)]), else fp32
    [blocks]. `nested_offset` is a Python float holding the fp32 mean of the block absmaxes (0.0
    without double quantization); a float so kernels take it as a scalar without a device sync.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    nested_absmax: torch.Tensor | None
    nested_offset: float
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int = BLOCKSIZE
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, device: torch.device | str) -> "NF4Weight":
        nested = None if self.nested_absmax is None else self.nested_absmax.to(device)
        return replace(
            self, packed=self.packed.to(device), absmax=self.absmax.to(device), nested_absmax=nested
        )

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors under bitsandbytes' names (`prefix.weight`, `prefix.weight.absmax`, ...)."""
        key = f"{prefix}.weight"
        code, _, dynamic_map = _tables(self.device)
        tensors = {
            key: self.packed.reshape(-1, 1),
            f"{key}.absmax": self.absmax,
            f"{key}.quant_map": code.clone(),
        }
        fields = {
            "quant_type": "nf4",
            "blocksize": self.blocksize,
            "dtype": _dtype_name(self.dtype),
            "shape": list(self.shape),
        }
        if self.double_quant:
            tensors[f"{key}.nested_absmax"] = self.nested_absmax
            tensors[f"{key}.nested_quant_map"] = dynamic_map.clone()
            fields |= {
                "nested_blocksize": self.nested_blocksize,
                "nested_dtype": "float32",
                "nested_offset": self.nested_offset,
            }
        encoded = json.dumps(fields).encode("utf-8")
        tensors[f"{key}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(encoded), dtype=torch.uint8)
        return tensors

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], prefix: str) -> "NF4Weight":
        """Read a weight saved by bitsandbytes (or by `state_dict`) under `prefix`."""
        key = f"{prefix}.weight"
        state_key = f"{key}.quant_state.bitsandbytes__nf4"
        if state_key not in tensors:
            found = [k for k in tensors if k.startswith(f"{key}.quant_state.")]
            raise ValueError(f"{prefix}: expected NF4 quant state {state_key!r}, found {found or 'none'}")
        fields = json.loads(bytes(tensors[state_key].cpu().tolist()).decode("utf-8"))
        if fields.get("quant_type", "nf4") != "nf4":
            raise ValueError(f"{prefix}: quant_type {fields['quant_type']!r} is not supported, only nf4")
        if not torch.equal(tensors[f"{key}.quant_map"].float().cpu(), NF4_CODE):
            raise ValueError(f"{prefix}: quant_map is not bitsandbytes' NF4 table")
        packed = tensors[key].contiguous().reshape(-1)
        if packed.dtype != torch.uint8:
            packed = packed.view(torch.uint8)
        nested_absmax, offset = None, 0.0
        if f"{key}.nested_absmax" in tensors:
            if not torch.equal(tensors[f"{key}.nested_quant_map"].float().cpu(), DYNAMIC_MAP):
                raise ValueError(f"{prefix}: nested_quant_map is not bitsandbytes' dynamic map")
            nested_absmax = tensors[f"{key}.nested_absmax"].float().reshape(-1)
            offset = float(fields["nested_offset"])
        weight = cls(
            packed=packed,
            absmax=tensors[f"{key}.absmax"].reshape(-1),
            nested_absmax=nested_absmax,
            nested_offset=offset,
            shape=torch.Size(fields["shape"]),
            dtype=getattr(torch, fields["dtype"]),
            blocksize=int(fields["blocksize"]),
            nested_blocksize=int(fields.get("nested_blocksize", NESTED_BLOCKSIZE)),
        )
        _check_sizes(weight, prefix)
        return weight


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_sizes(weight: NF4Weight, name: str) -> None:
    blocks = -(-weight.numel // weight.blocksize)
    expected = {"packed": (weight.packed, (weight.numel + 1) // 2), "absmax": (weight.absmax, blocks)}
    if weight.nested_absmax is not None:
        expected["nested_absmax"] = (weight.nested_absmax, -(-blocks // weight.nested_blocksize))
    for field, (tensor, size) in expected.items():
        if tensor.numel() != size:
            raise ValueError(
                f"{name}: {field} has {tensor.numel()} values, shape {tuple(weight.shape)} needs {size}"
            )


# ----------------------------------------------------------------------------- reference


def _blockwise_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """fp32 absmax per block; the last block may be short (padding zeros do not change a max)."""
    pad = -flat.numel() % blocksize
    blocks = torch.nn.functional.pad(flat.float().abs(), (0, pad)).view(-1, blocksize)
    return blocks.amax(dim=1)


def _scale_blockwise(flat: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """value * (1 / absmax) in fp32, as bitsandbytes does (a reciprocal, not a division)."""
    reciprocal = (1.0 / absmax).repeat_interleave(blocksize)[: flat.numel()]
    return flat.float() * reciprocal


def _nearest_nf4(scaled: torch.Tensor) -> torch.Tensor:
    """Index of the nearest NF4 code; at a midpoint the lower code wins; NaN gives 0."""
    _, midpoints, _ = _tables(scaled.device)
    codes = torch.bucketize(scaled, midpoints, out_int32=True)
    return codes.masked_fill_(scaled.isnan(), 0).to(torch.uint8)


def _nearest_dynamic(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' 8-bit nearest-code search: 7 halving steps from index 127, then the
    midpoint test against the last pivots seen on each side."""
    pivot = torch.full(scaled.shape, 127, dtype=torch.int64, device=scaled.device)
    lower_index = torch.zeros_like(pivot)
    upper_index = torch.full_like(pivot, 255)
    for step in (64, 32, 16, 8, 4, 2, 1):
        above = scaled > code[pivot]
        lower_index = torch.where(above, pivot, lower_index)
        upper_index = torch.where(above, upper_index, pivot)
        pivot = torch.where(above, pivot + step, pivot - step)
    value, lower, upper = code[pivot], code[lower_index], code[upper_index]
    above = scaled > value
    take_upper = above & (scaled > (upper + value) * 0.5)
    take_lower = ~above & (scaled < (lower + value) * 0.5)
    return torch.where(take_upper, upper_index, torch.where(take_lower, lower_index, pivot)).to(torch.uint8)


def quantize_absmax_reference(
    absmax: torch.Tensor, nested_blocksize: int = NESTED_BLOCKSIZE
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Double quantization of fp32 block absmaxes: (uint8 codes, nested absmax, offset).

    Plain torch ops on any device; it is small enough that the GPU path runs it too.
    """
    _, _, dynamic_map = _tables(absmax.device)
    offset = absmax.mean()
    centred = absmax - offset
    nested_absmax = _blockwise_absmax(centred, nested_blocksize)
    scaled = _scale_blockwise(centred, nested_absmax, nested_blocksize)
    return _nearest_dynamic(scaled, dynamic_map), nested_absmax, offset.item()


def dequantize_absmax_reference(weight: NF4Weight) -> torch.Tensor:
    """fp32 block absmaxes: nested_code[code] * nested_absmax[block] + offset, in that order."""
    if not weight.double_quant:
        return weight.absmax.float()
    _, _, dynamic_map = _tables(weight.device)
    nested = weight.nested_absmax.repeat_interleave(weight.nested_blocksize)[: weight.absmax.numel()]
    return dynamic_map[weight.absmax.long()] * nested + weight.nested_offset


def quantize_nf4_reference(
    weight: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True
) -> NF4Weight:
    flat = weight.reshape(-1)
    absmax = _blockwise_absmax(flat, blocksize)
    # An odd count pads the last byte with a zero, scaled like the rest of its block.
    even = torch.nn.functional.pad(flat, (0, flat.numel() % 2))
    codes = _nearest_nf4(_scale_blockwise(even, absmax, blocksize))
    packed = (codes[0::2] << 4) | codes[1::2]
    return _finish(packed, absmax, weight, blocksize, double_quant)


def _finish(
    packed: torch.Tensor, absmax: torch.Tensor, weight: torch.Tensor, blocksize: int, double_quant: bool
) -> NF4Weight:
    nested_absmax, offset = None, 0.0
    if double_quant:
        absmax, nested_absmax, offset = quantize_absmax_reference(absmax)
    return NF4Weight(packed, absmax, nested_absmax, offset, weight.shape, weight.dtype, blocksize)


def dequantize_nf4_reference(weight: NF4Weight) -> torch.Tensor:
    code, _, _ = _tables(weight.device)
    nibbles = torch.stack([weight.packed >> 4, weight.packed & 0xF], dim=1).reshape(-1)[: weight.numel]
    absmax = dequantize_absmax_reference(weight).repeat_interleave(weight.blocksize)[: weight.numel]
    return (code[nibbles.long()] * absmax).to(weight.dtype).reshape(weight.shape)


# ----------------------------------------------------------------------------- Triton kernels


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def decode_nested_absmax(absmax_code, nested, dynamic_map_ptr, offset):
        """Double-quantized block absmaxes from their loaded codes and nested absmaxes:
        dynamic_map[code] * nested + offset, the order bitsandbytes rounds in."""
        return tl.load(dynamic_map_ptr + absmax_code.to(tl.int32)) * nested + offset

    @triton.jit
    def load_block_absmax(
        absmax_ptr,
        nested_absmax_ptr,
        dynamic_map_ptr,
        offset,
        blocks,
        mask,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
    ):
        """fp32 absmax of each block index in `blocks` (any shape): rebuilt when double-quantized,
        else as stored. Every NF4 kernel reads absmaxes through here."""
        if DOUBLE_QUANT:
            absmax_code = tl.load(absmax_ptr + blocks, mask=mask, other=0)
            nested = tl.load(nested_absmax_ptr + blocks // NESTED_BLOCKSIZE, mask=mask, other=0.0)
            return decode_nested_absmax(absmax_code, nested, dynamic_map_ptr, offset)
        else:
            return tl.load(absmax_ptr + blocks, mask=mask, other=0.0)

    @triton.jit
    def nf4_code_values(codes, code_ptr, GATHER: tl.constexpr):
        """The fp32 NF4 value of each int32 4-bit code (any shape). GATHER loads the 16 values (one
        loop-invariant load) and picks each code's from them (tl.gather, a lookup in shared memory),
        so a software-pipelined loop has no load per weight to copy ahead one value at a time; else
        each code loads its own value (an L1 hit)."""
        if GATHER:
            table = tl.load(code_ptr + tl.arange(0, 16))
            return tl.gather(table, codes.reshape(codes.numel), 0).reshape(codes.shape)
        else:
            return tl.load(code_ptr + codes)

    @triton.jit
    def decode_nf4_bytes(packed, absmax, code_ptr, GATHER: tl.constexpr):
        """Values of int32 `packed` bytes, high nibble first: code * absmax in fp32, `absmax`
        broadcast against the bytes (GATHER: see nf4_code_values). Every NF4 kernel that forms
        weight values does it here."""
        high = nf4_code_values(packed >> 4, code_ptr, GATHER) * absmax
        low = nf4_code_values(packed & 0xF, code_ptr, GATHER) * absmax
        return tl.interleave(high, low)

    @triton.jit
    def tile_blocks(rows, k_start, row_mask, K, k_end, BLOCKSIZE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Quantization blocks [rows, BLOCK_K // BLOCKSIZE] of a tile whose rows are whole blocks,
        and which of them lie in the matrix before column k_end."""
        block_in_tile = tl.arange(0, BLOCK_K // BLOCKSIZE)
        blocks = rows[:, None] * (K // BLOCKSIZE) + k_start // BLOCKSIZE + block_in_tile[None, :]
        mask = row_mask[:, None] & (k_start + block_in_tile * BLOCKSIZE < k_end)[None, :]
        return blocks, mask

    @triton.jit
    def nf4_tile(
        packed_ptr,
        absmax_ptr,
        nested_ptr,
        code_ptr,
        dynamic_map_ptr,
        offset,
        rows,
        k_start,
        row_mask,
        K,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        ALIGNED: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        """fp32 weights [BLOCK_N, BLOCK_K] at (rows, k_start..); zeros outside the matrix (GATHER: see
        nf4_code_values).

        ALIGNED (rows are whole quantization blocks, tiles too): bytes come in as [rows, blocks,
        bytes of a block] and each block's absmax is rebuilt once. Otherwise every value finds
        its own byte, nibble and block from its flat index (any K, odd ones included).
        """
        if ALIGNED:
            blocks, mask = tile_blocks(rows, k_start, row_mask, K, K, BLOCKSIZE, BLOCK_K)
            absmax = load_block_absmax(
                absmax_ptr, nested_ptr, dynamic_map_ptr, offset, blocks, mask, NESTED_BLOCKSIZE, DOUBLE_QUANT
            )
            byte_offsets = blocks[:, :, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, None, :]
            packed = tl.load(packed_ptr + byte_offsets, mask=mask[:, :, None], other=0).to(tl.int32)
            values = decode_nf4_bytes(packed, absmax[:, :, None], code_ptr, GATHER)
            return tl.where(mask[:, :, None], values, 0.0).reshape(BLOCK_N, BLOCK_K)
        else:
            ks = k_start + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (ks < K)[None, :]
            flat = rows[:, None] * K + ks[None, :]
            packed = tl.load(packed_ptr + (flat >> 1), mask=mask, other=0).to(tl.int32)
            codes = tl.where((flat & 1) == 0, packed >> 4, packed & 0xF)
            absmax = load_block_absmax(
                absmax_ptr,
                nested_ptr,
                dynamic_map_ptr,
                offset,
                flat // BLOCKSIZE,
                mask,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
            )
            return tl.where(mask, nf4_code_values(codes, code_ptr, GATHER) * absmax, 0.0)

    @triton.jit
    def _quantize_nf4_kernel(
        weight_ptr,
        midpoints_ptr,
        packed_ptr,
        absmax_ptr,
        numel,
        BLOCKSIZE: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
    ):
        """One row of the tile is one quantization block: absmax, nearest code, two codes a byte."""
        blocks = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        offsets = blocks[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
        values = tl.load(weight_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
        absmax = tl.max(tl.abs(values), axis=1)
        block_mask = blocks * BLOCKSIZE < numel
        tl.store(absmax_ptr + blocks, absmax, mask=block_mask)
        reciprocal = tl.math.div_rn(1.0, tl.where(block_mask, absmax, 1.0))
        scaled = values * reciprocal[:, None]
        codes = tl.zeros([BLOCKS_PER_PROGRAM, BLOCKSIZE], dtype=tl.int32)
        for i in tl.static_range(15):
            codes += (scaled > tl.load(midpoints_ptr + i)).to(tl.int32)
        high, low = tl.split(tl.reshape(codes, (BLOCKS_PER_PROGRAM, BLOCKSIZE // 2, 2)))
        packed = ((high << 4) | low).to(tl.uint8)
        byte_offsets = blocks[:, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, :]
        tl.store(packed_ptr + byte_offsets, packed, mask=byte_offsets < (numel + 1) // 2)

    @triton.jit
    def _dequantize_nf4_kernel(
        packed_ptr,
        absmax_ptr,
        nested_absmax_ptr,
        code_ptr,
        dynamic_map_ptr,
        out_ptr,
        offset,
        numel,
        row_length,
        row_stride,
        BLOCKSIZE: tl.constexpr,
        NESTED_BLOCKSIZE: tl.constexpr,
        DOUBLE_QUANT: tl.constexpr,
        STRIDED_ROWS: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
    ):
        """One row of the tile is one quantization block; its absmax is rebuilt once per row.

        With STRIDED_ROWS the weight's rows land `row_stride` apart (rows of a wider matrix); the
        launcher guarantees that no block straddles two rows.
        """
        blocks = tl.program_id(0).to(tl.int64) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        block_mask = blocks * BLOCKSIZE < numel
        absmax = load_block_absmax(
            absmax_ptr,
            nested_absmax_ptr,
            dynamic_map_ptr,
            offset,
            blocks,
            block_mask,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        byte_offsets = blocks[:, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, :]
        byte_mask = byte_offsets < (numel + 1) // 2
        packed = tl.load(packed_ptr + byte_offsets, mask=byte_mask, other=0).to(tl.int32)
        values = decode_nf4_bytes(packed, absmax[:, None], code_ptr, False)
        offsets = blocks[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
        if STRIDED_ROWS:
            first = blocks * BLOCKSIZE
            row = first // row_length
            row_start = row * row_stride + first - row * row_length
            destinations = row_start[:, None] + tl.arange(0, BLOCKSIZE)[None, :]
        else:
            destinations = offsets
        tl.store(out_ptr + destinations, values.to(out_ptr.dtype.element_ty), mask=offsets < numel)


# ----------------------------------------------------------------------------- launchers

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEMENTS_PER_PROGRAM = 4096


def _blocks_per_program(blocksize: int) -> int:
    return max(1, _ELEMENTS_PER_PROGRAM // blocksize)


def _check_blocksize(blocksize: int) -> None:
    if blocksize < 2 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize must be a power of two >= 2, got {blocksize}")


def _quantize_nf4_triton(weight: torch.Tensor, blocksize: int, double_quant: bool) -> NF4Weight:
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"NF4 quantizes float32/bfloat16/float16 weights, got {weight.dtype}")
    _check_blocksize(blocksize)
    flat = weight.contiguous().reshape(-1)
    numel = flat.numel()
    blocks = -(-numel // blocksize)
    packed = torch.empty((numel + 1) // 2, dtype=torch.uint8, device=flat.device)
    absmax = torch.empty(blocks, dtype=torch.float32, device=flat.device)
    _, midpoints, _ = _tables(flat.device)
    per_program = _blocks_per_program(blocksize)
    grid = (triton.cdiv(blocks, per_program),)
    _quantize_nf4_kernel[grid](
        flat, midpoints, packed, absmax, numel, BLOCKSIZE=blocksize, BLOCKS_PER_PROGRAM=per_program
    )
    return _finish(packed, absmax, weight, blocksize, double_quant)


def _dequantize_nf4_triton(weight: NF4Weight, out: torch.Tensor) -> None:
    if weight.packed.dtype != torch.uint8 or not weight.packed.is_contiguous():
        raise ValueError("NF4Weight.packed must be a contiguous uint8 tensor")
    expected_absmax = torch.uint8 if weight.double_quant else torch.float32
    if weight.absmax.dtype != expected_absmax:
        raise ValueError(f"NF4Weight.absmax must be {expected_absmax}, got {weight.absmax.dtype}")
    _check_blocksize(weight.blocksize)
    code, _, dynamic_map = _tables(weight.device)
    blocks = weight.absmax.numel()
    per_program = _blocks_per_program(weight.blocksize)
    grid = (triton.cdiv(blocks, per_program),)
    nested = weight.nested_absmax if weight.double_quant else weight.absmax
    row_length = weight.shape[-1]
    strided_rows = out.dim() == 2 and out.stride(0) != row_length
    if strided_rows and row_length % weight.blocksize:
        raise ValueError(f"rows of {row_length} values do not split into blocks of {weight.blocksize}")
    _dequantize_nf4_kernel[grid](
        weight.packed,
        weight.absmax,
        nested,
        code,
        dynamic_map,
        out,
        weight.nested_offset,
        weight.numel,
        row_length,
        out.stride(0) if strided_rows else row_length,
        BLOCKSIZE=weight.blocksize,
        NESTED_BLOCKSIZE=weight.nested_blocksize,
        DOUBLE_QUANT=weight.double_quant,
        STRIDED_ROWS=strided_rows,
        BLOCKS_PER_PROGRAM=per_program,
        # bitsandbytes rounds the absmax product and the offset add separately; so do we.
        enable_fp_fusion=False,
    )


# ----------------------------------------------------------------------------- public


def quantize_nf4(weight: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> NF4Weight:
    """Quantize one weight where it lives (on the GPU while shards stream in)."""
    if use_triton(weight):
        return _quantize_nf4_triton(weight, blocksize, double_quant)
    return quantize_nf4_reference(weight, blocksize, double_quant)


def dequantize_nf4(quantized: NF4Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize into `out` or a new tensor; returns a tensor shaped like the original weight.

    `out` is either a contiguous scratch buffer of at least numel values of quantized.dtype,
    reused across layers (the result is a view of its start), or a 2-D [out, in] view with unit
    column stride whose rows may lie further apart, such as the left columns of a wider matrix.
    """
    numel = quantized.numel
    if out is None:
        out = torch.empty(numel, dtype=quantized.dtype, device=quantized.device)
    if out.device != quantized.device or out.dtype != quantized.dtype:
        raise ValueError(
            f"out is {out.dtype} on {out.device}, the weight needs {quantized.dtype} on {quantized.device}"
        )
    rows_view = out.dim() == 2 and out.shape == quantized.shape and out.stride(1) == 1
    if rows_view:
        target = out
    elif out.is_contiguous() and out.numel() >= numel:
        target = out.reshape(-1)[:numel]
    else:
        raise ValueError(
            f"out must be contiguous with at least {numel} values or a {tuple(quantized.shape)} view with unit "
            f"column stride, got shape {tuple(out.shape)} and strides {out.stride()}"
        )
    if use_triton(quantized.packed):
        _dequantize_nf4_triton(quantized, target)
    else:
        target.copy_(dequantize_nf4_reference(quantized).view(target.shape))
    return target.view(quantized.shape)
