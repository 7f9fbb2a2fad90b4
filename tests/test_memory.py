"""Layers to recompute from a memory budget, at Qwen2.5-7B's shape and 4 x 2048 tokens."""

import os

import pytest
from checkpoints import QWEN25_7B

from qlora_cli.model.decoder import LoRAConfig
from qlora_cli.model.planner import (
    RunShape,
    estimated_peak_bytes,
    kept_activation_bytes,
    layers_to_checkpoint,
)

TOKENS = 4 * 2048
SHAPE = RunShape(TOKENS, LoRAConfig(r=16))


def budget(gb):
    return RunShape(TOKENS, LoRAConfig(r=16), gb)


def test_a_kept_layer_costs_about_a_gibibyte_without_dropout():
    """Measured on an H200 (benchmarks/RESULTS.md): about 1.2 GiB a layer before SwiGLU's output
    stopped being kept; gate/up alone is 0.58 GiB of what remains."""
    kept = kept_activation_bytes(QWEN25_7B, TOKENS) / 2**30
    assert 0.9 < kept < 1.1
    dropped = kept_activation_bytes(QWEN25_7B, TOKENS, lora_dropout=0.05) / 2**30
    assert dropped - kept > 2 * 18944 * TOKENS * 2 / 2**30


def test_budget_decides_how_many_layers_recompute():
    def recomputed(gb, dropout=0.0):
        return layers_to_checkpoint(
            "auto", QWEN25_7B, RunShape(TOKENS, LoRAConfig(r=16, dropout=dropout), gb)
        )

    assert recomputed(8) == 28
    assert recomputed(60) == 0
    middle = recomputed(25)
    assert 0 < middle < 28
    assert recomputed(25, dropout=0.05) > middle
    assert layers_to_checkpoint(True, QWEN25_7B, SHAPE) == 28
    assert layers_to_checkpoint(False, QWEN25_7B, budget(1)) == 0


@pytest.mark.parametrize(("offload", "dropout"), [(False, 0.0), (True, 0.0), (False, 0.05)])
def test_a_budget_of_exactly_the_estimate_for_k_layers_recomputes_k(offload, dropout):
    """The budget is in GiB (2**30 bytes; peak / 2**30 is exact in floats): the estimate for k layers
    is enough for k, a byte less needs k + 1; with nothing fitting, every layer recomputes."""

    lora = LoRAConfig(r=16, dropout=dropout)

    def peak(k):
        return estimated_peak_bytes(QWEN25_7B, RunShape(TOKENS, lora), k, offload=offload)

    def recomputed(budget_bytes):
        shape = RunShape(TOKENS, lora, budget_bytes / 2**30)
        return layers_to_checkpoint("auto", QWEN25_7B, shape, offload=offload)

    layers = QWEN25_7B.num_layers
    for k in range(layers + 1):
        assert recomputed(peak(k)) == k
        assert recomputed(peak(k) - 1) == min(k + 1, layers)


MEASURED_PEAKS_GIB = [  # H200, every layer recomputed and offloaded (benchmarks/RESULTS.md)
    ("qwen2.5-7b", 4 * 2048, 8.20),
    ("qwen2.5-7b", 16384, 8.83),
    ("qwen2.5-7b", 32768, 10.49),
    ("qwen2.5-7b", 131072, 19.88),
    ("qwen2.5-1.5b", 8 * 2048, 3.42),
]


def test_estimated_peak_is_within_ten_percent_of_the_measured_peaks():
    from benchmarks.shapes import qwen25_config
    from qlora_cli.sources.weights import spec_from_config

    for name, tokens, measured in MEASURED_PEAKS_GIB:
        spec = spec_from_config(qwen25_config(name))
        shape = RunShape(tokens, LoRAConfig(r=16))
        estimate = estimated_peak_bytes(spec, shape, spec.num_layers, offload=True) / 2**30
        assert abs(estimate / measured - 1) < 0.10, (name, tokens, estimate, measured)


def test_offloading_frees_each_recomputed_layers_input():

    kept_inputs = estimated_peak_bytes(QWEN25_7B, SHAPE, 28)
    offloaded = estimated_peak_bytes(QWEN25_7B, SHAPE, 28, offload=True)
    layer_input = TOKENS * QWEN25_7B.hidden_size * 2
    assert kept_inputs - offloaded == 28 * layer_input - 2 * layer_input


def test_the_lora_size_counts_only_the_targeted_projections_and_the_trained_norms():
    """The formula the planner and the free-space check share, against a model's own parameters."""
    import dataclasses

    from qlora_cli.model.decoder import QLoRAModel

    for qk_norm in (False, True):
        small = dict(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
        spec = dataclasses.replace(QWEN25_7B, **small, head_dim=24, qk_norm=qk_norm)
        for lora in (
            LoRAConfig(r=4),
            LoRAConfig(r=4, target_modules=("q_proj", "v_proj")),
            LoRAConfig(r=8, target_modules=("v_proj", "down_proj"), train_norms=True),
        ):
            parameters = QLoRAModel(spec, lora).trainable_parameters()
            assert lora.trained_weights(spec) == sum(p.numel() for p in parameters), (qk_norm, lora)


def test_the_planner_counts_the_adapters_targets():
    """A [q_proj, v_proj] run holds fp32 weights, gradients and two moments (16 bytes) of its own LoRA
    weights only, and its kept layers bf16 copies (2 bytes) of theirs: an all-seven run's estimate is
    larger by exactly the difference in the formula's counts."""
    from qlora_cli.model.planner import estimated_peak_bytes

    all_seven, q_and_v = LoRAConfig(r=16), LoRAConfig(r=16, target_modules=("q_proj", "v_proj"))
    trained = all_seven.trained_weights(QWEN25_7B) - q_and_v.trained_weights(QWEN25_7B)
    per_layer = all_seven.lora_weights_per_layer(QWEN25_7B) - q_and_v.lora_weights_per_layer(QWEN25_7B)
    assert trained == per_layer * QWEN25_7B.num_layers > 0
    for recomputed in (0, 10, 28):
        gap = estimated_peak_bytes(QWEN25_7B, SHAPE, recomputed) - estimated_peak_bytes(
            QWEN25_7B, RunShape(TOKENS, q_and_v), recomputed
        )
        assert gap == 16 * trained + (28 - recomputed) * 2 * per_layer, recomputed


def test_a_budget_keeps_more_layers_when_recomputed_ones_are_offloaded():
    plain = layers_to_checkpoint("auto", QWEN25_7B, budget(14))
    offloaded = layers_to_checkpoint("auto", QWEN25_7B, budget(14), offload=True)
    assert 0 < offloaded < plain < 28


def test_auto_offloads_on_a_gpu_when_layers_recompute():
    from qlora_cli.model.planner import offloads_activations

    def offloads(setting, checkpointing, device, gb=None):
        return offloads_activations(setting, checkpointing, QWEN25_7B, budget(gb), device)

    assert offloads("auto", True, "cuda")
    assert not offloads("auto", True, "cpu")
    assert not offloads("auto", False, "cuda")
    assert not offloads("auto", "auto", "cuda", gb=60)  # every layer kept: nothing to offload
    assert offloads("auto", "auto", "cuda", gb=12)
    assert offloads(True, True, "cpu") and not offloads(False, True, "cuda")


def test_the_cli_asks_for_expandable_segments_unless_the_user_chose(monkeypatch):
    from qlora_cli.core.allocator import prefer_expandable_segments

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    prefer_expandable_segments()
    assert "expandable_segments:True" in {
        os.environ.get(n) for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    }
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    prefer_expandable_segments()
    assert (
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
        and "PYTORCH_ALLOC_CONF" not in os.environ
    )
