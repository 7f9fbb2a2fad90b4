"""A mixture-of-experts layer's token copies spread to their sorted rows and combined back, weighted:
Triton (interpreter on the CPU) against the references, forward and backward, at odd widths and k."""

import pytest
import torch

from qlora_kernels import expert_rows as expert_rows_module
from qlora_kernels.expert_rows import (
    combine_rows,
    combine_rows_reference,
    spread_rows,
    spread_rows_reference,
)

UNIT = 2.0**-24  # fp32's unit roundoff


def _positions(tokens: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Where each token's copies sit once sorted: a permutation of the T·k rows, as [T, k]."""
    return torch.randperm(tokens * k, generator=generator).view(tokens, k)


def _assert_sums_close(got, want, terms_abs_sum, terms, name):
    """Two fp32 sums of the same `terms` products in different orders differ by at most
    2 (terms - 1) u sum |product| (each order's recursive-summation bound)."""
    bound = 2 * max(terms - 1, 1) * UNIT * terms_abs_sum
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, f"{name}: {excess.max().item():.3g} over the bound"


# (tokens, k, hidden, columns a program takes): widths below, at and past one block, k as the
# shipped MoE families route (8) and the least.
SHAPES = [(5, 8, 24, 1024), (7, 2, 1000, 1024), (3, 1, 2100, 1024), (6, 4, 40, 16)]


@pytest.mark.parametrize(("tokens", "k", "hidden", "block"), SHAPES)
def test_spread_puts_each_token_at_its_rows_and_sums_their_gradients(monkeypatch, tokens, k, hidden, block):
    monkeypatch.setattr(expert_rows_module, "_BLOCK_H", block)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
    positions = _positions(tokens, k, generator)
    drows = torch.randn(tokens * k, hidden, generator=generator)
    rows = spread_rows(x, positions)
    expected = spread_rows_reference(x.detach(), positions)
    assert torch.equal(rows, expected)
    for t in range(tokens):
        for j in range(k):
            assert torch.equal(rows[positions[t, j]], x[t])
    (dx,) = torch.autograd.grad(rows, x, drows)
    want = drows[positions].sum(dim=1)
    _assert_sums_close(dx, want, drows[positions].abs().sum(dim=1), k, "dx")


@pytest.mark.parametrize(("tokens", "k", "hidden", "block"), SHAPES)
def test_combine_weighs_each_tokens_rows_and_back(monkeypatch, tokens, k, hidden, block):
    """Against each token's own k rows (not the reference's indexing), so a row dropped, taken twice
    or weighted by another copy's weight fails it; backward against the reference's autograd."""
    monkeypatch.setattr(expert_rows_module, "_BLOCK_H", block)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(tokens * k, hidden, generator=generator, requires_grad=True)
    weights = torch.rand(tokens, k, generator=generator, requires_grad=True)
    positions = _positions(tokens, k, generator)
    dout = torch.randn(tokens, hidden, generator=generator)
    out = combine_rows(rows, positions, weights)
    products = torch.stack(
        [torch.stack([weights[t, j] * rows[positions[t, j]] for j in range(k)]) for t in range(tokens)]
    ).detach()
    _assert_sums_close(out, products.sum(dim=1), products.abs().sum(dim=1), k, "out")
    drows, dweights = torch.autograd.grad(out, (rows, weights), dout)
    ref = combine_rows_reference(rows, positions, weights)
    want_rows, want_weights = torch.autograd.grad(ref, (rows, weights), dout)
    # A row's gradient is one product, rounded alike on both sides.
    torch.testing.assert_close(drows, want_rows, rtol=UNIT, atol=0)
    dot_terms = (rows.detach()[positions] * dout[:, None, :]).abs().sum(dim=-1)
    _assert_sums_close(dweights, want_weights, dot_terms, hidden, "dweights")


def test_bad_positions_are_refused():
    with pytest.raises(ValueError, match=r"positions must be int \[3, k\]"):
        spread_rows(torch.zeros(3, 8), torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"positions must be int \[2, k\]"):
        combine_rows(torch.zeros(4, 8), torch.zeros(2, 2), torch.ones(2, 2))


@pytest.mark.gpu
def test_gpu_bf16_spread_and_combine_against_fp32():
    """bf16 rows at the 35B-A3B's width and top 8, against fp32 sums of the same values. Products of
    two bf16 values are exact in fp32, the kernels add them in fp32 (recursive-summation bound
    (n - 1) 2^-24 sum |term|) and round once to bf16 (2^-8 of the result, at most of sum |term|)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    generator = torch.Generator().manual_seed(2)
    tokens, k, hidden = 4096, 8, 2048
    x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16().requires_grad_(True)
    positions = _positions(tokens, k, generator).cuda()
    weights = torch.rand(tokens, k, generator=generator).cuda().bfloat16().requires_grad_(True)
    rows = spread_rows(x, positions)
    assert torch.equal(rows, spread_rows_reference(x.detach(), positions))
    out = combine_rows(rows, positions, weights)
    expected = combine_rows_reference(rows.float(), positions, weights.float())
    bf16, fp32 = 2.0**-8, 2.0**-24
    scale = (rows.float()[positions] * weights.float()[..., None]).abs().sum(dim=1)
    assert ((out.float() - expected).abs() <= (bf16 + 2 * (k - 1) * fp32) * scale).all()
    dout = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
    dx, dweights = torch.autograd.grad(out, (x, weights), dout)
    # dx[t] = (sum_j weights[t, j]) dout[t]: each product rounds to a bf16 row, their sum once more.
    want_dx = weights.float().sum(dim=1, keepdim=True) * dout.float()
    dx_scale = weights.float().sum(dim=1, keepdim=True) * dout.float().abs()
    assert ((dx.float() - want_dx).abs() <= (2 * bf16 + 2 * k * fp32) * dx_scale).all()
    want_dw = (rows.float()[positions] * dout.float()[:, None, :]).sum(dim=-1)
    dot_scale = (rows.float()[positions] * dout.float()[:, None, :]).abs().sum(dim=-1)
    assert ((dweights.float() - want_dw).abs() <= (bf16 + 2 * (hidden - 1) * fp32) * dot_scale).all()
