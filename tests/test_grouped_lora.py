"""LoRA on routed experts: the grouped outer product (the weight gradients' kernel) and the LoRA
products, Triton (interpreter on the CPU) and the references against each row's own expert's factors,
at uneven and empty experts and rows past the last expert."""

import pytest
import torch
from test_grouped_linear import ROUTINGS, _offsets

from qlora_kernels.grouped_linear import grouped_linear_reference
from qlora_kernels.grouped_lora import (
    GroupedLoRAFunction,
    grouped_lora,
    grouped_lora_reference,
    grouped_outer,
)


def _expert_of_each_row(routing, extra=0):
    """Each row's expert; `extra` rows past the last belong to none (-1)."""
    owners = [e for e, rows in enumerate(routing) for _ in range(rows)]
    return torch.tensor(owners + [-1] * extra, dtype=torch.int64)


def _per_row_outer(a, b, owners, experts):
    """Sum of each row's outer product, credited to its own expert, one row at a time."""
    out = torch.zeros(experts, a.shape[1], b.shape[1], dtype=torch.float64)
    for row, owner in enumerate(owners.tolist()):
        if owner >= 0:
            out[owner] += torch.outer(a[row].double(), b[row].double())
    return out.float()


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernel", "reference"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("p", "q"), [(4, 40), (72, 16), (136, 8)])
def test_grouped_outer_sums_each_experts_rows_alone(routing, p, q, interpret, monkeypatch):
    """Three rows past the last expert count nowhere; an empty expert's sum is zeros."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    generator = torch.Generator().manual_seed(7)
    rows = sum(routing) + 3
    a, b = torch.randn(rows, p, generator=generator), torch.randn(rows, q, generator=generator)
    got = grouped_outer(a, b, _offsets(routing))
    expected = _per_row_outer(a, b, _expert_of_each_row(routing, extra=3), len(routing))
    assert got.dtype == torch.float32 and got.shape == (len(routing), p, q)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def _factors(experts, rank, out_features, in_features, seed):
    generator = torch.Generator().manual_seed(seed)
    a = (0.1 * torch.randn(experts, rank, in_features, generator=generator)).requires_grad_()
    b = (0.1 * torch.randn(experts, out_features, rank, generator=generator)).requires_grad_()
    return a, b


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernel", "reference"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_lora_matches_each_rows_expert_forward_and_backward(routing, interpret, monkeypatch):
    """y = scaling · (x A_e^T) B_e^T and dx, dA, dB against the products with each row's own expert's
    A and B picked by index (not the grouped path): a row given to the wrong expert, A and B crossed
    between experts or the scaling dropped fails it."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    experts, rank, out_features, in_features, scaling = len(routing), 4, 24, 40, 2.5
    a, b = _factors(experts, rank, out_features, in_features, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(sum(routing), in_features, generator=generator, requires_grad=True)
    dy = torch.randn(sum(routing), out_features, generator=generator)
    y = grouped_lora(x, a, b, _offsets(routing), scaling)
    grads = torch.autograd.grad(y, (x, a, b), dy)
    if interpret == "1":
        assert y.grad_fn.name().startswith(GroupedLoRAFunction.__name__)

    owners = _expert_of_each_row(routing)
    expected = scaling * torch.einsum("nor,nri,ni->no", b[owners], a[owners], x)
    expected_grads = torch.autograd.grad(expected, (x, a, b), dy)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernel", "reference"])
def test_bf16_rows_take_fp32_masters_and_give_fp32_gradients(interpret, monkeypatch):
    """The products run in x's dtype; the masters' gradients come back in theirs. (The interpreter's
    bf16 dot is not numerically meaningful on the CPU: the GPU test below checks the kernel's values.)"""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    routing = ROUTINGS[0]
    a, b = _factors(len(routing), 4, 24, 40, seed=5)
    x = torch.randn(sum(routing), 40).bfloat16().requires_grad_()
    y = grouped_lora(x, a, b, _offsets(routing), 2.0)
    dx, da, db = torch.autograd.grad(y.float().square().sum(), (x, a, b))
    assert y.dtype == dx.dtype == torch.bfloat16 and da.dtype == db.dtype == torch.float32


def _same_masters_product(x, a, b, offsets, scaling):
    """The fp64 product with the masters cast to x's dtype, as the kernel multiplies them."""
    return grouped_lora_reference(
        x.double(), a.to(x.dtype).double(), b.to(x.dtype).double(), offsets, scaling
    )


def _bf16_bound(x, a, b, offsets, scaling):
    """Worst case of the kernel's roundings against _same_masters_product, entry by entry, with u = 2^-8
    bf16's unit roundoff: t = scaling · x A^T rounds twice (the product, then the scaled value), so each
    t_r is off by up to 2u|t_r|, and y by sum_r 2u |t_r| |B_r|; y's own rounding adds u|y|; fp32
    accumulation over n terms adds n 2^-24 of the absolute sums (tensor cores, n = in_features for t
    and rank for y)."""
    u, fp32 = 2.0**-8, 2.0**-24
    a, b = a.detach().to(x.dtype).double(), b.detach().to(x.dtype).double()
    xd = x.detach().double()
    t = grouped_linear_reference(xd, a, offsets) * scaling
    t_sums = grouped_linear_reference(xd.abs(), a.abs(), offsets) * scaling
    y = grouped_linear_reference(t, b, offsets).abs()
    t_error = 2 * u * t.abs() + x.shape[1] * fp32 * t_sums
    y_sums = grouped_linear_reference(t.abs(), b.abs(), offsets)
    return u * y + grouped_linear_reference(t_error, b.abs(), offsets) + a.shape[1] * fp32 * y_sums


@pytest.mark.gpu
def test_gpu_bf16_grouped_lora_against_fp32_and_in_a_cuda_graph():
    """bf16 rows against the fp32 reference, and replayed in a CUDA graph with new offsets: no host
    read of the routing."""
    routing = [300, 0, 17, 1000, 64]
    a, b = (t.detach().cuda().requires_grad_() for t in _factors(len(routing), 16, 768, 2048, seed=8))
    offsets = _offsets(routing).cuda()
    x = torch.randn(sum(routing), 2048, device="cuda").bfloat16().requires_grad_()
    dy = torch.randn(sum(routing), 768, device="cuda").bfloat16()
    for _ in range(2):  # compile every kernel before capturing
        grouped_lora(x, a, b, offsets, 2.0)
        torch.autograd.grad(grouped_lora(x, a, b, offsets, 2.0), (x, a, b), dy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_lora(x, a, b, offsets, 2.0)
        grads = torch.autograd.grad(y, (x, a, b), dy)
    offsets.copy_(_offsets([0, 1381, 0, 0, 0]).cuda())
    graph.replay()
    xf = x.detach().float().requires_grad_()
    expected = grouped_lora_reference(xf, a, b, offsets, 2.0)
    expected_grads = torch.autograd.grad(expected, (xf, a, b), dy.float())
    assert (
        (y.float() - _same_masters_product(x, a, b, offsets, 2.0)).abs() <= _bf16_bound(x, a, b, offsets, 2.0)
    ).all()
    for got, want in zip(grads, expected_grads, strict=True):
        scale = want.abs().max()
        assert (got.float() - want).abs().max() < 2e-2 * scale


def test_factors_of_another_expert_count_are_refused():
    a, b = _factors(3, 4, 8, 16, seed=6)
    with pytest.raises(ValueError, match="one factor per expert, 4 of them"):
        grouped_lora(torch.randn(5, 16), a, b, _offsets([1, 1, 1, 2]), 1.0)
