"""Fused frozen projection + LoRA: the autograd Function against autograd through the reference."""

from dataclasses import replace

import pytest
import torch

from qlora_kernels.linear import (
    LoRAAFunction,
    LoRABFunction,
    LoRALinearFunction,
    buffer_numel,
    lora_linear,
    lora_linear_a,
    lora_linear_a_reference,
    lora_linear_b,
    lora_linear_b_reference,
    lora_linear_reference,
)
from qlora_kernels.nf4 import dequantize_nf4_reference, quantize_nf4

gpu = pytest.mark.gpu

# (in, outs, rank, bias, nf4, which projections carry LoRA, separate lora_x)
CASES = {
    "qkv_nf4_bias": (64, (64, 32, 32), 4, True, True, (0, 1, 2), False),
    "qkv_plain_partial_lora_dropout": (64, (64, 32, 32), 8, False, False, (0, 2), True),
    "gate_up_nf4_dropout": (128, (64, 64), 8, False, True, (0, 1), True),
    "gate_up_nf4": (64, (64, 64), 4, False, True, (0, 1), False),
    "down_nf4_ragged_rows_dropout": (96, (64,), 4, False, True, (0,), True),
    "o_proj_plain": (64, (64,), 4, False, False, (0,), False),
    "down_nf4_bias_no_lora": (128, (64,), 4, True, True, (), False),
}


def _make(case, dtype=torch.float32, device="cpu", seed=0):
    in_features, outs, rank, bias, nf4, lora, separate = case
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device)

    weights = [randn(out, in_features, scale=in_features**-0.5) for out in outs]
    weights = [w.to(dtype) for w in weights]
    if nf4:
        weights = [quantize_nf4(w) for w in weights]
    biases = [randn(out, scale=0.1).to(dtype) if bias else None for out in outs]
    lora_a = [
        randn(rank, in_features, scale=0.1).requires_grad_() if p in lora else None for p in range(len(outs))
    ]
    lora_b = [
        randn(out, rank, scale=0.1).requires_grad_() if p in lora else None for p, out in enumerate(outs)
    ]
    x = randn(2, 5, in_features).to(dtype).requires_grad_()
    lora_x = (x.detach() * (randn(2, 5, in_features) > 0) * 2).requires_grad_() if separate else None
    return x, lora_x, weights, biases, lora_a, lora_b


_FUNCTION_NODE = f"{LoRALinearFunction.__name__}Backward"


def _differentiable(x, lora_x, lora_a, lora_b):
    return [x] + ([lora_x] if lora_x is not None else []) + [t for t in lora_a + lora_b if t is not None]


def _forward_and_grads(function, x, lora_x, weights, biases, lora_a, lora_b, grad_out, **kwargs):
    y = function(x, weights, biases, lora_a, lora_b, 0.5, lora_x, **kwargs)
    inputs = _differentiable(x, lora_x, lora_a, lora_b)
    return y, torch.autograd.grad(y, inputs, grad_out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_function_matches_reference(name):
    x, lora_x, weights, biases, lora_a, lora_b = _make(CASES[name])
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    y, grads = _forward_and_grads(lora_linear, x, lora_x, weights, biases, lora_a, lora_b, grad_out)
    expected_y, expected_grads = _forward_and_grads(
        lora_linear_reference, x, lora_x, weights, biases, lora_a, lora_b, grad_out
    )
    assert y.shape == (2, 5, sum(CASES[name][1]))
    assert type(y.grad_fn).__name__ == _FUNCTION_NODE
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qkv_nf4_bias", "gate_up_nf4", "gate_up_nf4_dropout"])
def test_frozen_input_gets_lora_gradients_only(name):
    """The first layer's input needs no gradient: no dX GEMM, the same A and B gradients."""
    x, lora_x, weights, biases, lora_a, lora_b = _make(CASES[name])
    x = x.detach()
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    inputs = ([lora_x] if lora_x is not None else []) + [t for t in lora_a + lora_b if t is not None]
    grads = torch.autograd.grad(
        lora_linear(x, weights, biases, lora_a, lora_b, 0.5, lora_x), inputs, grad_out
    )
    y = lora_linear_reference(x, weights, biases, lora_a, lora_b, 0.5, lora_x)
    for got, want in zip(grads, torch.autograd.grad(y, inputs, grad_out), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_recompute_without_output_gives_the_same_gradients(name):
    """need_output=False (a checkpoint recompute) skips the GEMM, not what backward needs."""
    x, lora_x, weights, biases, lora_a, lora_b = _make(CASES[name])
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    y, grads = _forward_and_grads(lora_linear, x, lora_x, weights, biases, lora_a, lora_b, grad_out)
    skipped, skipped_grads = _forward_and_grads(
        lora_linear, x, lora_x, weights, biases, lora_a, lora_b, grad_out, need_output=False
    )
    assert skipped.shape == y.shape
    for got, want in zip(skipped_grads, grads, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_reference_uses_dequantized_weights():
    case = CASES["qkv_nf4_bias"]
    x, _, weights, biases, lora_a, lora_b = _make(case)
    dense = [dequantize_nf4_reference(w) for w in weights]
    y = lora_linear_reference(x, weights, biases, lora_a, lora_b, 0.5)
    expected = torch.cat(
        [
            x @ w.T + b + 0.5 * (x @ a.T) @ bb.T
            for w, b, a, bb in zip(dense, biases, lora_a, lora_b, strict=True)
        ],
        -1,
    )
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["qkv_nf4_bias", "gate_up_nf4", "gate_up_nf4_dropout"])
def test_backward_redequantizes_into_the_shared_buffer(name):
    """LoRA added to y (qkv), B as extra columns (gate/up), and B with a dropout input."""
    x, lora_x, weights, biases, lora_a, lora_b = _make(CASES[name])
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    buffer = torch.empty(buffer_numel(weights, lora_a) + 10)
    y = lora_linear(x, weights, biases, lora_a, lora_b, 0.5, lora_x, buffer=buffer)
    buffer.fill_(float("nan"))  # another layer used the scratch in between
    grads = torch.autograd.grad(y, _differentiable(x, lora_x, lora_a, lora_b), grad_out)
    _, expected = _forward_and_grads(
        lora_linear_reference, x, lora_x, weights, biases, lora_a, lora_b, grad_out
    )
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bfloat16_activations_keep_fp32_lora_gradients():
    case = CASES["qkv_nf4_bias"]
    x, _, weights, biases, lora_a, lora_b = _make(case, dtype=torch.bfloat16)
    grad_out = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    y, grads = _forward_and_grads(lora_linear, x, None, weights, biases, lora_a, lora_b, grad_out)
    assert y.dtype == torch.bfloat16 and grads[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads[1:])
    x32 = x.detach().float().requires_grad_()
    dense = [dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights]
    biases32 = [b.float() for b in biases]
    expected_y, expected = _forward_and_grads(
        lora_linear_reference, x32, None, dense, biases32, lora_a, lora_b, grad_out.float()
    )
    torch.testing.assert_close(y.float(), expected_y, atol=5e-2, rtol=2e-2)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=2e-2)


def test_reference_path_without_interpreter(reference_ops):
    x, lora_x, weights, biases, lora_a, lora_b = _make(CASES["qkv_plain_partial_lora_dropout"])
    y = lora_linear(x, weights, biases, lora_a, lora_b, 0.5, lora_x)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ != _FUNCTION_NODE
    torch.testing.assert_close(y, lora_linear_reference(x, weights, biases, lora_a, lora_b, 0.5, lora_x))


def test_bad_arguments_are_named():
    x, _, weights, biases, lora_a, lora_b = _make(CASES["qkv_nf4_bias"])
    with pytest.raises(ValueError, match="one entry per projection"):
        lora_linear(x, weights, biases[:2], lora_a, lora_b, 0.5)
    with pytest.raises(ValueError, match="both be given"):
        lora_linear(x, weights, biases, lora_a, [None, *lora_b[1:]], 0.5)
    with pytest.raises(ValueError, match="does not take 32 inputs"):
        lora_linear(x[..., :32], weights, biases, lora_a, lora_b, 0.5)
    assert buffer_numel(weights, lora_a) == 128 * (64 + 3 * 4)
    with pytest.raises(ValueError, match="at least 9728"):
        lora_linear(x, weights, biases, lora_a, lora_b, 0.5, buffer=torch.empty(100))


# ----------------------------------------------------------------------------- split LoRA (the MLP)


def _split_a(function, x, lora_x, weights, biases, lora_a, grad_out, grad_t, **kwargs):
    y, t = function(x, weights, biases, lora_a, lora_x, **kwargs)
    inputs = [x] + ([lora_x] if lora_x is not None else []) + [a for a in lora_a if a is not None]
    return (y, t), torch.autograd.grad((y, t), inputs, (grad_out, grad_t))


@pytest.mark.parametrize("name", ["gate_up_nf4", "gate_up_nf4_dropout", "qkv_plain_partial_lora_dropout"])
@pytest.mark.parametrize("need_output", [True, False])
def test_split_a_matches_reference(name, need_output):
    """y without B and t = lora_x @ A^T; dX and dA from dy and a dt that SwiGLU would give."""
    x, lora_x, weights, biases, lora_a, _ = _make(CASES[name])
    rank = sum(a.shape[0] for a in lora_a if a is not None)
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    grad_t = torch.randn(2, 5, rank)
    (y, t), grads = _split_a(
        lora_linear_a, x, lora_x, weights, biases, lora_a, grad_out, grad_t, need_output=need_output
    )
    (want_y, want_t), want = _split_a(
        lora_linear_a_reference, x, lora_x, weights, biases, lora_a, grad_out, grad_t
    )
    assert type(y.grad_fn).__name__ == f"{LoRAAFunction.__name__}Backward"
    if need_output:
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t, want_t, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want, strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _split_b(function, x, lora_t, weights, biases, lora_b, grad_out, **kwargs):
    y = function(x, lora_t, weights, biases, lora_b, 0.5, **kwargs)
    inputs = [x, lora_t] + [b for b in lora_b if b is not None]
    return y, torch.autograd.grad(y, inputs, grad_out)


@pytest.mark.parametrize("name", ["down_nf4_ragged_rows_dropout", "o_proj_plain", "qkv_nf4_bias"])
@pytest.mark.parametrize("need_output", [True, False])
def test_split_b_matches_reference(name, need_output):
    """y = x @ W^T + bias + s * t @ B^T from a given t: dX, dt and dB, and no x kept."""
    x, _, weights, biases, _, lora_b = _make(CASES[name])
    rank = sum(b.shape[1] for b in lora_b if b is not None)
    lora_t = torch.randn(2, 5, rank, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad_out = torch.randn(2, 5, sum(CASES[name][1]))
    y, grads = _split_b(lora_linear_b, x, lora_t, weights, biases, lora_b, grad_out, need_output=need_output)
    want_y, want = _split_b(lora_linear_b_reference, x, lora_t, weights, biases, lora_b, grad_out)
    assert type(y.grad_fn).__name__ == f"{LoRABFunction.__name__}Backward"
    kept = lora_linear_b(x, lora_t, weights, biases, lora_b, 0.5).grad_fn.saved_tensors
    assert all(saved.data_ptr() != x.data_ptr() for saved in kept)
    if need_output:
        torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want, strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_split_halves_compose_to_the_whole():
    """A-side then B-side with t handed over gives lora_linear's output and gradients."""
    x, _, weights, biases, lora_a, lora_b = _make(CASES["qkv_nf4_bias"])
    grad_out = torch.randn(2, 5, 128)
    inputs = _differentiable(x, None, lora_a, lora_b)
    base, t = lora_linear_a(x, weights, biases, lora_a)
    zero = [torch.zeros_like(w) for w in (dequantize_nf4_reference(w) for w in weights)]
    lora_only = lora_linear_b(torch.zeros_like(x), t, zero, [None] * 3, lora_b, 0.5)
    y = base + lora_only
    whole = lora_linear(x, weights, biases, lora_a, lora_b, 0.5)
    torch.testing.assert_close(y, whole, atol=1e-5, rtol=1e-5)
    for got, want in zip(
        torch.autograd.grad(y, inputs, grad_out), torch.autograd.grad(whole, inputs, grad_out), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_without_lora_is_the_frozen_projection():
    x, _, weights, biases, _, _ = _make(CASES["down_nf4_bias_no_lora"])
    y, t = lora_linear_a(x, weights, biases, [None])
    assert t is None
    torch.testing.assert_close(lora_linear_b(x, None, weights, biases, [None], 0.5), y, atol=0, rtol=0)


def test_split_bad_arguments_are_named():
    x, _, weights, biases, lora_a, lora_b = _make(CASES["qkv_nf4_bias"])
    with pytest.raises(ValueError, match=r"lora_t must be \[\.\.\., 12\]"):
        lora_linear_b(x, torch.zeros(2, 5, 8), weights, biases, lora_b, 0.5)
    with pytest.raises(ValueError, match=r"projection 0: LoRA shapes B \(32, 4\)"):
        lora_linear_b(x, torch.zeros(2, 5, 12), weights, biases, lora_b[::-1], 0.5)
    with pytest.raises(ValueError, match=r"LoRA shapes A \(4, 32\)"):
        lora_linear_a(x, weights, biases, [a[:, :32] for a in lora_a])


# ----------------------------------------------------------------------------- GPU

TOKENS, HIDDEN, INTERMEDIATE, RANK = 4096, 3584, 18944, 16
QWEN_7B_GROUPS = {
    "qkv": (HIDDEN, (HIDDEN, 512, 512), True),
    "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE), False),
    "down": (INTERMEDIATE, (HIDDEN,), False),
}


def _gpu_group(name, seed=0):
    in_features, outs, bias = QWEN_7B_GROUPS[name]
    torch.manual_seed(seed)
    weights = [quantize_nf4((torch.randn(o, in_features, device="cuda") * 0.02).bfloat16()) for o in outs]
    biases = [torch.randn(o, device="cuda").bfloat16() * 0.1 if bias else None for o in outs]
    lora_a = [(torch.randn(RANK, in_features, device="cuda") * 0.02).requires_grad_() for _ in outs]
    lora_b = [(torch.randn(o, RANK, device="cuda") * 0.02).requires_grad_() for o in outs]
    x = torch.randn(TOKENS, in_features, device="cuda").bfloat16().requires_grad_()
    return x, weights, biases, lora_a, lora_b


def _relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@gpu
@pytest.mark.parametrize("name", sorted(QWEN_7B_GROUPS))
def test_gpu_bf16_matches_fp32_reference(name):
    """bf16 with fp32 accumulation against fp32 on the same dequantized weights: relative
    Frobenius error below 1% for y and dX, 2% for dA and dB."""
    x, weights, biases, lora_a, lora_b = _gpu_group(name)
    grad_out = torch.randn(TOKENS, sum(QWEN_7B_GROUPS[name][1]), device="cuda").bfloat16()
    buffer = torch.empty(buffer_numel(weights, lora_a), dtype=torch.bfloat16, device="cuda")
    y, grads = _forward_and_grads(
        lora_linear, x, None, weights, biases, lora_a, lora_b, grad_out, buffer=buffer
    )
    x32 = x.detach().float().requires_grad_()
    dense = [dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights]
    biases32 = [None if b is None else b.float() for b in biases]
    expected_y, expected = _forward_and_grads(
        lora_linear_reference, x32, None, dense, biases32, lora_a, lora_b, grad_out.float()
    )
    assert _relative_error(y, expected_y) < 1e-2
    assert _relative_error(grads[0], expected[0]) < 1e-2
    for got, want in zip(grads[1:], expected[1:], strict=True):
        assert got.dtype == torch.float32 and _relative_error(got, want) < 2e-2


@gpu
@pytest.mark.parametrize("shared_buffer", [True, False])
def test_gpu_memory_holds_nothing_of_weight_size(shared_buffer):
    """gate/up: after forward only y and the small LoRA product stay alive; the peak of
    forward + backward is y + dX (+ the transient scratch when none is shared). The slack holds
    cuBLAS's workspace and the rank-sized tensors: t, A and B in bf16, their fp32 gradients."""
    x, weights, biases, lora_a, lora_b = _gpu_group("gate_up")
    out_features = 2 * INTERMEDIATE
    y_bytes = TOKENS * out_features * 2
    x_bytes = TOKENS * HIDDEN * 2
    weight_bytes = out_features * HIDDEN * 2
    slack = 40 * 2**20
    buffer = (
        torch.empty(buffer_numel(weights, lora_a), dtype=torch.bfloat16, device="cuda")
        if shared_buffer
        else None
    )
    grad_out = torch.randn(TOKENS, out_features, device="cuda").bfloat16()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = lora_linear(x, weights, biases, lora_a, lora_b, 0.5, buffer=buffer)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < y_bytes + slack
    y.backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    scratch = 0 if shared_buffer else weight_bytes
    assert peak < y_bytes + x_bytes + scratch + slack
