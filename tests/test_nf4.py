"""NF4 quantize / dequantize: known answers from bitsandbytes, Triton against the reference.

The known-answer vectors were produced by bitsandbytes 0.50.2 (`quantize_4bit(w, blocksize=64,
quant_type="nf4", compress_statistics=True)` and `QuantState.as_dict(packed=True)`) on the
bfloat16 weights built by `_known_weight`; every value there is exact in bfloat16.

Triton's interpreter truncates float32 -> bfloat16 where GPUs round to nearest even, so on the
CPU bfloat16 outputs of the Triton path are compared as float32 outputs rounded by torch.
"""

import hashlib
import json
import os

import pytest
import torch

from qlora_kernels.nf4 import (
    DYNAMIC_MAP,
    NF4_CODE,
    NF4Weight,
    dequantize_absmax_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    quantize_nf4,
    quantize_nf4_reference,
)

gpu = pytest.mark.gpu


def _known_weight(rows, cols, multiplier, modulus, divisor, row_scales):
    k = torch.arange(rows * cols, dtype=torch.float32)
    w = ((k * multiplier) % modulus - modulus // 2) / divisor
    return (w.reshape(rows, cols) * torch.tensor(row_scales)[:, None]).to(torch.bfloat16)


KNOWN = {
    "four_blocks": {
        "weight": (4, 64, 37, 101, 32, [1.0, 0.25, 2.0, 0.5]),
        "packed": "04c16e29f3b05d17e29f3c05d18e2af4c16e18e3b05d17e29f3b05d18e2af4c16d18e3b04c17e29f3b05d17e2af4c06d18e2a"
        "04c16e29f3b05d17e29f3c05d18e2af4c16e18e3b05d17e29f3b05d18e2af4c16d18e3b04c17e29f3b05d17e2af4c06d18e2a"
        "04c16e29f3b05d17e29f3c05d18e2af4c16e18e3b05d17e29f3b05",
        "absmax_codes": [176, 25, 255, 41],
        "nested_absmax": [1.66015625],
        "offset": 1.46484375,
        "plain_absmax": [1.5625, 0.390625, 3.125, 0.78125],
        "json": '{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [4, 64], '
        '"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 1.46484375}',
        "dequantized_first4": [
            [-1.5625, -0.4453125, 0.6875, -1.0859375],
            [-0.036376953125, 0.224609375, -0.279296875, 0.03173828125],
            [2.265625, -1.640625, 0.76953125, 3.125],
            [-0.2197265625, 0.341796875, -0.7734375, -0.0703125],
        ],
    },
    "odd_tail": {
        "weight": (3, 25, 29, 67, 16, [1.0, 4.0, 0.5]),
        "packed": "479695847a695857a696857a6e2c19f5e3c1906e3d1a07e4d276787868679786c1906e3c1a07",
        "absmax_codes": [255, 0],
        "nested_absmax": [3.609375],
        "offset": 4.640625,
        "plain_absmax": [8.25, 1.03125],
        "json": '{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [3, 25], '
        '"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 4.640625}',
        "dequantized_first4": [
            [-2.34375, 0.0, 1.328125, -0.75],
            [5.96875, -4.34375, 3.640625, -5.75],
            [0.0, -0.75, 0.0, 0.65625],
        ],
    },
}

QUANTIZERS = {"reference": quantize_nf4_reference, "triton": quantize_nf4}


def _dequantize_float32(weight: NF4Weight, path: str) -> torch.Tensor:
    as_float = NF4Weight(
        weight.packed, weight.absmax, weight.nested_absmax, weight.nested_offset, weight.shape, torch.float32
    )
    return dequantize_nf4_reference(as_float) if path == "reference" else dequantize_nf4(as_float)


def _bnb_state_dict(case: dict, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors bitsandbytes writes for the case, rebuilt from the recorded values."""
    key = f"{prefix}.weight"
    return {
        key: torch.tensor(list(bytes.fromhex(case["packed"])), dtype=torch.uint8).reshape(-1, 1),
        f"{key}.absmax": torch.tensor(case["absmax_codes"], dtype=torch.uint8),
        f"{key}.quant_map": NF4_CODE.clone(),
        f"{key}.nested_absmax": torch.tensor(case["nested_absmax"]),
        f"{key}.nested_quant_map": DYNAMIC_MAP.clone(),
        f"{key}.quant_state.bitsandbytes__nf4": torch.tensor(list(case["json"].encode()), dtype=torch.uint8),
    }


def test_dynamic_map_matches_bitsandbytes():
    assert DYNAMIC_MAP.shape == (256,)
    assert torch.all(DYNAMIC_MAP[1:] >= DYNAMIC_MAP[:-1])
    digest = hashlib.sha256(DYNAMIC_MAP.numpy().tobytes()).hexdigest()
    assert digest == "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c"


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_quantize_matches_bitsandbytes(name, path):
    case = KNOWN[name]
    weight = _known_weight(*case["weight"])
    quantized = QUANTIZERS[path](weight)
    assert bytes(quantized.packed.tolist()).hex() == case["packed"]
    assert quantized.absmax.dtype == torch.uint8
    assert quantized.absmax.tolist() == case["absmax_codes"]
    assert quantized.nested_absmax.tolist() == case["nested_absmax"]
    assert quantized.nested_offset == case["offset"]
    plain = QUANTIZERS[path](weight, double_quant=False)
    assert torch.equal(plain.packed, quantized.packed)
    assert plain.absmax.tolist() == case["plain_absmax"] and plain.nested_absmax is None


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_dequantize_bitsandbytes_state(name, path):
    case = KNOWN[name]
    loaded = NF4Weight.from_state_dict(_bnb_state_dict(case, "layer.q_proj"), "layer.q_proj")
    assert loaded.shape == torch.Size(case["weight"][:2]) and loaded.dtype == torch.bfloat16
    dequantized = _dequantize_float32(loaded, path).to(torch.bfloat16)
    assert dequantized[:, :4].float().tolist() == case["dequantized_first4"]
    if path == "reference":
        assert torch.equal(dequantize_nf4_reference(loaded), dequantized)


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_state_dict_names_and_quant_state(name):
    case = KNOWN[name]
    quantized = quantize_nf4_reference(_known_weight(*case["weight"]))
    tensors = quantized.state_dict("model.layers.0.mlp.down_proj")
    expected = _bnb_state_dict(case, "model.layers.0.mlp.down_proj")
    assert sorted(tensors) == sorted(expected)
    for key, tensor in expected.items():
        assert tensors[key].dtype == tensor.dtype and torch.equal(tensors[key], tensor), key
    restored = NF4Weight.from_state_dict(tensors, "model.layers.0.mlp.down_proj")
    assert torch.equal(restored.packed, quantized.packed) and torch.equal(restored.absmax, quantized.absmax)
    assert torch.equal(restored.nested_absmax, quantized.nested_absmax)
    assert (restored.nested_offset, restored.shape, restored.dtype) == (
        quantized.nested_offset,
        quantized.shape,
        quantized.dtype,
    )


def test_state_dict_without_double_quant():
    quantized = quantize_nf4_reference(torch.randn(8, 64), double_quant=False)
    tensors = quantized.state_dict("p")
    assert sorted(tensors) == [
        "p.weight",
        "p.weight.absmax",
        "p.weight.quant_map",
        "p.weight.quant_state.bitsandbytes__nf4",
    ]
    fields = json.loads(bytes(tensors["p.weight.quant_state.bitsandbytes__nf4"].tolist()))
    assert fields == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [8, 64]}
    restored = NF4Weight.from_state_dict(tensors, "p")
    assert not restored.double_quant and torch.equal(
        dequantize_nf4_reference(restored), dequantize_nf4_reference(quantized)
    )


def test_from_state_dict_refuses_other_formats():
    tensors = quantize_nf4_reference(torch.randn(2, 64)).state_dict("p")
    fp4 = dict(tensors)
    fp4["p.weight.quant_state.bitsandbytes__fp4"] = fp4.pop("p.weight.quant_state.bitsandbytes__nf4")
    with pytest.raises(ValueError, match="bitsandbytes__nf4"):
        NF4Weight.from_state_dict(fp4, "p")
    wrong_map = dict(tensors, **{"p.weight.quant_map": torch.linspace(-1, 1, 16)})
    with pytest.raises(ValueError, match="quant_map"):
        NF4Weight.from_state_dict(wrong_map, "p")
    short = dict(tensors, **{"p.weight.absmax": tensors["p.weight.absmax"][:1]})
    with pytest.raises(ValueError, match="absmax"):
        NF4Weight.from_state_dict(short, "p")


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_high_nibble_holds_even_element(path):
    weight = NF4_CODE[[15, 0, 7, 3, 12, 9]].repeat(11)[:64].reshape(1, 64) * 2.0
    quantized = QUANTIZERS[path](weight, double_quant=False)
    assert quantized.packed[:3].tolist() == [0xF0, 0x73, 0xC9]
    assert torch.equal(_dequantize_float32(quantized, path), weight)


@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_error_bound(double_quant):
    torch.manual_seed(0)
    weight = torch.randn(32, 192) * torch.logspace(-2, 0, 32)[:, None]
    quantized = quantize_nf4_reference(weight, double_quant=double_quant)
    exact_absmax = weight.reshape(-1, 64).abs().amax(dim=1)
    absmax = dequantize_absmax_reference(quantized)
    if double_quant:
        # The nearest of the 8-bit dynamic codes is within 0.8% of the nested block absmax.
        assert torch.all((absmax - exact_absmax).abs() <= 0.008 * quantized.nested_absmax[0])
    else:
        assert torch.equal(absmax, exact_absmax)
    half_gap = ((NF4_CODE[1:] - NF4_CODE[:-1]) / 2).max()
    error = (dequantize_nf4_reference(quantized) - weight).reshape(-1, 64).abs()
    bound = exact_absmax * half_gap + (absmax - exact_absmax).abs() + 1e-6
    assert torch.all(error <= bound[:, None])


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(
    ("shape", "dtype"), [((96, 128), torch.float32), ((40, 88), torch.bfloat16), ((7, 37), torch.float16)]
)
def test_triton_matches_reference(shape, dtype, double_quant):
    torch.manual_seed(1)
    weight = (torch.randn(shape) * 0.05).to(dtype)
    ours = quantize_nf4(weight, double_quant=double_quant)
    reference = quantize_nf4_reference(weight, double_quant=double_quant)
    assert ours.packed.shape == ((weight.numel() + 1) // 2,)
    assert torch.equal(ours.packed, reference.packed) and torch.equal(ours.absmax, reference.absmax)
    if double_quant:
        assert torch.equal(ours.nested_absmax, reference.nested_absmax)
        assert ours.nested_offset == reference.nested_offset
    assert torch.equal(_dequantize_float32(ours, "triton"), _dequantize_float32(reference, "reference"))
    if dtype == torch.float32:
        assert torch.equal(dequantize_nf4(ours), dequantize_nf4_reference(reference))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_all_zero_block_takes_code_zero_like_bitsandbytes_cuda(path):
    weight = torch.randn(3, 64)
    weight[1] = 0.0
    quantized = QUANTIZERS[path](weight, double_quant=False)
    assert quantized.packed[32:64].tolist() == [0] * 32
    assert quantized.absmax[1] == 0.0
    assert torch.all(_dequantize_float32(quantized, path)[1] == 0.0)


def test_dequantize_into_shared_buffer():
    quantized = quantize_nf4(torch.randn(4, 64))
    buffer = torch.full((1000,), float("nan"))
    view = dequantize_nf4(quantized, out=buffer)
    assert view.shape == (4, 64) and view.data_ptr() == buffer.data_ptr()
    assert torch.equal(view, dequantize_nf4_reference(quantized))
    assert torch.isnan(buffer[256:]).all()
    with pytest.raises(ValueError, match="at least 256"):
        dequantize_nf4(quantized, out=torch.empty(100))
    with pytest.raises(ValueError, match="float32"):
        dequantize_nf4(quantized, out=torch.empty(256, dtype=torch.bfloat16))


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_dequantize_into_rows_of_a_wider_matrix(path, monkeypatch):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    quantized = quantize_nf4_reference(torch.randn(5, 128))
    wide = torch.full((5, 128 + 7), float("nan"))
    result = dequantize_nf4(quantized, out=wide[:, :128])
    assert result.data_ptr() == wide.data_ptr()
    assert torch.equal(wide[:, :128], dequantize_nf4_reference(quantized))
    assert torch.isnan(wide[:, 128:]).all()


def test_public_functions_take_the_reference_without_interpreter(reference_ops):
    assert os.environ["TRITON_INTERPRET"] == "0"
    weight = torch.randn(6, 64)
    quantized = quantize_nf4(weight)
    assert torch.equal(dequantize_nf4(quantized), dequantize_nf4_reference(quantize_nf4_reference(weight)))


def test_to_moves_every_tensor():
    quantized = quantize_nf4_reference(torch.randn(2, 64)).to("cpu")
    assert {t.device.type for t in (quantized.packed, quantized.absmax, quantized.nested_absmax)} == {"cpu"}


# ----------------------------------------------------------------------------- GPU

QWEN_7B_SHAPES = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]


@gpu
@pytest.mark.parametrize("shape", QWEN_7B_SHAPES)
def test_gpu_quantize_dequantize_match_reference_bitwise(shape):
    torch.manual_seed(0)
    weight = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    ours = quantize_nf4(weight)
    reference = quantize_nf4_reference(weight)
    assert torch.equal(ours.packed, reference.packed)
    assert torch.equal(ours.absmax, reference.absmax)
    assert torch.equal(ours.nested_absmax, reference.nested_absmax)
    assert ours.nested_offset == reference.nested_offset
    assert torch.equal(dequantize_nf4(ours), dequantize_nf4_reference(reference))
    buffer = torch.empty(weight.numel() + 64, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(dequantize_nf4(ours, out=buffer), dequantize_nf4_reference(reference))


@gpu
def test_gpu_matches_bitsandbytes_cuda():
    functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    weight = (torch.randn(3584, 3584, device="cuda") * 0.02).to(torch.bfloat16)
    weight[0, :64] = 0.0
    packed, state = functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = quantize_nf4(weight)
    assert torch.equal(ours.packed, packed.reshape(-1))
    assert torch.equal(ours.absmax, state.absmax)
    assert torch.equal(ours.nested_absmax, state.state2.absmax)
    assert ours.nested_offset == state.offset.item()
    assert torch.equal(dequantize_nf4(ours), functional.dequantize_4bit(packed, state))
