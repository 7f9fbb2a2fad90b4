"""Decode-time projections: a few rows of activations times frozen NF4 (or plain) weights.

    y = concat_p( x @ dequant(W_p)^T + bias_p )        x: [M, K], M a decode batch (1..64)

At decode a step multiplies a handful of rows by every weight once, so the time is the time to
read the weights. Dequantizing a whole matrix first (kernels.nf4) writes and re-reads it at
bf16, five times the NF4 bytes; the Triton kernel here instead decodes the 4-bit codes and
their block absmaxes (double-quantized or plain fp32) in registers, tile by tile, and multiplies
them straight into fp32 accumulators, reading each weight byte once for all M rows.

Numerics match `x @ dequantize_nf4(W).T`: each weight value is code * absmax in fp32, rounded to
x.dtype, and products are summed in fp32; the result is cast to x.dtype once, after the bias.

There is no autograd Function: decoding is inference only, nothing flows back through here.
"""

from collections.abc import Sequence
from dataclasses import replace

import torch

from qlora_kernels.nf4 import NF4Weight, dequantize_nf4_reference

FrozenWeight = NF4Weight | torch.Tensor


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
        if isinstance(weight, NF4Weight):
            weight = dequantize_nf4_reference(replace(weight, dtype=x.dtype))
        y = x.float() @ weight.to(x.dtype).float().T
        if bias is not None:
            y = y + bias.float()
        outputs.append(y.to(x.dtype))
    return torch.cat(outputs, dim=-1)


# ----------------------------------------------------------------------------- public


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
    """x [..., K] times each weight, outputs side by side: [..., sum N_p] in x.dtype."""
    _check_arguments(x, weights, biases)
    rows = x.reshape(-1, x.shape[-1])
    out = nf4_matvec_reference(rows, weights, biases)
    return out.reshape(*x.shape[:-1], out.shape[-1])
