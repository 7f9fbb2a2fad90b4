"""The attention output gate x * sigmoid(gate): Triton path (interpreter on CPU) against the reference."""

import pytest
import torch

from qlora_kernels import sigmoid_gate as sigmoid_gate_module
from qlora_kernels.sigmoid_gate import SigmoidGateFunction, sigmoid_gate, sigmoid_gate_reference


def _query_and_gate(batch, seq_len, n_heads, head_dim, generator, dtype=torch.float32, device="cpu"):
    """(q_proj output, gate): the gate is the second half of each head, as Qwen3.5 lays them out."""
    q_proj_out = torch.randn(
        batch, seq_len, n_heads * 2 * head_dim, generator=generator, dtype=dtype, device=device
    )
    q_proj_out.requires_grad_(True)
    return q_proj_out, q_proj_out.view(batch, seq_len, n_heads, 2 * head_dim)[..., head_dim:]


def _attention_output(batch, seq_len, n_heads, head_dim, generator, dtype=torch.float32, device="cpu"):
    """(leaf, x): x a [B, S, H, D] view of a [B, H, S, D] tensor."""
    leaf = torch.randn(batch, n_heads, seq_len, head_dim, generator=generator, dtype=dtype, device=device)
    leaf.requires_grad_(True)
    return leaf, leaf.transpose(1, 2)


def _outputs_and_grads(fn, leaves, out_grad):
    out = fn()
    return out, torch.autograd.grad(out, leaves, out_grad)


# (heads, head_dim, elements per program): the small tile splits 3 heads over two programs.
SHAPES = [(3, 16, 4096), (3, 16, 32), (2, 40, 4096), (5, 24, 4096)]


@pytest.mark.parametrize(("n_heads", "head_dim", "tile_elements"), SHAPES)
def test_sigmoid_gate_matches_reference(monkeypatch, n_heads, head_dim, tile_elements):
    monkeypatch.setattr(sigmoid_gate_module, "_TILE_ELEMENTS", tile_elements)
    generator = torch.Generator().manual_seed(0)
    q_proj_out, gate = _query_and_gate(2, 5, n_heads, head_dim, generator)
    x_leaf, x = _attention_output(2, 5, n_heads, head_dim, generator)
    # The incoming gradient as a strided view too: [B, S, H, D] of a [S, B, H, D] tensor.
    dout = torch.randn(5, 2, n_heads, head_dim, generator=generator).transpose(0, 1)
    assert not (gate.is_contiguous() or x.is_contiguous() or dout.is_contiguous())
    leaves = [x_leaf, q_proj_out]

    out, grads = _outputs_and_grads(lambda: sigmoid_gate(x, gate), leaves, dout)
    ref_out, ref_grads = _outputs_and_grads(lambda: sigmoid_gate_reference(x, gate), leaves, dout)

    assert out.grad_fn.name().startswith(SigmoidGateFunction.__name__)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_strided_inputs_are_saved_without_copies():
    generator = torch.Generator().manual_seed(1)
    _, gate = _query_and_gate(1, 3, 2, 16, generator)
    _, x = _attention_output(1, 3, 2, 16, generator)
    out = sigmoid_gate(x, gate)
    saved_x, saved_gate = out.grad_fn.saved_tensors
    assert saved_x.data_ptr() == x.data_ptr() and saved_gate.data_ptr() == gate.data_ptr()


def test_refuses_mismatched_inputs():
    x = torch.randn(1, 3, 2, 16)
    with pytest.raises(ValueError, match="gate must match x"):
        sigmoid_gate(x, torch.randn(1, 3, 2, 8))
    with pytest.raises(ValueError, match="gate must match x"):
        sigmoid_gate(x, x.double())
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        sigmoid_gate(x.flatten(2), x.flatten(2))


def test_reference_path_without_interpreter(reference_ops):
    generator = torch.Generator().manual_seed(2)
    _, gate = _query_and_gate(1, 3, 2, 16, generator)
    _, x = _attention_output(1, 3, 2, 16, generator)
    out = sigmoid_gate(x, gate)
    assert "SigmoidGate" not in out.grad_fn.name()
    torch.testing.assert_close(out, sigmoid_gate_reference(x, gate), atol=0, rtol=0)


# Qwen3.5-9B full attention: 16 heads of head_dim 256, 2 x 2048 tokens. bf16: within 1% of the
# largest fp32 reference value (inputs rounded once, outputs once; 0.4% per bf16 rounding).
BF16_TOL = 1e-2


@pytest.mark.gpu
def test_gpu_bf16_against_fp32_reference():
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 2048, 16, 256)
    q_proj_out, gate = _query_and_gate(*shape, generator, torch.bfloat16, "cuda")
    x_leaf, x = _attention_output(*shape, generator, torch.bfloat16, "cuda")
    dout = torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    leaves = [x_leaf, q_proj_out]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_gate = ref_leaves[1].view(*shape[:3], 2 * shape[3])[..., shape[3] :]

    out, grads = _outputs_and_grads(lambda: sigmoid_gate(x, gate), leaves, dout)
    ref_out, ref_grads = _outputs_and_grads(
        lambda: sigmoid_gate_reference(ref_leaves[0].transpose(1, 2), ref_gate), ref_leaves, dout.float()
    )

    for actual, expected in zip([out, *grads], [ref_out, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        error = (actual.float() - expected).abs().max().item()
        assert error <= BF16_TOL * expected.abs().max().item()
