"""The frozen-weight format seam: a second format, registered through kernels.formats alone, runs
the frozen projection with LoRA (forward and backward, both layouts), decode's projection and the
merge round trip. Its weights are no tensors and no NF4Weight, so any code that still tests a
weight's type instead of asking its format fails here."""

from dataclasses import dataclass

import pytest
import torch

from qlora_cli.generate.decoding import DecodeProjection
from qlora_cli.model.lora import LoRAConfig, ProjectionGroup
from qlora_kernels.formats import DENSE, NF4, FrozenFormat, base, frozen_format, register_format
from qlora_kernels.fp8 import fp8_shape_error
from qlora_kernels.nf4 import quantize_nf4
from qlora_kernels.nf4_matvec import nf4_matvec


@dataclass
class Int8RowWeight:
    """int8 codes [out, in] with one fp32 scale a row: a format written for this test only."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


class Int8RowFormat(FrozenFormat):
    name = "int8-row"
    bytes_per_weight = 1.0

    def recognises(self, weight: object) -> bool:
        return isinstance(weight, Int8RowWeight)

    def encode(self, weight: torch.Tensor) -> Int8RowWeight:
        scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127
        codes = torch.round(weight.float() / scale[:, None]).to(torch.int8)
        return Int8RowWeight(codes, scale, weight.dtype)

    def dequantize(self, weight, dtype=None, out=None):
        dense = (weight.codes.float() * weight.scale[:, None]).to(dtype or weight.dtype)
        return dense if out is None else out.copy_(dense)


INT8_ROWS = Int8RowFormat()
SHAPES = {"gate_proj": (96, 32), "up_proj": (96, 32), "o_proj": (32, 32)}


@pytest.fixture
def int8_rows(monkeypatch):
    """The test format registered for one test, through the seam's own registration."""
    monkeypatch.setattr(base, "_FORMATS", list(base._FORMATS))
    register_format(INT8_ROWS)
    return INT8_ROWS


def _group(names: tuple[str, ...], seed: int = 0) -> tuple[ProjectionGroup, list[torch.Tensor]]:
    """A projection group whose frozen weights are int8 rows, B non-zero; and those weights dense."""
    generator = torch.Generator().manual_seed(seed)
    group = ProjectionGroup(names, SHAPES, LoRAConfig(r=4, target_modules=names))
    group.reset_lora(generator)
    dense = []
    for name in names:
        weight = INT8_ROWS.encode(torch.randn(SHAPES[name], generator=generator))
        group.set_weight(name, weight)
        dense.append(INT8_ROWS.dequantize(weight, torch.float32))
        with torch.no_grad():
            group.lora_B[name].normal_(generator=generator)
    return group, dense


def _dense_forward(group: ProjectionGroup, dense: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    outputs = [
        x @ w.T + group.scaling * (x @ group.lora_A[name].T) @ group.lora_B[name].T
        for name, w in zip(group.names, dense, strict=True)
    ]
    return torch.cat(outputs, dim=-1)


def test_each_weight_is_recognised_by_its_format(int8_rows):
    weight = torch.randn(32, 64)
    assert frozen_format(int8_rows.encode(weight)) is int8_rows
    assert frozen_format(quantize_nf4(weight)) is NF4
    assert frozen_format(weight) is DENSE
    with pytest.raises(TypeError, match="no frozen-weight format recognises"):
        frozen_format(object())


def test_an_unregistered_format_is_not_recognised():
    with pytest.raises(TypeError, match="Int8RowWeight"):
        frozen_format(INT8_ROWS.encode(torch.randn(4, 4)))


@pytest.mark.parametrize("names", [("gate_proj", "up_proj"), ("o_proj",)], ids=["columns", "added"])
@pytest.mark.parametrize("kernels", ["function", "reference"])
def test_a_new_format_trains_through_the_projection(int8_rows, names, kernels, monkeypatch):
    """Wide groups put B beside the dequantized weights (the format writes into row views), narrow
    ones add it after; the autograd Function runs under the interpreter, the reference without."""
    if kernels == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    group, dense = _group(names)
    x = torch.randn(2, 3, 32, requires_grad=True)
    x_dense = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(2, 3, sum(group.out_features))

    y = group(x)
    y.backward(grad_out)
    ours = [x.grad, *(group.lora_A[n].grad for n in names), *(group.lora_B[n].grad for n in names)]
    params = [*group.lora_A.values(), *group.lora_B.values()]
    for p in params:
        p.grad = None
    expected_y = _dense_forward(group, dense, x_dense)
    expected_y.backward(grad_out)
    expected = [x_dense.grad, *(group.lora_A[n].grad for n in names), *(group.lora_B[n].grad for n in names)]

    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_new_format_decodes_through_the_gemv(int8_rows, rows):
    """Decode dequantizes a weight once where the GEMV kernel cannot read its format."""
    group, dense = _group(("gate_proj", "up_proj"), seed=1)
    x = torch.randn(rows, 1, 32)
    with torch.no_grad():
        expected = _dense_forward(group, dense, x)
        torch.testing.assert_close(DecodeProjection(group, torch.float32)(x), expected)
        torch.testing.assert_close(
            nf4_matvec(x[:, 0], group.weights), torch.cat([x[:, 0] @ w.T for w in dense], -1)
        )


def test_a_new_format_merges_as_it_computes(int8_rows):
    """An export writes the weight the model computed with: the format's dequantized round trip."""
    weight = torch.randn(16, 32)
    expected = int8_rows.dequantize(int8_rows.encode(weight), torch.float32)
    torch.testing.assert_close(int8_rows.round_trip(weight, torch.float32), expected)


def test_a_format_without_an_fp8_cast_is_named(int8_rows):
    weights = [int8_rows.encode(torch.randn(32, 64))]
    assert fp8_shape_error(weights) == "FP8 products need NF4 weights"
