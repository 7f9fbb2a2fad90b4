"""Decode-time projections: the Triton kernel against the reference, the reference against
`x @ dequantize_nf4(W).T`.

Triton's interpreter truncates float32 -> bfloat16 where GPUs round to nearest even, so bf16
results of the Triton path on the CPU are compared within a few bf16 steps of the output's
magnitude; fp32 ones within fp32 summation-order error.
"""

from dataclasses import replace

import pytest
import torch

from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4
from qlora_kernels.nf4_matvec import (
    MatvecConfig,
    _nf4_matvec_triton,
    _split_k,
    default_config,
    nf4_matvec,
    nf4_matvec_reference,
)

gpu = pytest.mark.gpu

# in features, [(out features, kind, bias)]; kind "nf4" or "plain". Every NF4 weight has a
# multiple of 64 values, as checkpoints do; K is not a multiple of the tile's 64 or 128.
GROUPS = {
    "rows_whole_blocks": (320, [(48, "nf4", True), (33, "nf4", False), (16, "plain", True)]),
    "rows_straddle_blocks": (200, [(40, "nf4", False), (24, "nf4", True)]),
    "odd_rows_share_bytes": (75, [(64, "nf4", True), (8, "plain", False)]),
}


def _group(name, double_quant, weight_dtype=torch.float32, device="cpu", seed=0):
    in_features, specs = GROUPS[name]
    generator = torch.Generator().manual_seed(seed)
    weights, biases = [], []
    for out_features, kind, bias in specs:
        weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(
            weight_dtype
        )
        weight = weight.to(device)
        weights.append(quantize_nf4(weight, double_quant=double_quant) if kind == "nf4" else weight)
        biases.append((torch.randn(out_features, generator=generator) * 0.1).to(device) if bias else None)
    return in_features, weights, biases


def _x(rows, in_features, dtype, device="cpu", seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=generator).to(dtype).to(device)


def _assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        # A few bf16 steps (1/128 relative) of the largest output: interpreter truncation, sum order.
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), atol=4 * scale / 128, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "fp32_absmax"])
@pytest.mark.parametrize("rows", [1, 5, 20])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_triton_matches_reference(name, rows, double_quant, dtype):
    in_features, weights, biases = _group(name, double_quant)
    x = _x(rows, in_features, dtype)
    expected = nf4_matvec_reference(x, weights, biases)
    _assert_close(nf4_matvec(x, weights, biases), expected, dtype)


# Splits asked for -> splits run, by group: K = 320 is 5 tiles of 64, K = 200 is 4 (the last one
# short); splits take whole tiles, as many per split as the first ones need.
SPLITS_RUN = {"rows_whole_blocks": {1: 1, 2: 2, 3: 3, 4: 3}, "rows_straddle_blocks": {1: 1, 2: 2, 3: 2, 4: 4}}


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(SPLITS_RUN))
def test_k_splits(name, splits):
    """Small K tiles: one program walks several tiles (its next tile fetched ahead), several
    programs split K and their partial sums add up; the last split ends in a K tail."""
    in_features, weights, biases = _group(name, double_quant=True)
    x = _x(1, in_features, torch.float32)
    config = replace(default_config(), block_n=16, block_k=64, split_k=splits)
    assert _split_k(config, weights, x.device)[0] == SPLITS_RUN[name][splits]
    _assert_close(
        _nf4_matvec_triton(x, weights, biases, config), nf4_matvec_reference(x, weights, biases), x.dtype
    )


def test_default_split_bounds_program_length_and_partial_sums():
    """Narrow weights get more K splits (enough programs), wide ones only enough to keep each
    program to k_tiles_per_program tiles; partial sums stay within half the codes' bytes."""
    cpu = torch.device("cpu")
    config = MatvecConfig(block_n=16, block_k=64, programs_per_sm=4, k_tiles_per_program=4)
    narrow = _split_k(config, [torch.zeros(16, 1024)], cpu)
    wide = _split_k(config, [torch.zeros(16 * 64, 1024)], cpu)
    assert narrow[0] > wide[0]
    assert wide == (4, 256)
    assert _split_k(replace(config, block_k=16), [torch.zeros(16, 256)], cpu)[0] == 256 // 32


def test_kernel_takes_one_row():
    """Several rows go to dequantize + matmul (nf4_matvec); the GEMV kernel is for one."""
    in_features, weights, biases = _group("rows_whole_blocks", double_quant=True)
    with pytest.raises(ValueError, match="one row"):
        _nf4_matvec_triton(_x(2, in_features, torch.float32), weights, biases)


@pytest.mark.parametrize("leading", [(2, 3), (2, 35)], ids=["6_rows", "70_rows"])
def test_leading_dims_and_missing_biases(leading):
    in_features, weights, _ = _group("rows_whole_blocks", double_quant=True)
    rows = leading[0] * leading[1]
    x = _x(rows, in_features, torch.float32).reshape(*leading, in_features)
    y = nf4_matvec(x, weights)
    assert y.shape == (*leading, sum(w.shape[0] for w in weights))
    expected = nf4_matvec_reference(x.reshape(rows, in_features), weights, None)
    _assert_close(y.reshape(rows, -1), expected, x.dtype)


def test_no_rows():
    in_features, weights, biases = _group("rows_whole_blocks", double_quant=True)
    y = nf4_matvec(torch.zeros(2, 0, in_features), weights, biases)
    assert y.shape == (2, 0, sum(w.shape[0] for w in weights))


@pytest.mark.parametrize("name", sorted(GROUPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_matmul_with_dequantized_weights(name, dtype, reference_ops):
    """Column slice p of the reference is x @ dequantize_nf4(W_p).T + b_p (plain weights as given),
    dequantize_nf4 on its bitsandbytes-checked reference path (tests/test_nf4.py)."""
    in_features, weights, biases = _group(name, double_quant=True, weight_dtype=dtype)
    x = _x(5, in_features, dtype)
    y = nf4_matvec_reference(x, weights, biases)
    column = 0
    for weight, bias in zip(weights, biases, strict=True):
        dense = weight if isinstance(weight, torch.Tensor) else dequantize_nf4(weight)
        expected = x.float() @ dense.float().T + (0 if bias is None else bias.float())
        out_features = dense.shape[0]
        torch.testing.assert_close(y[:, column : column + out_features].float(), expected.to(dtype).float())
        column += out_features
    assert column == y.shape[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plain_group_goes_to_torch(dtype):
    """No NF4 weight in the group (quantization off): torch's matmul, still the reference's numbers."""
    generator = torch.Generator().manual_seed(3)
    weights = [
        torch.randn(24, 40, generator=generator).to(dtype),
        torch.randn(8, 40, generator=generator).to(dtype),
    ]
    biases = [None, torch.randn(8, generator=generator).to(dtype)]
    x = _x(3, 40, dtype)
    _assert_close(nf4_matvec(x, weights, biases), nf4_matvec_reference(x, weights, biases), dtype)


def test_cpu_path_runs_reference(reference_ops):
    in_features, weights, biases = _group("rows_straddle_blocks", double_quant=False)
    x = _x(3, in_features, torch.bfloat16)
    assert torch.equal(nf4_matvec(x, weights, biases), nf4_matvec_reference(x, weights, biases))


@pytest.mark.parametrize(
    ("weights", "biases", "message"),
    [
        ([], None, "at least one weight"),
        ([torch.zeros(8, 32)], [None, None], "1 weights but 2 biases"),
        ([torch.zeros(8, 16)], None, "32 features"),
        ([torch.zeros(8, 32)], [torch.zeros(9)], r"expected \(8,\)"),
    ],
)
def test_bad_arguments(weights, biases, message):
    with pytest.raises(ValueError, match=message):
        nf4_matvec(torch.zeros(2, 32), weights, biases)


# Qwen2.5-7B's projection groups: (in features, [(out features, bias)]).
QWEN_7B_GROUPS = {
    "qkv": (3584, [(3584, True), (512, True), (512, True)]),
    "o": (3584, [(3584, False)]),
    "gate_up": (3584, [(18944, False), (18944, False)]),
    "down": (18944, [(3584, False)]),
}


@gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("group", sorted(QWEN_7B_GROUPS))
def test_triton_qwen_7b_shapes(group, rows):
    """bf16 on CUDA: kernel against the reference and against dequantize_nf4 + matmul."""
    in_features, specs = QWEN_7B_GROUPS[group]
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        quantize_nf4(
            (torch.randn(out, in_features, device="cuda", generator=generator) * in_features**-0.5).bfloat16()
        )
        for out, _ in specs
    ]
    biases = [
        torch.randn(out, device="cuda", generator=generator).bfloat16() if bias else None
        for out, bias in specs
    ]
    x = torch.randn(rows, in_features, device="cuda", generator=generator).bfloat16()
    y = nf4_matvec(x, weights, biases)
    expected = nf4_matvec_reference(x, weights, biases)
    torch.testing.assert_close(y, expected, atol=2e-2, rtol=2e-2)
    dense = torch.cat([dequantize_nf4(w) for w in weights])
    bias = torch.cat(
        [
            b if b is not None else torch.zeros(w.shape[0], device="cuda").bfloat16()
            for w, b in zip(weights, biases, strict=True)
        ]
    )
    torch.testing.assert_close(y, (x @ dense.T + bias).bfloat16(), atol=3e-2, rtol=3e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_triton_small_groups_on_cuda(name, dtype):
    """The interpreter cases compiled for the GPU, every K split; several rows dequantize and multiply."""
    for double_quant in (True, False):
        in_features, weights, biases = _group(name, double_quant, device="cuda")
        for rows in (1, 5, 20, 70):
            x = _x(rows, in_features, dtype, device="cuda")
            expected = nf4_matvec_reference(x, weights, biases)
            _assert_close(nf4_matvec(x, weights, biases), expected, dtype)
            for splits in (1, 2, 3):
                config = replace(default_config(), block_n=16, block_k=64, split_k=splits)
                _assert_close(_nf4_matvec_triton(x[:1], weights, biases, config), expected[:1], dtype)


@gpu
def test_cuda_graph_replay_matches_eager():
    """The decoder may capture a step as a CUDA graph: the kernel (and its split-K sum) replays."""
    in_features, weights, biases = _group("rows_whole_blocks", double_quant=True, device="cuda")
    x = _x(4, in_features, torch.bfloat16, device="cuda")
    eager = nf4_matvec(x, weights, biases)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nf4_matvec(x, weights, biases)
    x.copy_(_x(4, in_features, torch.bfloat16, device="cuda", seed=2))
    graph.replay()
    torch.testing.assert_close(captured, nf4_matvec(x, weights, biases), atol=0, rtol=0)
    assert not torch.equal(captured, eager)
