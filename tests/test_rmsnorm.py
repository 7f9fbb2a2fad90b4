"""RMSNorm and fused residual-add + RMSNorm: Triton path (interpreter on CPU) against the reference."""

import pytest
import torch

from qlora_kernels.rmsnorm import (
    AddRMSNormFunction,
    GatedRMSNormFunction,
    RMSNormFunction,
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

EPS = 1e-6


def _activations(layout: str, hidden: int, generator: torch.Generator, dtype=torch.float32, device="cpu"):
    """(leaf, input): 'strided' has non-contiguous leading dims, 'sliced' rows wider than hidden."""
    if layout == "rows":
        base = torch.randn(3, hidden, generator=generator, dtype=dtype, device=device)
        return base.requires_grad_(True), base
    if layout == "batched":
        base = torch.randn(2, 3, hidden, generator=generator, dtype=dtype, device=device)
        return base.requires_grad_(True), base
    if layout == "sliced":
        base = torch.randn(3, hidden + 8, generator=generator, dtype=dtype, device=device).requires_grad_(
            True
        )
        return base, base[:, 4 : 4 + hidden]
    base = torch.randn(3, 2, hidden, generator=generator, dtype=dtype, device=device).requires_grad_(True)
    return base, base.transpose(0, 1)


def _gradient(like: torch.Tensor, layout: str, generator: torch.Generator) -> torch.Tensor:
    """An incoming gradient; 'sliced' gets rows wider than hidden, as kernels.linear returns dX."""
    if layout == "sliced":
        wide = torch.randn(*like.shape[:-1], like.shape[-1] + 8, generator=generator)
        return wide[..., 4 : 4 + like.shape[-1]]
    return torch.randn(like.shape, generator=generator)


def _weight(hidden: int, requires_grad: bool, generator: torch.Generator, dtype=torch.float32, device="cpu"):
    weight = 1.0 + 0.1 * torch.randn(hidden, generator=generator, dtype=dtype, device=device)
    return weight.requires_grad_(requires_grad)


def _outputs_and_grads(fn, leaves, out_grads):
    outputs = fn()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = torch.autograd.grad(outputs, leaves, out_grads)
    return outputs, grads


def _assert_all_close(actual, expected, atol, rtol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("layout", ["rows", "batched", "strided", "sliced"])
@pytest.mark.parametrize("hidden", [48, 72])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_rms_norm_matches_reference(layout, hidden, weight_grad):
    generator = torch.Generator().manual_seed(0)
    leaf, x = _activations(layout, hidden, generator)
    weight = _weight(hidden, weight_grad, generator)
    dy = _gradient(x, layout, generator)
    leaves = [leaf, weight] if weight_grad else [leaf]

    out, grads = _outputs_and_grads(lambda: rms_norm(x, weight, EPS), leaves, (dy,))
    ref_out, ref_grads = _outputs_and_grads(lambda: rms_norm_reference(x, weight, EPS), leaves, (dy,))

    assert out[0].grad_fn.name().startswith(RMSNormFunction.__name__)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["rows", "batched", "strided", "sliced"])
@pytest.mark.parametrize("hidden", [48, 72])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_add_rms_norm_matches_reference(layout, hidden, weight_grad):
    generator = torch.Generator().manual_seed(1)
    x_leaf, x = _activations(layout, hidden, generator)
    residual_leaf, residual = _activations(layout, hidden, generator)
    weight = _weight(hidden, weight_grad, generator)
    dy = _gradient(x, layout, generator)
    dsummed = _gradient(x, layout, generator)
    leaves = [x_leaf, residual_leaf, weight] if weight_grad else [x_leaf, residual_leaf]

    out, grads = _outputs_and_grads(lambda: add_rms_norm(x, residual, weight, EPS), leaves, (dy, dsummed))
    ref_out, ref_grads = _outputs_and_grads(
        lambda: add_rms_norm_reference(x, residual, weight, EPS), leaves, (dy, dsummed)
    )

    assert out[0].grad_fn.name().startswith(AddRMSNormFunction.__name__)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_without_residual_passes_input_through():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 48, generator=generator).requires_grad_(True)
    weight = _weight(48, True, generator)
    dy, dsummed = torch.randn(2, 2, 3, 48, generator=generator)

    out, grads = _outputs_and_grads(lambda: add_rms_norm(x, None, weight, EPS), [x, weight], (dy, dsummed))
    ref_out, ref_grads = _outputs_and_grads(
        lambda: add_rms_norm_reference(x, None, weight, EPS), [x, weight], (dy, dsummed)
    )

    assert out[1] is x
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_residual", [False, True])
def test_eps_where_the_mean_square_is_near_it_and_on_an_all_zero_row(with_residual):
    """Rows whose mean square is about eps, far below it, and zero, where eps sets the scale: an eps
    dropped, squared or added outside the square root moves the output or the gradient by 30 % or
    more (a zero row's gradient is dy * w / sqrt(eps)). fp32 sums of 48 terms stay within 1e-5 of
    the largest value."""
    generator = torch.Generator().manual_seed(5)
    scale = torch.tensor([[1.0], [0.3], [1e-3], [0.0]]) * EPS**0.5
    x = (torch.randn(4, 48, generator=generator) * scale).requires_grad_(True)
    residual = (torch.randn(4, 48, generator=generator) * scale).requires_grad_(True)
    with torch.no_grad():
        residual[3] = -x[3]  # x + residual is zero there too
    weight = _weight(48, True, generator)
    dy, dsummed = torch.randn(2, 4, 48, generator=generator)
    if with_residual:
        leaves, out_grads = [x, residual, weight], (dy, dsummed)
        out, grads = _outputs_and_grads(lambda: add_rms_norm(x, residual, weight, EPS), leaves, out_grads)
        ref_out, ref_grads = _outputs_and_grads(
            lambda: add_rms_norm_reference(x, residual, weight, EPS), leaves, out_grads
        )
    else:
        leaves, out_grads = [x, weight], (dy,)
        out, grads = _outputs_and_grads(lambda: rms_norm(x, weight, EPS), leaves, out_grads)
        ref_out, ref_grads = _outputs_and_grads(lambda: rms_norm_reference(x, weight, EPS), leaves, out_grads)
    assert torch.equal(out[0][3], torch.zeros(48))
    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert torch.isfinite(actual).all()
        _assert_close_to_max(actual, expected, 1e-5)


def test_reference_path_without_interpreter(reference_ops):
    generator = torch.Generator().manual_seed(3)
    x, residual = torch.randn(2, 3, 48, generator=generator)
    weight = _weight(48, True, generator)
    y, summed = add_rms_norm(x, residual, weight, EPS)
    ref_y, ref_summed = add_rms_norm_reference(x, residual, weight, EPS)
    assert "AddRMSNorm" not in y.grad_fn.name()
    torch.testing.assert_close(y, ref_y, atol=0, rtol=0)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)


def test_reference_matches_transformers():
    modeling_qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 72, generator=generator)
    hf_norm = modeling_qwen2.Qwen2RMSNorm(72, eps=EPS)
    with torch.no_grad():
        hf_norm.weight.copy_(_weight(72, False, generator))
        torch.testing.assert_close(rms_norm_reference(x, hf_norm.weight, EPS), hf_norm(x), atol=0, rtol=0)


def _zero_centred_weight(hidden: int, requires_grad: bool, generator, dtype=torch.float32, device="cpu"):
    """Near 0, as Qwen3.5 stores it: scaling by w instead of (1 + w) would all but zero the output."""
    weight = 0.1 * torch.randn(hidden, generator=generator, dtype=dtype, device=device)
    return weight.requires_grad_(requires_grad)


@pytest.mark.parametrize("layout", ["batched", "strided", "sliced"])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_zero_centred_matches_reference(layout, with_residual, weight_grad):
    generator = torch.Generator().manual_seed(5)
    x_leaf, x = _activations(layout, 72, generator)
    residual_leaf, residual = _activations(layout, 72, generator)
    weight = _zero_centred_weight(72, weight_grad, generator)
    dy = _gradient(x, layout, generator)
    dsummed = _gradient(x, layout, generator)
    leaves = [x_leaf, residual_leaf] if with_residual else [x_leaf]
    leaves += [weight] if weight_grad else []
    residual = residual if with_residual else None

    out, grads = _outputs_and_grads(
        lambda: add_rms_norm(x, residual, weight, EPS, zero_centred=True), leaves, (dy, dsummed)
    )
    ref_out, ref_grads = _outputs_and_grads(
        lambda: add_rms_norm_reference(x, residual, weight, EPS, zero_centred=True), leaves, (dy, dsummed)
    )

    function = AddRMSNormFunction if with_residual else RMSNormFunction
    assert out[0].grad_fn.name().startswith(function.__name__)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_zero_centred_reference_matches_transformers():
    """bf16 input: Qwen3.5 multiplies by (1 + w) in fp32 before its one cast, unlike Qwen2."""
    modeling_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4, 8, 72, generator=generator).bfloat16()
    hf_norm = modeling_qwen3_5.Qwen3_5RMSNorm(72, eps=EPS)
    with torch.no_grad():
        hf_norm.weight.copy_(_zero_centred_weight(72, False, generator))
        ours = rms_norm_reference(x, hf_norm.weight, EPS, zero_centred=True)
        torch.testing.assert_close(ours, hf_norm(x), atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["batched", "strided", "sliced"])
@pytest.mark.parametrize("hidden", [40, 64])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_gated_rms_norm_matches_reference(layout, hidden, weight_grad):
    generator = torch.Generator().manual_seed(7)
    x_leaf, x = _activations(layout, hidden, generator)
    gate_leaf, gate = _activations(layout, hidden, generator)
    weight = _weight(hidden, weight_grad, generator)
    dy = _gradient(x, layout, generator)
    leaves = [x_leaf, gate_leaf, weight] if weight_grad else [x_leaf, gate_leaf]
    _assert_gated_matches_reference(x, gate, weight, leaves, dy)


def _assert_gated_matches_reference(x, gate, weight, leaves, dy, saved=None):
    """The kernel's output and gradients against the reference's; `saved` collects what it saves."""
    keep = (lambda t: saved.append(t) or t) if saved is not None else (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out, grads = _outputs_and_grads(lambda: gated_rms_norm(x, gate, weight, EPS), leaves, (dy,))
    ref_out, ref_grads = _outputs_and_grads(
        lambda: gated_rms_norm_reference(x, gate, weight, EPS), leaves, (dy,)
    )
    assert out[0].grad_fn.name().startswith(GatedRMSNormFunction.__name__)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_gated_rms_norm_reads_a_gate_sliced_from_a_projection_in_place():
    """The Gated DeltaNet's gate is z, columns of in_proj's output in rows of heads: the norm reads it
    by its token and head strides and keeps it as it is, not a copy per head (the planner counts it
    once, with in_proj's output)."""
    generator = torch.Generator().manual_seed(5)
    batch, seq, heads, head_dim = 2, 5, 3, 16
    projected = torch.randn(batch, seq, 2 * heads * head_dim + 7, generator=generator, requires_grad=True)
    gate = projected[..., heads * head_dim + 3 : 2 * heads * head_dim + 3].reshape(
        batch, seq, heads, head_dim
    )
    x = torch.randn(batch, seq, heads, head_dim, generator=generator, requires_grad=True)
    weight = _weight(head_dim, True, generator)
    dy = torch.randn(x.shape, generator=generator)
    leaves = [x, projected, weight]
    saved = []
    _assert_gated_matches_reference(x, gate, weight, leaves, dy, saved)
    inputs = {t.untyped_storage().data_ptr() for t in (x, projected, weight)}
    copies = [t.shape for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert copies == [(batch * seq * heads,)]  # the fp32 inverse RMS a row, nothing else


def test_gated_rms_norm_refuses_a_gate_of_another_shape():
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="gate must match x"):
        gated_rms_norm(x, torch.randn(2, 3, 8), torch.ones(16), EPS)


def test_gated_reference_matches_transformers():
    """bf16 input, fp32 weight as transformers keeps it: norm, cast, weight, then silu(gate) in fp32."""
    modeling_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    generator = torch.Generator().manual_seed(8)
    x, gate = torch.randn(2, 4, 8, 40, generator=generator).bfloat16()
    hf_norm = modeling_qwen3_5.Qwen3_5RMSNormGated(40, eps=EPS)
    with torch.no_grad():
        hf_norm.weight.copy_(_weight(40, False, generator))
        ours = gated_rms_norm_reference(x, gate, hf_norm.weight, EPS)
        torch.testing.assert_close(ours, hf_norm(x, gate), atol=0, rtol=0)


def _assert_close_to_max(actual: torch.Tensor, expected: torch.Tensor, tol: float):
    """Max abs error within tol of the reference's largest magnitude: bf16 storage vs fp32 math."""
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= tol * scale, f"max error {error:.3e} > {tol} * {scale:.3e}"


# Qwen2.5-7B: hidden 3584, 2 x 2048 tokens. bf16 output and gradients are within 1% of the largest
# fp32 reference value (bf16 keeps 8 mantissa bits: 0.4% per rounding, two roundings at most).
BF16_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_bf16_against_fp32_reference(with_residual):
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape, hidden = (2, 2048, 3584), 3584
    x = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    residual = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    weight = _weight(hidden, True, generator, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(shape, generator=generator, device="cuda").bfloat16()
    dsummed = torch.randn(shape, generator=generator, device="cuda").bfloat16()
    leaves = [x, residual, weight] if with_residual else [x, weight]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]

    if with_residual:
        out, grads = _outputs_and_grads(lambda: add_rms_norm(x, residual, weight, EPS), leaves, (dy, dsummed))
        ref_out, ref_grads = _outputs_and_grads(
            lambda: add_rms_norm_reference(*ref_leaves, EPS), ref_leaves, (dy.float(), dsummed.float())
        )
    else:
        out, grads = _outputs_and_grads(lambda: rms_norm(x, weight, EPS), leaves, (dy,))
        ref_out, ref_grads = _outputs_and_grads(
            lambda: rms_norm_reference(*ref_leaves, EPS), ref_leaves, (dy.float(),)
        )

    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        _assert_close_to_max(actual, expected, BF16_TOL)


# Qwen3.5-9B decoder norms: hidden 4096, zero-centred, 2 x 2048 tokens; same 1% bound as above.
@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_zero_centred_bf16_against_fp32_reference(with_residual):
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape, hidden = (2, 2048, 4096), 4096
    x = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    residual = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    weight = _zero_centred_weight(hidden, True, generator, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(shape, generator=generator, device="cuda").bfloat16()
    dsummed = torch.randn(shape, generator=generator, device="cuda").bfloat16()
    leaves = [x, residual, weight] if with_residual else [x, weight]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    residuals = (residual, ref_leaves[1]) if with_residual else (None, None)
    out_grads = (dy, dsummed)

    out, grads = _outputs_and_grads(
        lambda: add_rms_norm(x, residuals[0], weight, EPS, zero_centred=True), leaves, out_grads
    )
    ref_out, ref_grads = _outputs_and_grads(
        lambda: add_rms_norm_reference(ref_leaves[0], residuals[1], ref_leaves[-1], EPS, zero_centred=True),
        ref_leaves,
        tuple(g.float() for g in out_grads),
    )

    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        _assert_close_to_max(actual, expected, BF16_TOL)


# Qwen3.5-9B Gated DeltaNet output: 32 value heads of head_v_dim 128, 2 x 2048 tokens; same 1% bound.
@pytest.mark.gpu
def test_gpu_gated_bf16_against_fp32_reference():
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape, head_v_dim = (2, 2048, 32, 128), 128
    x = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    gate = torch.randn(shape, generator=generator, device="cuda").bfloat16().requires_grad_(True)
    weight = _weight(head_v_dim, True, generator, dtype=torch.float32, device="cuda")
    dy = torch.randn(shape, generator=generator, device="cuda").bfloat16()
    leaves = [x, gate, weight]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]

    out, grads = _outputs_and_grads(lambda: gated_rms_norm(x, gate, weight, EPS), leaves, (dy,))
    ref_out, ref_grads = _outputs_and_grads(
        lambda: gated_rms_norm_reference(*ref_leaves, EPS), ref_leaves, (dy.float(),)
    )

    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert actual.dtype == (torch.float32 if actual.shape == weight.shape else torch.bfloat16)
        _assert_close_to_max(actual, expected, BF16_TOL)


@pytest.mark.parametrize("norm", ["plain", "residual", "gated"])
@pytest.mark.parametrize("hidden", [40, 64])
def test_many_short_rows_in_tiles_match_reference(norm, hidden):
    """Rows of a short norm go ROWS to a tile (64 at these widths): 600 rows give a partial last tile
    in the forward, and backward programs that walk four tiles each, the last cut short, summing dW."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(600, hidden, generator=generator, requires_grad=True)
    other = torch.randn(600, hidden, generator=generator, requires_grad=True)
    weight = _weight(hidden, True, generator)
    dy = torch.randn(600, hidden, generator=generator)
    calls = {
        "plain": (lambda: rms_norm(x, weight, EPS), lambda: rms_norm_reference(x, weight, EPS)),
        "residual": (
            lambda: add_rms_norm(x, other, weight, EPS)[0],
            lambda: add_rms_norm_reference(x, other, weight, EPS)[0],
        ),
        "gated": (
            lambda: gated_rms_norm(x, other, weight, EPS),
            lambda: gated_rms_norm_reference(x, other, weight, EPS),
        ),
    }
    leaves = [x, weight] if norm == "plain" else [x, other, weight]
    out, grads = _outputs_and_grads(calls[norm][0], leaves, (dy,))
    ref_out, ref_grads = _outputs_and_grads(calls[norm][1], leaves, (dy,))
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    # dW sums 600 products of about unit size in another order than the reference's: fp32 rounding
    # of a sum near 25 moves it by up to about 600 x 6e-8 x 25, 1e-3 relative at worst, ~1e-4 typical.
    _assert_all_close(grads, ref_grads, atol=1e-4, rtol=1e-5)
