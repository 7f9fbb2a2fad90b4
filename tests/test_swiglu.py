"""SwiGLU with LoRA's gate/up B and down A fused in: Triton (interpreter on CPU) against the reference."""

import pytest
import torch

from qlora_kernels.swiglu import (
    LoRASwiGLUFunction,
    lora_swiglu,
    lora_swiglu_reference,
    swiglu,
    swiglu_reference,
)


def _gate_up(layout: str, intermediate: int, generator: torch.Generator):
    """(leaf, gate_up): 'strided' has non-contiguous leading dims, 'sliced' rows wider than 2*I.

    Values reach well into silu's saturated tails.
    """
    width = 2 * intermediate

    def leaf(*shape):
        return (4.0 * torch.randn(*shape, generator=generator)).requires_grad_(True)

    if layout == "rows":
        rows = leaf(3, width)
        return rows, rows
    if layout == "batched":
        batched = leaf(2, 3, width)
        return batched, batched
    if layout == "sliced":
        wide = leaf(3, width + 6)
        return wide, wide[:, 2 : 2 + width]
    transposed = leaf(3, 2, width)
    return transposed, transposed.transpose(0, 1)


@pytest.mark.parametrize("layout", ["rows", "batched", "strided", "sliced"])
@pytest.mark.parametrize("intermediate", [24, 40])
def test_swiglu_matches_reference(layout, intermediate):
    generator = torch.Generator().manual_seed(0)
    leaf, gate_up = _gate_up(layout, intermediate, generator)
    dout = torch.randn(*gate_up.shape[:-1], intermediate, generator=generator)

    out = swiglu(gate_up)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    ref_out = swiglu_reference(gate_up)
    (ref_grad,) = torch.autograd.grad(ref_out, leaf, dout)

    assert out.grad_fn.name().startswith(LoRASwiGLUFunction.__name__)
    assert out.shape == (*gate_up.shape[:-1], intermediate)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def _lora(gate: bool, up: bool, down: bool, rank: int, tokens=(2, 35), intermediate=72, seed=0):
    """gate_up (saturating values), t, B's and A's as leaves; the ragged sizes leave partial tiles."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).requires_grad_(True)

    gate_up = leaf(*tokens, 2 * intermediate, scale=3.0)
    gate_b = leaf(intermediate, rank, scale=0.5) if gate else None
    up_b = leaf(intermediate, rank, scale=0.5) if up else None
    ranks = rank * (gate + up)
    lora_t = leaf(*tokens, ranks) if ranks else None
    down_a = leaf(rank + 3, intermediate, scale=0.2) if down else None
    return gate_up, lora_t, gate_b, up_b, down_a


def _run(function, inputs, grads, **kwargs):
    h, down_t = function(*inputs[:4], 0.7, inputs[4], **kwargs)
    outputs = [h] + ([down_t] if down_t is not None else [])
    leaves = [t for t in inputs if t is not None]
    return (h, down_t), torch.autograd.grad(outputs, leaves, grads[: len(outputs)])


LORA_CASES = {
    "all": (True, True, True, 5),
    "gate_and_down": (True, False, True, 5),
    "up_only": (False, True, False, 5),
    "down_only": (False, False, True, 4),
    "gate_up_rank_20": (True, True, False, 20),
}


@pytest.mark.parametrize("case", sorted(LORA_CASES))
def test_lora_swiglu_matches_reference(case):
    inputs = _lora(*LORA_CASES[case])
    generator = torch.Generator().manual_seed(1)
    gate_up, down_a = inputs[0], inputs[4]
    grads = [torch.randn(*gate_up.shape[:-1], gate_up.shape[-1] // 2, generator=generator)]
    if down_a is not None:
        grads.append(torch.randn(*gate_up.shape[:-1], down_a.shape[0], generator=generator))
    (h, down_t), got = _run(lora_swiglu, inputs, grads)
    (want_h, want_down_t), want = _run(lora_swiglu_reference, inputs, grads)

    assert h.grad_fn.name().startswith(LoRASwiGLUFunction.__name__)
    torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
    if down_a is not None:
        torch.testing.assert_close(down_t, want_down_t, atol=1e-5, rtol=1e-5)
    else:
        assert down_t is None
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_recompute_skips_h_but_not_what_backward_needs():
    """need_output=False (down's GEMM skipped in a checkpoint recompute): the same down_t and
    the same gradients from the same incoming ones."""
    inputs = _lora(True, True, True, 5)
    gate_up, down_a = inputs[0], inputs[4]
    grads = [torch.randn(*gate_up.shape[:-1], gate_up.shape[-1] // 2), torch.randn(2, 35, down_a.shape[0])]
    (_, down_t), full = _run(lora_swiglu, inputs, grads)
    (skipped_h, skipped_down_t), skipped = _run(lora_swiglu, inputs, grads, need_output=False)
    assert skipped_h.shape == gate_up.shape[:-1] + (72,)
    assert skipped_h.untyped_storage().nbytes() == skipped_h.element_size()
    torch.testing.assert_close(skipped_down_t, down_t, atol=0, rtol=0)
    for got, want in zip(skipped, full, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_backward_keeps_inputs_only():
    """Neither h nor silu(gate) is saved: backward recomputes them from gate_up. The LoRA
    matrices are kept in the compute dtype, here their own."""
    inputs = _lora(True, True, True, 5)
    h, _ = lora_swiglu(*inputs[:4], 0.7, inputs[4])
    saved = h.grad_fn.saved_tensors
    assert {t.data_ptr() for t in saved if t is not None} == {t.data_ptr() for t in inputs}


def test_deterministic_algorithms_sum_lora_t_grad_in_a_fixed_order(deterministic_algorithms, monkeypatch):
    """Under torch.use_deterministic_algorithms the kernel leaves t's gradient to the GEMMs."""
    import qlora_kernels.swiglu as swiglu_module

    launches = []
    launcher = swiglu_module._swiglu_backward

    def spy(*args, **kwargs):
        launches.append(kwargs["lora_t_grad"])
        return launcher(*args, **kwargs)

    monkeypatch.setattr(swiglu_module, "_swiglu_backward", spy)
    inputs = _lora(True, True, True, 5)
    grads = [torch.randn(2, 35, 72), torch.randn(2, 35, 8)]
    _, got = _run(lora_swiglu, inputs, grads)
    _, want = _run(lora_swiglu_reference, inputs, grads)
    assert launches == [False]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 47))


def test_bad_lora_shapes_are_named():
    gate_up, lora_t, gate_b, up_b, down_a = _lora(True, True, True, 5)
    with pytest.raises(ValueError, match=r"gate_b must be \[72, rank\]"):
        lora_swiglu(gate_up, lora_t, gate_b[:70], up_b, 0.7, down_a)
    with pytest.raises(ValueError, match="share one rank"):
        lora_swiglu(gate_up, lora_t, gate_b, up_b[:, :4], 0.7, down_a)
    with pytest.raises(ValueError, match=r"lora_t must be \[\.\.\., 10\]"):
        lora_swiglu(gate_up, lora_t[..., :6], gate_b, up_b, 0.7, down_a)
    with pytest.raises(ValueError, match=r"down_a must be \[rank, 72\]"):
        lora_swiglu(gate_up, lora_t, gate_b, up_b, 0.7, down_a.T)


def test_reference_path_without_interpreter(reference_ops):
    inputs = _lora(True, True, True, 5)
    h, down_t = lora_swiglu(*inputs[:4], 0.7, inputs[4])
    assert "LoRASwiGLU" not in h.grad_fn.name()
    want_h, want_down_t = lora_swiglu_reference(*inputs[:4], 0.7, inputs[4])
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(down_t, want_down_t, atol=0, rtol=0)


# Qwen2.5-7B: intermediate 18944, 2 x 2048 tokens. One bf16 rounding of the output and of each
# gradient: within 1% of the largest fp32 reference value.
BF16_TOL = 1e-2


@pytest.mark.gpu
def test_gpu_bf16_against_fp32_reference():
    generator = torch.Generator(device="cuda").manual_seed(0)
    intermediate = 18944
    gate_up = torch.randn(2, 2048, 2 * intermediate, generator=generator, device="cuda")
    gate_up = (3.0 * gate_up).bfloat16().requires_grad_(True)
    dout = torch.randn(2, 2048, intermediate, generator=generator, device="cuda").bfloat16()
    ref_gate_up = gate_up.detach().float().requires_grad_(True)

    out = swiglu(gate_up)
    (grad,) = torch.autograd.grad(out, gate_up, dout)
    ref_out = swiglu_reference(ref_gate_up)
    (ref_grad,) = torch.autograd.grad(ref_out, ref_gate_up, dout.float())

    for actual, expected in ((out, ref_out), (grad, ref_grad)):
        assert actual.dtype == torch.bfloat16
        error = (actual.float() - expected).abs().max().item()
        assert error <= BF16_TOL * expected.abs().max().item()


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
def test_gpu_lora_bf16_against_fp32_reference():
    """Qwen2.5-7B's MLP at r=16, 4,096 tokens: relative error under 1% for h, down_t and
    dgate_up, under 2% for the rank-sized gradients (dt, dB, dA)."""
    torch.manual_seed(0)
    tokens, intermediate, rank = 4096, 18944, 16

    def leaf(*shape, scale):
        return (scale * torch.randn(*shape, device="cuda")).requires_grad_(True)

    gate_up = leaf(tokens, 2 * intermediate, scale=3.0).detach().bfloat16().requires_grad_(True)
    lora_t = leaf(tokens, 2 * rank, scale=1.0).detach().bfloat16().requires_grad_(True)
    gate_b, up_b = leaf(intermediate, rank, scale=0.05), leaf(intermediate, rank, scale=0.05)
    down_a = leaf(rank, intermediate, scale=0.01)
    dh = torch.randn(tokens, intermediate, device="cuda").bfloat16()
    ddown_t = torch.randn(tokens, rank, device="cuda").bfloat16()
    inputs = [gate_up, lora_t, gate_b, up_b, down_a]
    wide = [t.detach().float().requires_grad_(True) for t in inputs]

    (h, down_t), got = _run(lora_swiglu, inputs, [dh, ddown_t])
    (want_h, want_down_t), want = _run(lora_swiglu_reference, wide, [dh.float(), ddown_t.float()])

    assert h.dtype == down_t.dtype == torch.bfloat16
    assert _relative_error(h, want_h) < 1e-2 and _relative_error(down_t, want_down_t) < 1e-2
    assert got[0].dtype == torch.bfloat16 and _relative_error(got[0], want[0]) < 1e-2
    for g, w in zip(got[1:], want[1:], strict=True):
        assert _relative_error(g, w) < 2e-2
    assert [g.dtype for g in got[2:]] == [torch.float32] * 3
