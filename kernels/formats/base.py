"""What a frozen-weight format can do, and the registry that recognises a weight's format."""

from typing import Protocol

import torch


class FrozenWeight(Protocol):
    """Any stored base weight: a [out, in] matrix in some format, with the dtype it computes in."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class FrozenFormat:
    """One way of storing a frozen base weight. The GEMM path, decode, FP8, merge and the memory
    planner ask these instead of testing a weight's type; a format overrides what it can do better
    than the defaults (dequantize, then treat as dense)."""

    name: str
    # Bytes of GPU memory per weight, side tables included: what the memory planner counts.
    bytes_per_weight: float
    # False only for a plain tensor: a group of those needs no decoding at all.
    quantized: bool = True

    def recognises(self, weight: object) -> bool:
        raise NotImplementedError

    def encode(self, weight: torch.Tensor) -> FrozenWeight:
        """A dense weight stored in this format, where it lives (as a checkpoint loads)."""
        raise NotImplementedError

    def dequantize(
        self, weight: FrozenWeight, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The dense [out, in] weight in `dtype` (its own by default), into `out` when given: a
        contiguous scratch or a [out, in] view with unit column stride (`fills_row_views`)."""
        raise NotImplementedError

    def dequantize_reference(self, weight: FrozenWeight, dtype: torch.dtype) -> torch.Tensor:
        """`dequantize` in plain torch ops: what the kernels' references compute with."""
        return self.dequantize(weight, dtype)

    def dense_view(self, weight: FrozenWeight, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight itself when it is already a dense `dtype` matrix, so no copy is needed."""
        return None

    def fills_row_views(self, weight: FrozenWeight) -> bool:
        """Whether `dequantize` can write the rows of a wider matrix (LoRA's B as extra columns)."""
        return True

    def reads_in_gemv(self, weight: FrozenWeight) -> bool:
        """Whether decode's one-row GEMV kernel (kernels.nf4_matvec) reads the weight as stored;
        otherwise decode dequantizes it once and multiplies the dense copy."""
        return False

    def fp8_problem(self, weight: FrozenWeight, in_features: int) -> str | None:
        """Why the weight cannot be cast to e4m3 for FP8 products (kernels.fp8), or None."""
        return "FP8 products need NF4 weights"

    def put_expert(self, experts, count: int, index: int, weight: torch.Tensor):
        """A mixture-of-experts layer's routed experts, stacked as the checkpoint streams them in for
        the grouped GEMM (kernels.grouped_linear): expert `index` of `count` stored alone into
        `experts`, which the first to arrive allocates (None before it); returns them."""
        raise NotImplementedError

    def round_trip(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A dense weight as a model that stored it in this format computes with it: what a merged
        export writes (formats are never exported as stored; they are dequantized first)."""
        return self.dequantize(self.encode(weight.to(dtype)))


_FORMATS: list[FrozenFormat] = []


def register_format(frozen: FrozenFormat) -> None:
    """Make `frozen_format` recognise a format; the latest registered is asked first."""
    _FORMATS.insert(0, frozen)


def frozen_format(weight: object) -> FrozenFormat:
    for frozen in _FORMATS:
        if frozen.recognises(weight):
            return frozen
    raise TypeError(f"no frozen-weight format recognises a {type(weight).__name__}")
