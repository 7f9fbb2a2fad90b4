"""The grouped NF4 GEMM over experts: Triton (interpreter on the CPU) against its reference, forward and
backward, at uneven and empty experts, with and without double quantization; and on the GPU in bf16."""

import pytest
import torch

from qlora_kernels.grouped_nf4 import (
    GroupedNF4LinearFunction,
    GroupedNF4Weight,
    dequantize_grouped_nf4,
    grouped_nf4_linear,
    grouped_nf4_linear_reference,
    quantize_grouped_nf4,
)
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4


def _experts(count, out_features, in_features, double_quant=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weights = 0.05 * torch.randn(count, out_features, in_features, generator=generator)
    return quantize_grouped_nf4(weights, double_quant=double_quant)


def _offsets(rows_per_expert):
    return torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()], dtype=torch.int64)


def _dense_per_row(weight, rows_per_expert):
    """Each row's expert weight [N, out, in], dequantized expert by expert from its own NF4 weight."""
    dense = [dequantize_nf4(weight.expert(e)) for e in range(weight.experts)]
    return torch.stack([dense[e] for e, rows in enumerate(rows_per_expert) for _ in range(rows)])


def test_experts_are_quantized_one_by_one_and_stack_as_they_were():
    weights = 0.05 * torch.randn(3, 16, 128, generator=torch.Generator().manual_seed(1))
    grouped = quantize_grouped_nf4(weights)
    for index in range(3):
        alone = quantize_nf4(weights[index])
        expert = grouped.expert(index)
        assert torch.equal(expert.packed, alone.packed) and torch.equal(expert.absmax, alone.absmax)
        assert torch.equal(expert.nested_absmax, alone.nested_absmax)
        assert expert.nested_offset == alone.nested_offset
    torch.testing.assert_close(
        dequantize_grouped_nf4(grouped), torch.stack([dequantize_nf4(quantize_nf4(w)) for w in weights])
    )


def test_rows_of_partial_quantization_blocks_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 64"):
        quantize_grouped_nf4(torch.randn(2, 8, 96))


# Rows per expert: uneven counts across a 64-row tile's edge, empty experts first, between and last.
ROUTINGS = [[5, 70, 0, 3], [0, 0, 131, 1], [64, 64, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("double_quant", [True, False])
def test_grouped_gemm_matches_each_rows_expert_forward_and_backward(routing, double_quant):
    """Checked against the product with each row's own expert (not the reference's loop), so a row
    dropped, given to the wrong expert or counted twice fails it."""
    weight = _experts(len(routing), 136, 128, double_quant)
    offsets = _offsets(routing)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(routing), 128, generator=generator, requires_grad=True)
    dy = torch.randn(sum(routing), 136, generator=generator)
    y = grouped_nf4_linear(x, weight, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.grad_fn.name().startswith(GroupedNF4LinearFunction.__name__)

    dense = _dense_per_row(weight, routing)
    expected = torch.einsum("ni,noi->no", x.detach(), dense)
    expected_dx = torch.einsum("no,noi->ni", dy, dense)
    # fp32 sums of 128 (forward) or 136 (backward) products of size ~0.05: a few ulp of ~0.5.
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, expected_dx, atol=1e-5, rtol=1e-5)

    reference = grouped_nf4_linear_reference(x.detach(), weight, offsets)
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)


def test_rows_past_the_last_expert_are_zero_in_both_paths(reference_ops):
    weight = _experts(2, 64, 64)
    x = torch.randn(10, 64)
    offsets = torch.tensor([0, 3, 7])
    reference = grouped_nf4_linear(x, weight, offsets)
    assert torch.equal(reference[7:], torch.zeros(3, 64))


def test_rows_past_the_last_expert_are_zero_in_the_kernel():
    weight = _experts(2, 64, 64)
    x = torch.randn(10, 64)
    y = grouped_nf4_linear(x, weight, torch.tensor([0, 3, 7]))
    assert torch.equal(y[7:], torch.zeros(3, 64))
    torch.testing.assert_close(y, grouped_nf4_linear_reference(x, weight, torch.tensor([0, 3, 7])))


def test_bad_shapes_are_refused():
    weight = _experts(2, 64, 64)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        grouped_nf4_linear(torch.randn(4, 32), weight, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"expert_offsets must be int \[3\]"):
        grouped_nf4_linear(torch.randn(4, 64), weight, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="must share shape"):
        GroupedNF4Weight.from_experts([quantize_nf4(torch.randn(8, 64)), quantize_nf4(torch.randn(16, 64))])


@pytest.mark.gpu
@pytest.mark.parametrize("routing", [[300, 0, 17, 1000, 64], [0, 0, 0, 1]])
def test_gpu_bf16_grouped_gemm_against_fp32(routing):
    """bf16 inputs, fp32 accumulation, bf16 output, against fp32 products with the same NF4 weights.
    Outputs are sums of 2048 (forward) or 768 (backward) products of unit inputs and ~0.05 weights,
    about 2 in size; bf16 rounds inputs and output to 2^-9 relative, so errors stay near 1e-2."""
    generator = torch.Generator().manual_seed(3)
    weights = 0.05 * torch.randn(len(routing), 768, 2048, generator=generator)
    weight = quantize_grouped_nf4(weights.cuda().bfloat16())
    as_fp32 = GroupedNF4Weight(**{**weight.__dict__, "dtype": torch.float32})
    offsets = _offsets(routing).cuda()
    x = torch.randn(sum(routing), 2048, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(routing), 768, device="cuda").bfloat16()
    y = grouped_nf4_linear(x, weight, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    bounds = offsets.tolist()
    dense = [dequantize_nf4(as_fp32.expert(e)) for e in range(len(routing))]
    expected = torch.cat([x[a:b].float() @ w.T for a, b, w in zip(bounds, bounds[1:], dense, strict=True)])
    expected_dx = torch.cat([dy[a:b].float() @ w for a, b, w in zip(bounds, bounds[1:], dense, strict=True)])
    torch.testing.assert_close(y.float(), expected.detach(), atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), expected_dx, atol=5e-2, rtol=1e-2)
