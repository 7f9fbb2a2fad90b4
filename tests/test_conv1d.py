"""Causal depthwise conv1d (+SiLU) over time: Triton (interpreter on CPU) against the reference."""

import pytest
import torch
import torch.nn.functional as F

from qlora_kernels import conv1d as conv1d_module
from qlora_kernels.conv1d import (
    CausalConv1dFunction,
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_step,
    causal_conv1d_step_reference,
)

# Each output is a sum of K = 4 fp32 products plus a bias, and each dW / dbias entry a sum of B*T
# products of magnitude ~1: summed in a different order the results differ by a few ulp (1.2e-7)
# times sqrt(terms) * magnitude, under 1e-5 for B*T <= 400; dW is ~sqrt(B*T) = 20 in size, so its
# absolute error is scaled by that.
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _packed_docs(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def _case(batch, seq, channels, width, bias, generator):
    x = torch.randn(batch, seq, channels, generator=generator).requires_grad_(True)
    weight = (torch.randn(channels, width, generator=generator) * 0.5).requires_grad_(True)
    b = (torch.randn(channels, generator=generator) * 0.1).requires_grad_(True) if bias else None
    return x, weight, b


def _grads(y, leaves, dy):
    return torch.autograd.grad(y, [t for t in leaves if t is not None], dy)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("packed", [False, True])
def test_conv1d_matches_reference(bias, activation, packed):
    generator = torch.Generator().manual_seed(0)
    seq, channels, width = 70, 200, 4
    x, weight, b = _case(2, seq, channels, width, bias, generator)
    # Documents of length 1 and 2 (shorter than the window), one starting at a Triton time tile (32).
    doc_ids = torch.stack([_packed_docs([5, 1, 26, 2, 36]), _packed_docs([32, 38])]) if packed else None
    dy = torch.randn(x.shape, generator=generator)

    y = causal_conv1d(x, weight, b, doc_ids, activation)
    expected = causal_conv1d_reference(x, weight, b, doc_ids, activation)
    assert y.grad_fn.name().startswith(CausalConv1dFunction.__name__)
    torch.testing.assert_close(y, expected, **TOL)
    for actual, ref in zip(_grads(y, [x, weight, b], dy), _grads(expected, [x, weight, b], dy), strict=True):
        torch.testing.assert_close(actual, ref, atol=1e-5 * 20, rtol=1e-5)


# bf16 leaves against the fp32 reference on the same values: ours rounds each output to bf16 once,
# the rest is fp32 as above. bf16 keeps 8 significant bits, so a GPU (round to nearest) is within
# 2^-8 of the value; Triton's interpreter truncates, within 2^-7.
BF16_TOL = {"atol": 1e-5 * 20, "rtol": 2**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bias", "activation"), [(False, "silu"), (True, "silu"), (True, None)])
@pytest.mark.parametrize("packed", [False, True])
def test_backward_over_several_tiles_matches_reference(monkeypatch, dtype, bias, activation, packed):
    """Backward programs of 128 channels (200 = 128 + 72) and 19 tokens (67 = 3 * 19 + 10): 19 + 2 *
    (K - 1) = 25 rows to walk is one past a multiple of the rows loaded at a time (8 in bf16, 4 in
    fp32), so a walk that starts a row late drops a whole load. Documents start at a chunk's first
    token (19, 57), one or two tokens into one (20, 39, 59), and on a chunk's last token (37), so
    windows reach across chunks both within a document and across a document start."""
    monkeypatch.setattr(conv1d_module, "_BWD_BLOCK_C", 128)
    monkeypatch.setattr(conv1d_module, "_BWD_CHUNK_T", 19)
    generator = torch.Generator().manual_seed(6)
    x, weight, b = _case(2, 67, 200, 4, bias, generator)
    doc_ids = (
        torch.stack([_packed_docs([19, 1, 2, 17, 18, 2, 8]), _packed_docs([37, 30])]) if packed else None
    )
    dy = torch.randn(x.shape, generator=generator).to(dtype)
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, b) if t is not None]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    y = causal_conv1d(*leaves[:2], leaves[2] if bias else None, doc_ids, activation)
    expected = causal_conv1d_reference(*ref_leaves[:2], ref_leaves[2] if bias else None, doc_ids, activation)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(expected, ref_leaves, dy.float())
    tol = BF16_TOL if dtype == torch.bfloat16 else {"atol": 1e-5 * 20, "rtol": 1e-5}
    for actual, ref in zip([y, *grads], [expected, *ref_grads], strict=True):
        assert actual.dtype == dtype
        torch.testing.assert_close(actual.float(), ref, **tol)


def test_packed_row_equals_documents_one_by_one():
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 1, 40, 20]
    x, weight, b = _case(1, sum(lengths), 48, 4, True, generator)
    y = causal_conv1d(x, weight, b, _packed_docs(lengths)[None])
    alone = torch.cat([causal_conv1d(part, weight, b) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(y, alone, atol=0, rtol=0)


def test_reference_matches_transformers():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    generator = torch.Generator().manual_seed(2)
    x, weight, _ = _case(2, 37, 24, 4, False, generator)
    with torch.no_grad():
        hf = modeling.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
        torch.testing.assert_close(causal_conv1d_reference(x, weight), hf, **TOL)
        ref = F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=24)[..., :37].transpose(1, 2)
        torch.testing.assert_close(causal_conv1d_reference(x, weight, activation=None), ref, **TOL)


@pytest.mark.parametrize("state_len", [3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_step_matches_reference_and_full_forward(state_len, bias):
    """T decode steps from a zero state reproduce the full forward; the state matches the reference's."""
    generator = torch.Generator().manual_seed(3)
    batch, seq, channels, width = 2, 9, 200, 4
    x, weight, b = _case(batch, seq, channels, width, bias, generator)
    x, weight = x.detach(), weight.detach()
    b = None if b is None else b.detach()
    state = torch.zeros(batch, channels, state_len)
    ref_state = state.clone()
    steps = []
    for t in range(seq):
        y = causal_conv1d_step(x[:, t], state, weight, b)
        torch.testing.assert_close(y, causal_conv1d_step_reference(x[:, t], ref_state, weight, b), **TOL)
        torch.testing.assert_close(state, ref_state, atol=0, rtol=0)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), causal_conv1d_reference(x, weight, b), **TOL)
    torch.testing.assert_close(state, x[:, -state_len:].transpose(1, 2), atol=0, rtol=0)


def test_step_matches_transformers_update():
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 24, generator=generator)
    weight = torch.randn(24, 4, generator=generator)
    state = torch.randn(2, 24, 4, generator=generator)
    hf_state = state.clone()
    hf = modeling.causal_conv1d_update(x[:, :, None], hf_state, weight, None, "silu")[:, :, 0]
    torch.testing.assert_close(causal_conv1d_step_reference(x, state, weight), hf, **TOL)
    torch.testing.assert_close(state, hf_state, atol=0, rtol=0)


def test_reference_path_without_interpreter(reference_ops):
    generator = torch.Generator().manual_seed(5)
    x, weight, b = _case(1, 10, 16, 4, True, generator)
    y = causal_conv1d(x, weight, b)
    assert "CausalConv1d" not in y.grad_fn.name()
    torch.testing.assert_close(y, causal_conv1d_reference(x, weight, b), atol=0, rtol=0)


def _assert_close_to_max(actual, expected, tol):
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= tol * scale, f"max error {error:.3e} > {tol} * {scale:.3e}"


@pytest.mark.gpu
def test_gpu_bf16_against_fp32_reference():
    """Qwen3.5-9B: C = 2*16*128 + 32*128 = 8192 channels, K = 4, 2 packed rows of 2048 tokens.

    y and dx come from bf16 inputs through fp32 math to one bf16 rounding (0.4%); dW sums 4096 bf16
    products in fp32, so its error is the inputs' rounding, not the sum's: 1% of the largest value.
    """
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 2048, 8192, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    weight = (torch.randn(8192, 4, generator=generator, device="cuda") * 0.5).bfloat16().requires_grad_(True)
    doc_ids = torch.stack([_packed_docs([700, 1, 1347]), _packed_docs([1024, 1024])]).cuda()
    dy = torch.randn(x.shape, generator=generator, device="cuda").bfloat16()
    leaves = [x, weight]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    y = causal_conv1d(x, weight, None, doc_ids)
    expected = causal_conv1d_reference(*ref_leaves, None, doc_ids)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(expected, ref_leaves, dy.float())
    for actual, ref in zip([y, *grads], [expected, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        _assert_close_to_max(actual, ref, 1e-2)
