"""bitsandbytes' NF4 (kernels.nf4) as a frozen-weight format: the base of a QLoRA run."""

from dataclasses import replace

import torch

from qlora_kernels._dispatch import use_triton
from qlora_kernels.formats.base import FrozenFormat, register_format
from qlora_kernels.grouped_linear import GroupedNF4Weight
from qlora_kernels.nf4 import NF4Weight, dequantize_nf4, dequantize_nf4_reference, quantize_nf4


class NF4Format(FrozenFormat):
    name = "nf4"
    # Half a byte of code per weight plus about 1/64 byte of (double-quantized) block absmax.
    bytes_per_weight = 0.5 + 1 / 64

    def recognises(self, weight: object) -> bool:
        return isinstance(weight, NF4Weight)

    def encode(self, weight: torch.Tensor) -> NF4Weight:
        return quantize_nf4(weight)

    def dequantize(
        self, weight: NF4Weight, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dequantize_nf4(weight if dtype is None else replace(weight, dtype=dtype), out=out)

    def dequantize_reference(self, weight: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4_reference(replace(weight, dtype=dtype))

    def put_expert(self, experts, count: int, index: int, weight: torch.Tensor) -> GroupedNF4Weight:
        expert = quantize_nf4(weight)
        if experts is None:
            experts = GroupedNF4Weight.empty(count, expert)
        experts.put(index, expert)
        return experts

    def fills_row_views(self, weight: NF4Weight) -> bool:
        """Only when each row is whole blocks: a block never straddles two rows of the scratch."""
        return weight.shape[1] % weight.blocksize == 0

    def reads_in_gemv(self, weight: NF4Weight) -> bool:
        return use_triton(weight.packed)

    def fp8_problem(self, weight: NF4Weight, in_features: int) -> str | None:
        """The e4m3 scales come from block absmaxes, so rows must be whole blocks."""
        if in_features % weight.blocksize:
            return f"{in_features} inputs do not split into NF4 blocks of {weight.blocksize}"
        return None


NF4 = NF4Format()
register_format(NF4)
