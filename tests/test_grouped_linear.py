"""The grouped GEMM over experts: Triton (interpreter on the CPU) against each row's own expert, forward and
backward, for NF4 experts (rows of whole and of partial quantization blocks, with and without double
quantization) and plain ones, at uneven and empty experts; and on the GPU in bf16."""

import pytest
import torch

from qlora_kernels.formats import DENSE, NF4
from qlora_kernels.grouped_linear import (
    GroupedLinearFunction,
    GroupedNF4Weight,
    GroupedPairFunction,
    _grouped_matmul,
    dequantize_grouped_nf4,
    expert_weight,
    grouped_linear,
    grouped_linear_pair,
    grouped_linear_reference,
    quantize_grouped_nf4,
)
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4


def _weights(count, out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(count, out_features, in_features, generator=generator)


def _offsets(rows_per_expert):
    return torch.tensor([0, *torch.tensor(rows_per_expert).cumsum(0).tolist()], dtype=torch.int64)


def _dense_per_row(weight, rows_per_expert):
    """Each row's expert weight [N, out, in], dequantized expert by expert from its own NF4 weight."""
    dense = [expert_weight(weight, e) for e in range(len(rows_per_expert))]
    return torch.stack([dense[e] for e, rows in enumerate(rows_per_expert) for _ in range(rows)])


def test_experts_are_quantized_one_by_one_and_stack_as_they_were():
    weights = _weights(3, 16, 128, seed=1)
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


@pytest.mark.parametrize("frozen", [NF4, DENSE], ids=["nf4", "dense"])
def test_experts_put_as_they_stream_in_out_of_order_are_the_stack(frozen):
    """A checkpoint may hold a layer's experts in any order: each lands in its own slot."""
    weights = _weights(4, 8, 64, seed=2)
    experts = None
    for index in (2, 0, 3, 1):
        experts = frozen.put_expert(experts, 4, index, weights[index])
    for index in range(4):
        expected = dequantize_nf4(quantize_nf4(weights[index])) if frozen is NF4 else weights[index]
        assert torch.equal(expert_weight(experts, index), expected)


def test_odd_input_features_are_refused():
    with pytest.raises(ValueError, match="an even number of input features, got 65"):
        quantize_grouped_nf4(torch.randn(2, 8, 65))


def test_an_expert_of_another_layout_is_refused():
    with pytest.raises(ValueError, match="must share shape"):
        GroupedNF4Weight.from_experts([quantize_nf4(torch.randn(8, 64)), quantize_nf4(torch.randn(16, 64))])


# Rows per expert: uneven counts across the edges of a program's rows (64 plain, 128 NF4), empty experts
# first, between and last.
ROUTINGS = [[5, 70, 0, 3], [0, 0, 131, 1], [64, 64, 0, 0], [1, 0, 0, 0]]
# (frozen form, out, in): NF4 rows of whole 64-value blocks (two tiles of the inner step), NF4 rows of
# partial blocks (a block straddles rows: 136 x 40 values), NF4 without double quantization, plain.
WEIGHTS = {
    "nf4": (lambda w: quantize_grouped_nf4(w), 136, 128),
    "nf4 partial blocks": (lambda w: quantize_grouped_nf4(w), 136, 40),
    "nf4 single quant": (lambda w: quantize_grouped_nf4(w, double_quant=False), 72, 192),
    "dense": (lambda w: w, 136, 40),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("form", sorted(WEIGHTS))
def test_grouped_gemm_matches_each_rows_expert_forward_and_backward(routing, form):
    """Checked against the product with each row's own expert (not the reference's loop), so a row
    dropped, given to the wrong expert or counted twice fails it."""
    store, out_features, in_features = WEIGHTS[form]
    weight = store(_weights(len(routing), out_features, in_features))
    offsets = _offsets(routing)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(sum(routing), in_features, generator=generator, requires_grad=True)
    dy = torch.randn(sum(routing), out_features, generator=generator)
    y = grouped_linear(x, weight, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.grad_fn.name().startswith(GroupedLinearFunction.__name__)

    dense = _dense_per_row(weight, routing)
    expected = torch.einsum("ni,noi->no", x.detach(), dense)
    expected_dx = torch.einsum("no,noi->ni", dy, dense)
    # fp32 sums of at most 192 (forward) or 136 (backward) products of size ~0.05: a few ulp of ~0.5.
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, expected_dx, atol=1e-5, rtol=1e-5)

    reference = grouped_linear_reference(x.detach(), weight, offsets)
    torch.testing.assert_close(y, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["nf4", "nf4 partial blocks", "dense"])
def test_a_pair_is_the_two_products_side_by_side_and_sums_their_input_gradients(form):
    """A MoE's gate and up: [x W_first^T | x W_second^T] of each row's own experts (out 136 and 72, so
    the second half starts mid-tile of the first's columns), and dx the sum of both products' input
    gradients, read from dy's strided halves. A second product that overwrote the first's dx, or a
    half written at the other's columns, fails it."""
    store, out_features, in_features = WEIGHTS[form]
    routing = ROUTINGS[0]
    first = store(_weights(len(routing), out_features, in_features, seed=5))
    second = store(_weights(len(routing), 72, in_features, seed=6))
    offsets = _offsets(routing)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(routing), in_features, generator=generator, requires_grad=True)
    dy = torch.randn(sum(routing), out_features + 72, generator=generator)
    y = grouped_linear_pair(x, first, second, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.grad_fn.name().startswith(GroupedPairFunction.__name__)

    dense = torch.cat([_dense_per_row(first, routing), _dense_per_row(second, routing)], dim=1)
    torch.testing.assert_close(y, torch.einsum("ni,noi->no", x.detach(), dense), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, torch.einsum("no,noi->ni", dy, dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", sorted(WEIGHTS))
def test_the_reference_matches_each_rows_expert(form, reference_ops):
    store, out_features, in_features = WEIGHTS[form]
    routing = ROUTINGS[0]
    weight = store(_weights(len(routing), out_features, in_features))
    x = torch.randn(sum(routing), in_features, generator=torch.Generator().manual_seed(4))
    expected = torch.einsum("ni,noi->no", x, _dense_per_row(weight, routing))
    torch.testing.assert_close(grouped_linear(x, weight, _offsets(routing)), expected, atol=1e-5, rtol=1e-5)


def test_rows_past_the_last_expert_are_zero_in_both_paths(reference_ops):
    weight = quantize_grouped_nf4(_weights(2, 64, 64))
    x = torch.randn(10, 64)
    offsets = torch.tensor([0, 3, 7])
    assert torch.equal(grouped_linear(x, weight, offsets)[7:], torch.zeros(3, 64))


def test_rows_past_the_last_expert_are_zero_in_the_kernel():
    weight = quantize_grouped_nf4(_weights(2, 64, 64))
    x = torch.randn(10, 64)
    y = grouped_linear(x, weight, torch.tensor([0, 3, 7]))
    assert torch.equal(y[7:], torch.zeros(3, 64))
    torch.testing.assert_close(y, grouped_linear_reference(x, weight, torch.tensor([0, 3, 7])))


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "input-gradient"])
@pytest.mark.parametrize("form", ["nf4", "dense"])
@pytest.mark.parametrize(
    ("offsets", "rows"),
    [([5, 8, 8, 140], 300), ([130, 131, 132, 133], 400)],
    ids=["head-and-tail", "one-row-experts-between-long-head-and-tail"],
)
def test_the_kernel_writes_zeros_where_no_expert_covers_a_row(transposed, form, offsets, rows):
    """The output is allocated unzeroed: rows before the first expert's and after the last's are zeroed
    by the launch's spare programs, enough for both however the experts' partial tiles fall. A buffer
    of NaN stands for whatever memory the allocator hands out."""
    store, out_features, in_features = WEIGHTS[form]
    weight = store(_weights(len(offsets) - 1, out_features, in_features))
    width = in_features if transposed else out_features
    x = torch.randn(
        rows, out_features if transposed else in_features, generator=torch.Generator().manual_seed(8)
    )
    out = torch.full((rows, width), float("nan"))
    _grouped_matmul(x, weight, torch.tensor(offsets), transposed, out=out)
    start, end = offsets[0], offsets[-1]
    assert torch.equal(out[:start], torch.zeros(start, width))
    assert torch.equal(out[end:], torch.zeros(rows - end, width))
    dense = _dense_per_row(weight, [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)])
    covered = x[start:end]
    expected = (
        torch.einsum("no,noi->ni", covered, dense)
        if transposed
        else torch.einsum("ni,noi->no", covered, dense)
    )
    torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    weight = quantize_grouped_nf4(_weights(2, 64, 64))
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        grouped_linear(torch.randn(4, 32), weight, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match=r"expert_offsets must be int \[3\]"):
        grouped_linear(torch.randn(4, 64), weight, torch.tensor([0, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", [[300, 0, 17, 1000, 64], [0, 0, 0, 1]])
@pytest.mark.parametrize("quantized", [True, False], ids=["nf4", "bf16"])
def test_gpu_bf16_grouped_gemm_against_fp32(routing, quantized):
    """bf16 inputs, fp32 accumulation, bf16 output, against fp32 products with the same weights.
    Outputs are sums of 2048 (forward) or 768 (backward) products of unit inputs and ~0.05 weights,
    about 2 in size; the bf16 output rounds to 2^-8 of that (bf16's unit roundoff), about 1e-2."""
    weights = _weights(len(routing), 768, 2048, seed=3).cuda().bfloat16()
    weight = quantize_grouped_nf4(weights) if quantized else weights
    offsets = _offsets(routing).cuda()
    x = torch.randn(sum(routing), 2048, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(routing), 768, device="cuda").bfloat16()
    y = grouped_linear(x, weight, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    bounds = offsets.tolist()
    dense = [expert_weight(weight, e).float() for e in range(len(routing))]
    expected = torch.cat(
        [x[a:b].float() @ w.T for a, b, w in zip(bounds[:-1], bounds[1:], dense, strict=True)]
    )
    expected_dx = torch.cat(
        [dy[a:b].float() @ w for a, b, w in zip(bounds[:-1], bounds[1:], dense, strict=True)]
    )
    torch.testing.assert_close(y.float(), expected.detach(), atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), expected_dx, atol=5e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_bf16_pair_against_fp32():
    """The gate/up pair in bf16 at Qwen3.5-35B-A3B's expert shape (2 x 512 out, 2048 in): each half
    and the summed input gradient (sums of 1024 products, about 1.4 in size) within bf16's rounding
    of the output, as above."""
    routing = [300, 0, 17, 1000, 64]
    first, second = (quantize_grouped_nf4(_weights(5, 512, 2048, seed=s).cuda().bfloat16()) for s in (8, 9))
    offsets = _offsets(routing).cuda()
    x = torch.randn(sum(routing), 2048, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(routing), 1024, device="cuda").bfloat16()
    y = grouped_linear_pair(x, first, second, offsets)
    (dx,) = torch.autograd.grad(y, x, dy)
    bounds = offsets.tolist()
    dense = [torch.cat([expert_weight(first, e), expert_weight(second, e)]).float() for e in range(5)]
    pairs = list(zip(bounds[:-1], bounds[1:], dense, strict=True))
    expected = torch.cat([x[a:b].float() @ w.T for a, b, w in pairs])
    expected_dx = torch.cat([dy[a:b].float() @ w for a, b, w in pairs])
    torch.testing.assert_close(y.float(), expected.detach(), atol=5e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), expected_dx, atol=5e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_grouped_gemm_is_captured_in_a_cuda_graph():
    """No host sync reads the routing: the forward and backward replay in a graph with new offsets."""
    weight = quantize_grouped_nf4(_weights(4, 256, 512, seed=5).cuda().bfloat16())
    x = torch.randn(96, 512, device="cuda").bfloat16().requires_grad_()
    offsets = _offsets([10, 0, 50, 36]).cuda()
    dy = torch.randn(96, 256, device="cuda").bfloat16()
    for _ in range(2):  # compile every kernel before capturing
        torch.autograd.grad(grouped_linear(x, weight, offsets), x, dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_linear(x, weight, offsets)
        (dx,) = torch.autograd.grad(y, x, dy)
    offsets.copy_(_offsets([0, 96, 0, 0]).cuda())
    graph.replay()
    expected = grouped_linear_reference(x.detach(), weight, offsets)
    torch.testing.assert_close(y.float(), expected.float(), atol=5e-2, rtol=1e-2)
