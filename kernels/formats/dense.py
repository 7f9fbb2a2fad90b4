"""The plain tensor (`load_in_4bit: false`): a frozen weight with no format to decode."""

import torch

from qlora_kernels.formats.base import FrozenFormat, register_format


class DenseFormat(FrozenFormat):
    name = "dense"
    quantized = False
    bytes_per_weight = 2.0  # bf16, the compute dtype a plain base loads in

    def recognises(self, weight: object) -> bool:
        return isinstance(weight, torch.Tensor)

    def encode(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def dequantize(
        self, weight: torch.Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is not None:
            return out.copy_(weight)
        return weight if dtype is None else weight.to(dtype)

    def dense_view(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        return weight if weight.dtype == dtype else None

    def put_expert(self, experts, count: int, index: int, weight: torch.Tensor) -> torch.Tensor:
        if experts is None:
            experts = weight.new_empty((count, *weight.shape))
        experts[index].copy_(weight)
        return experts

    def reads_in_gemv(self, weight: torch.Tensor) -> bool:
        return True


DENSE = DenseFormat()
register_format(DENSE)
