"""SwiGLU: Triton path (interpreter on CPU) against the reference, forward and backward."""

import pytest
import torch

from kernels.swiglu import SwiGLUFunction, swiglu, swiglu_reference


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

    assert out.grad_fn.name().startswith(SwiGLUFunction.__name__)
    assert out.shape == (*gate_up.shape[:-1], intermediate)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_backward_saves_only_the_input():
    gate_up = torch.randn(3, 48).requires_grad_(True)
    out = swiglu(gate_up)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0] is gate_up


def test_odd_width_is_refused():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 47))


def test_reference_path_without_interpreter(reference_ops):
    gate_up = torch.randn(2, 3, 48).requires_grad_(True)
    out = swiglu(gate_up)
    assert "SwiGLU" not in out.grad_fn.name()
    torch.testing.assert_close(out, swiglu_reference(gate_up), atol=0, rtol=0)


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
