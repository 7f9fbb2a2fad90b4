"""FP8 products with frozen NF4 weights: the quantizers against their references, byte for byte,
and the products against fp32 within the bound e4m3's rounding allows."""

from dataclasses import replace

import pytest
import torch
from checkpoints import write_qwen2

from benchmarks.shapes import model_config
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.model.from_config import fp8_problem
from qlora_cli.model.layers import layer_groups
from qlora_cli.sources.model_config import spec_from_config
from qlora_kernels.fp8 import (
    E4M3_MAX,
    fp8_scales,
    nf4_to_e4m3,
    nf4_to_e4m3_reference,
    quantize_rows,
    quantize_rows_reference,
    scaled_matmul_reference,
)
from qlora_kernels.linear import (
    buffer_numel,
    lora_linear,
    lora_linear_a,
    lora_linear_b,
    lora_linear_reference,
)
from qlora_kernels.nf4 import dequantize_nf4_reference, quantize_nf4

gpu = pytest.mark.gpu

# e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself after rounding to
# nearest, a subnormal one (below 2^-6 of the scale's 448) by at most half its step, 2^-10.
RELATIVE = 2.0**-4
SUBNORMAL_STEP = 2.0**-10


def _weights(outs, in_features, double_quant=True, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return [
        quantize_nf4(
            (torch.randn(out, in_features, generator=generator) * 0.05).to(device), double_quant=double_quant
        )
        for out in outs
    ]


def _bytes(tensor):
    return tensor.view(torch.uint8)


def _rows_with_every_range(rows, columns, dtype, device="cpu"):
    """Normal rows, an all-zero row, a row whose values span e4m3's subnormals and one of values
    near fp32's smallest normal one (a masked token's gradient), whose scale's reciprocal must stay finite."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, columns, generator=generator)
    x[1] = 0.0
    x[2] = torch.logspace(-8, 0, columns) * torch.sign(torch.randn(columns, generator=generator))
    x[3] = 1e-37 * torch.sign(torch.randn(columns, generator=generator))
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [100, 3000, 9000])
def test_quantize_rows_kernel_matches_reference(dtype, columns):
    x = _rows_with_every_range(7, columns, dtype)
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(scale, want_scale)
    assert q[1].float().abs().max() == 0 and not q.float().isnan().any()
    tiny = x[3].float()
    assert ((q[3].float() * scale[3] - tiny).abs() <= RELATIVE * tiny.abs() + SUBNORMAL_STEP * scale[3]).all()
    assert (q.float().abs().amax(dim=1)[[0, 2]] == E4M3_MAX).all()
    # A row-strided view (the left columns of a wider tensor) is read through its stride.
    wide = torch.cat([x, x], dim=1)
    strided_q, strided_scale = quantize_rows(wide[:, :columns])
    assert torch.equal(_bytes(strided_q), _bytes(want_q)) and torch.equal(strided_scale, want_scale)


def test_ties_round_to_even_in_the_normal_and_the_subnormal_range():
    """448 makes the scale 1, so the others are rounded as they are: 1 + 1/16 lies halfway between
    1 and 1 + 1/8, 2^-9 * 1.5 halfway between one and two subnormal steps; 3.75 * 2^-9 at 2^-6's
    edge; 0.5 * 2^-9 halfway between 0 and the smallest step; -0 keeps its sign."""
    row = [
        448.0,
        1.0625,
        1.1875,
        -1.0625,
        2.0**-9 * 1.5,
        2.0**-9 * 2.5,
        2.0**-9 * 7.5,
        2.0**-10,
        -(2.0**-10),
        -0.0,
    ]
    x = torch.tensor([row + [0.0] * (16 - len(row))])
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0
    assert torch.equal(_bytes(q), _bytes(x.to(torch.float8_e4m3fn)))
    assert q[0, :4].float().tolist() == [448.0, 1.0, 1.25, -1.0]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(
    "outs,in_features,double_quant", [((64, 32, 32), 128, True), ((48,), 192, False), ((80,), 64, True)]
)
def test_nf4_to_e4m3_kernel_matches_reference(outs, in_features, double_quant, transposed):
    weights = _weights(outs, in_features, double_quant)
    scales = fp8_scales(weights)
    got = nf4_to_e4m3(weights, scales, transposed=transposed)
    want = nf4_to_e4m3_reference(weights, scales, transposed=transposed)
    assert got.shape == ((in_features, sum(outs)) if transposed else (sum(outs), in_features))
    assert torch.equal(_bytes(got), _bytes(want))


def test_weight_scales_reach_e4m3s_largest_value_in_every_channel():
    """A row's scale is its largest block absmax, which NF4 stores exactly (code +-1); a column's
    is the largest over the rows of its block column, so some column of each block reaches 448."""
    weights = _weights((64, 32, 32), 128)
    scales = fp8_scales(weights)
    rows = nf4_to_e4m3(weights, scales, transposed=False).float().abs()
    assert (rows.amax(dim=1) == E4M3_MAX).all()
    columns = nf4_to_e4m3(weights, scales, transposed=True).float().abs()
    assert (columns.view(2, 64, 128).amax(dim=(1, 2)) == E4M3_MAX).all()
    dense = torch.cat([dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights])
    torch.testing.assert_close(scales.row, dense.abs().amax(dim=1) * (1 / E4M3_MAX), atol=0, rtol=0)


def test_shapes_fp8_gemms_cannot_take_are_named():
    with pytest.raises(ValueError, match="do not split into NF4 blocks of 64"):
        fp8_scales(_weights((64,), 96))
    with pytest.raises(ValueError, match="multiples of 16, this group is 40 x 64"):
        fp8_scales(_weights((40,), 64))
    with pytest.raises(ValueError, match="need NF4 weights"):
        fp8_scales([torch.zeros(64, 64)])


def _rounding_bound(x, dense, x_scale, w_scale):
    """|x~ @ w~^T - x @ w^T| elementwise, for x~ = x(1 + e) + d with |e| <= 2^-4 and |d| <= 2^-10 *
    scale, w~ alike, plus fp32's summation error over K terms on both sides."""
    x_error = RELATIVE * x.abs() + SUBNORMAL_STEP * x_scale[:, None]
    w_error = RELATIVE * dense.abs() + SUBNORMAL_STEP * w_scale[:, None]
    rounding = x_error @ (dense.abs() + w_error).T + x.abs() @ w_error.T
    return rounding + 2 * x.shape[1] * 2.0**-24 * (x.abs() @ dense.abs().T) + 1e-6


ENTRY_POINTS = ["lora_linear", "lora_linear_a", "lora_linear_b"]


def _setup(rank=4, tokens=37, seed=3):
    outs, in_features = (64, 32, 32), 128
    weights = _weights(outs, in_features, seed=seed)
    dense = [dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=generator).requires_grad_()
    lora_a = [(torch.randn(rank, in_features, generator=generator) * 0.1).requires_grad_() for _ in outs]
    lora_b = [(torch.randn(out, rank, generator=generator) * 0.1).requires_grad_() for out in outs]
    t = (torch.randn(tokens, rank * len(outs), generator=generator)).requires_grad_()
    grad_out = torch.randn(tokens, sum(outs), generator=generator)
    return weights, dense, x, lora_a, lora_b, t, grad_out


def _run(entry, weights, x, lora_a, lora_b, t, fp8, buffer=None):
    """(y, inputs whose gradients the entry point gives)."""
    biases = [None] * len(weights)
    if entry == "lora_linear":
        y = lora_linear(x, weights, biases, lora_a, lora_b, 0.5, fp8=fp8, buffer=buffer)
        return y, [x, *lora_a, *lora_b]
    if entry == "lora_linear_a":
        y, lora_t = lora_linear_a(x, weights, biases, lora_a, fp8=fp8, buffer=buffer)
        return torch.cat([y, lora_t], dim=1), [x, *lora_a]
    return lora_linear_b(x, t, weights, biases, lora_b, 0.5, fp8=fp8, buffer=buffer), [x, t, *lora_b]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_fp8_products_are_within_e4m3_rounding_of_fp32(entry):
    """The frozen products carry e4m3's error, within its bound; LoRA's products and gradients do
    not (fp32 summation order only): dY reaches B and A unquantized."""
    weights, dense, x, lora_a, lora_b, t, grad_out = _setup()
    scales = fp8_scales(weights)
    grad = grad_out if entry != "lora_linear_a" else torch.cat([grad_out, torch.randn(37, 12)], dim=1)
    y, inputs = _run(entry, weights, x, lora_a, lora_b, t, scales)
    grads = torch.autograd.grad(y, inputs, grad)
    want_y, _ = _run(entry, dense, x, lora_a, lora_b, t, None)
    want_grads = torch.autograd.grad(want_y, inputs, grad)
    stacked = torch.cat(dense)
    x_scale = quantize_rows_reference(x.detach())[1]
    frozen = slice(0, stacked.shape[0])
    forward_bound = _rounding_bound(x.detach(), stacked, x_scale, scales.row)
    assert ((y - want_y)[:, frozen].abs() <= forward_bound + 1e-5).all()
    torch.testing.assert_close(y[:, stacked.shape[0] :], want_y[:, stacked.shape[0] :], atol=1e-5, rtol=1e-5)
    dy = grad[:, frozen]
    dy_scale = quantize_rows_reference(dy)[1]
    input_bound = _rounding_bound(dy, stacked.T, dy_scale, scales.column)
    lora_x_grad = grads[0] - want_grads[0]
    assert (lora_x_grad.abs() <= input_bound + 1e-5).all()
    assert lora_x_grad.abs().max() > 0, "the input gradient went through e4m3"
    for got, want in zip(grads[1:], want_grads[1:], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_products_are_the_products_of_the_quantized_operands():
    """What the bound above cannot see, a scale off by a little: forward and input gradient equal
    the fp32 product of the e4m3 operands times their scales, up to the order of summation."""
    weights, _, x, _, _, _, grad_out = _setup()
    scales = fp8_scales(weights)
    none = [None] * len(weights)
    y = lora_linear(x, weights, none, none, none, 0.0, fp8=scales)
    (dx,) = torch.autograd.grad(y, [x], grad_out)
    x_q, x_scale = quantize_rows_reference(x.detach())
    rows = nf4_to_e4m3_reference(weights, scales, transposed=False)
    torch.testing.assert_close(
        y, scaled_matmul_reference(x_q, x_scale, rows, scales.row), atol=1e-5, rtol=1e-5
    )
    dy_q, dy_scale = quantize_rows_reference(grad_out)
    columns = nf4_to_e4m3_reference(weights, scales, transposed=True)
    want_dx = scaled_matmul_reference(dy_q, dy_scale, columns, scales.column)
    torch.testing.assert_close(dx, want_dx, atol=1e-5, rtol=1e-5)


def test_fp8_keeps_the_bias_and_the_plain_path_elsewhere():
    weights, dense, x, lora_a, lora_b, _, _ = _setup()
    biases = [torch.full((w.shape[0],), 0.25) for w in weights]
    scales = fp8_scales(weights)
    y = lora_linear(x, weights, biases, lora_a, lora_b, 0.5, fp8=scales)
    want = lora_linear_reference(x, dense, biases, lora_a, lora_b, 0.5)
    bound = _rounding_bound(x.detach(), torch.cat(dense), quantize_rows_reference(x.detach())[1], scales.row)
    assert ((y - want).abs() <= bound + 1e-5).all()


@gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_quantizers_match_references(transposed):
    """On the GPU the kernels are compiled and the cast is the hardware's: the same bytes."""
    weights = _weights((512, 128, 128), 512, device="cuda")
    scales = fp8_scales(weights)
    got = nf4_to_e4m3(weights, scales, transposed=transposed)
    assert torch.equal(_bytes(got), _bytes(nf4_to_e4m3_reference(weights, scales, transposed=transposed)))
    x = _rows_with_every_range(300, 4000, torch.bfloat16, device="cuda")
    q, scale = quantize_rows(x)
    want_q, want_scale = quantize_rows_reference(x)
    assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(scale, want_scale)


@gpu
def test_gpu_fp8_product_is_within_e4m3_rounding():
    weights = _weights((1024, 256, 256), 1024, device="cuda")
    dense = torch.cat([dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights])
    scales = fp8_scales(weights)
    x = torch.randn(257, 1024, device="cuda", dtype=torch.bfloat16)
    none = [None] * 3
    y = lora_linear(x, weights, none, none, none, 0.0, fp8=scales)
    want = x.float() @ dense.T
    bound = _rounding_bound(x.float(), dense, quantize_rows_reference(x)[1], scales.row)
    # The bf16 output adds its own rounding, up to 2^-8 (bf16's unit roundoff) of the value.
    assert ((y.float() - want).abs() <= bound + 2.0**-8 * want.abs()).all()


# The entry point the decoder runs each group through: the MLP splits LoRA across gate/up and down.
GROUP_ENTRY = {"gate_up": "lora_linear_a", "down": "lora_linear_b"}


def _family_groups():
    """(entry point, [out, in] of each projection) of every frozen projection group the shipped
    families train."""
    for family in ("qwen2.5-7b", "llama-3.1-8b", "qwen3.5-9b"):
        spec = spec_from_config(model_config(family))
        for kind in sorted(set(spec.layer_types)):
            shapes = spec.projection_shapes(kind)
            for group, names in layer_groups(kind).items():
                entry = GROUP_ENTRY.get(group, "lora_linear")
                yield pytest.param(entry, [shapes[n] for n in names], id=f"{family}-{kind}-{group}")


@gpu
@pytest.mark.parametrize("gradient_scale", [1.0, 1e-6], ids=["unit-gradients", "step-sized-gradients"])
@pytest.mark.parametrize(("entry", "shapes"), list(_family_groups()))
def test_gpu_fp8_products_at_each_familys_groups(entry, shapes, gradient_scale):
    """Each group as the decoder runs it (its entry point, bf16 weights quantized to NF4, a scratch
    buffer shared with the bf16 run, LoRA on every projection) at full size. The frozen forward and the
    input gradient against fp32 products of the same NF4 weights: each e4m3 operand is off by
    2^-4/sqrt(3) rms, the product by sqrt(2) of that, 0.051, and the bf16 output adds 2^-9. LoRA's
    gradients never see e4m3 (dY reaches B and A unquantized), so they are the bf16 run's up to
    bf16's rounding of its rank-sized products, 2^-8 of each value. The errors are relative, so the
    incoming gradient's size changes no bound: it is drawn unit-sized, and as small as a training step's
    (a mean loss over thousands of tokens), where the two rowwise scales' product is near 1e-12."""
    in_features = shapes[0][1]
    outs = [out for out, _ in shapes]
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        quantize_nf4((torch.randn(out, in_features, generator=generator, device="cuda") * 0.02).bfloat16())
        for out in outs
    ]
    dense = torch.cat([dequantize_nf4_reference(replace(w, dtype=torch.float32)) for w in weights])
    rank, tokens = 16, 2048

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).bfloat16()

    x, t = draw(tokens, in_features), draw(tokens, rank * len(outs))
    x[5] = 0.0  # a padded token
    lora_a = [draw(rank, in_features, scale=0.01) for _ in outs]
    lora_b = [draw(out, rank, scale=0.01) for out in outs]
    width = sum(outs) + (rank * len(outs) if entry == "lora_linear_a" else 0)
    grad = draw(tokens, width, scale=gradient_scale)
    grad[: tokens // 8] = 0.0  # masked labels: tokens without gradient
    buffer = torch.empty(buffer_numel(weights, lora_a), dtype=torch.bfloat16, device="cuda")
    runs = {}
    for name, scales in (("fp8", fp8_scales(weights)), ("bf16", None)):
        inputs = [tensor.clone().requires_grad_() for tensor in (x, t, *lora_a, *lora_b)]
        x_, t_, a_, b_ = inputs[0], inputs[1], inputs[2 : 2 + len(outs)], inputs[2 + len(outs) :]
        y, wrt = _run(entry, weights, x_, a_, b_, t_, scales, buffer)
        runs[name] = (y, torch.autograd.grad(y, wrt, grad))
    (y, grads), (bf16_y, bf16_grads) = runs["fp8"], runs["bf16"]
    # LoRA's terms are the same in both runs, so their difference is the frozen products' alone.
    frozen = slice(0, sum(outs))
    products = {
        "forward": (y[:, frozen] - bf16_y[:, frozen], x.float() @ dense.T),
        "input gradient": (grads[0] - bf16_grads[0], grad[:, frozen].float() @ dense),
    }
    # bf16's own products are off by about 2^-9 of fp32's; e4m3's by the 0.051 above.
    bound = 2**0.5 * 2.0**-4 / 3**0.5 + 2.0**-8
    for name, (difference, product) in products.items():
        assert torch.isfinite(difference).all(), f"{name} of {entry}: non-finite values"
        error = float(difference.float().norm() / product.norm())
        assert 0 < error < bound, f"{name} of {entry}: relative error {error:.3g}, bound {bound:.3g}"
    for index, (got, expected) in enumerate(zip(grads[1:], bf16_grads[1:], strict=True), 1):
        assert torch.isfinite(got).all(), f"gradient {index} of {entry}: non-finite values"
        error = float((got.float() - expected.float()).norm() / expected.float().norm())
        assert error < 2.0**-7, f"gradient {index} of {entry}: {error:.3g} from the bf16 run's"


def test_gpus_without_fp8_tensor_cores_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    problem = fp8_problem(torch.device("cuda"))
    assert problem.endswith("cuda is NVIDIA A100-SXM4-80GB, compute capability 8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_problem(torch.device("cuda")) is None
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "lacks" in fp8_problem(torch.device("cuda"))


def test_a_model_whose_projections_fp8_cannot_take_is_named(tmp_path):
    """The tiny Qwen2's MLP is 96 wide: its down projection's 96 inputs are not whole NF4 blocks."""
    model = QLoRAModel.from_pretrained(write_qwen2(tmp_path / "tiny"), lora=LoRAConfig(r=4))
    with pytest.raises(ValueError, match="layer 0 down: 96 inputs do not split into NF4 blocks of 64"):
        model.use_fp8()
    wide = QLoRAModel.from_pretrained(
        write_qwen2(tmp_path / "wide", intermediate_size=128), lora=LoRAConfig(r=4)
    )
    wide.use_fp8()
    assert all(group.fp8 is not None for layer in wide.layers for group in layer.projections.values())
