"""Layers to recompute from a memory budget, at Qwen2.5-7B's shape and 4 x 2048 tokens; what each layer
kind of a hybrid model (Qwen3.5) holds."""

import os

import pytest
import torch
from checkpoints import QWEN25_7B, write_qwen3_5

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
    from qlora_cli.sources.model_config import spec_from_config

    for name, tokens, measured in MEASURED_PEAKS_GIB:
        spec = spec_from_config(qwen25_config(name))
        shape = RunShape(tokens, LoRAConfig(r=16))
        estimate = estimated_peak_bytes(spec, shape, spec.num_layers, offload=True) / 2**30
        assert abs(estimate / measured - 1) < 0.10, (name, tokens, estimate, measured)


# H200, LoRA r 16 on every linear, every layer recomputed and offloaded (`benchmarks.compare
# --runners qlora`, benchmarks/RESULTS.md 2026-12-03, second session): Qwen3.5-9B's shape cut to 8
# layers, and the whole 27B drawn on the device (`random:qwen3.5-27b`, under a 24 GiB cap).
MEASURED_HYBRID_PEAKS_GIB = [("qwen3.5-9b", 8, 4 * 2048, 7.01), ("qwen3.5-9b", 8, 32768, 10.91)]
MEASURED_HYBRID_PEAKS_GIB += [("qwen3.5-27b", None, 8192, 21.25)]


def test_hybrid_estimate_is_within_five_percent_of_the_measured_peaks():
    """A Gated DeltaNet layer's backward builds the delta rule's tables in passes that fit in the MLP
    slice's bytes, and its rerun holds its mixer's activations, larger than attention's."""
    from benchmarks.shapes import model_config
    from qlora_cli.sources.model_config import spec_from_config

    for name, layers, tokens, measured in MEASURED_HYBRID_PEAKS_GIB:
        spec = spec_from_config(model_config(name, layers))
        targets = tuple(sorted({n for kind in spec.layer_types for n in spec.projection_shapes(kind)}))
        assert len(targets) == 12
        shape = RunShape(tokens, LoRAConfig(r=16, alpha=32, target_modules=targets))
        estimate = estimated_peak_bytes(spec, shape, spec.num_layers, offload=True) / 2**30
        assert abs(estimate / measured - 1) < 0.05, (name, tokens, estimate, measured)


def test_the_delta_rules_passes_fill_what_the_mlps_backward_holds():
    """The delta rule's tables are built in passes as large as the layer's MLP holds in its backward,
    dense or a mixture of experts, whose routed copies hold far more than its 512-wide dense size."""
    from benchmarks.shapes import model_config
    from qlora_cli.model.mixers.gated_deltanet import delta_rule_backward_bytes, delta_rule_tokens_per_pass
    from qlora_cli.model.mlps import MLPS
    from qlora_cli.sources.model_config import spec_from_config

    for name, tokens in (("qwen3.5-9b", 4 * 2048), ("qwen3.5-27b", 32768), ("qwen3.5-35b-a3b", 4096)):
        spec = spec_from_config(model_config(name))
        (mlp_kind,) = set(spec.mlp_types)
        per_pass = delta_rule_tokens_per_pass(spec, tokens, MLPS[mlp_kind].backward_working_bytes)
        budget = MLPS[mlp_kind].backward_working_bytes(spec, tokens)
        assert delta_rule_backward_bytes(spec, per_pass) <= budget, name
        assert delta_rule_backward_bytes(spec, per_pass + 1) > budget, name
    assert per_pass >= tokens, "the mixture of experts' 4096-token row passes at once"


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


# A tiny Qwen3.5 whose two layer kinds keep clearly different amounts: the Gated DeltaNet layers have
# 8 value heads of 32 (value_dim 256 against the attention's 64 per query).
QWEN3_5_WIDE_VALUES = dict(linear_num_value_heads=8, linear_value_head_dim=32, full_attention_interval=2)


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    from qlora_cli.model import LoRAConfig, QLoRAModel

    folder = write_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), num_hidden_layers=2, **QWEN3_5_WIDE_VALUES)
    return QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4), dtype=torch.bfloat16).train()


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_frozen_and_trained_bytes_follow_each_layer_kind(tiny_qwen3_5):
    """The planner's NF4 bytes and LoRA size come from each layer's own projections: counted against
    the tensors of a tiny Qwen3.5 (one Gated DeltaNet layer, one attention layer) as loaded."""
    from qlora_cli.model.planner import frozen_weight_bytes

    model, spec = tiny_qwen3_5, tiny_qwen3_5.spec
    assert spec.layer_types == ("linear_attention", "full_attention")
    nf4 = [w for layer in model.layers for g in layer.projections.values() for w in g.weights]
    quantized = sum(w.packed.nbytes + w.absmax.nbytes + w.nested_absmax.nbytes for w in nf4)
    state = sum(b.nbytes for b in model.layers[0].buffers()) + model.layers[0].mixer.norm.nbytes
    embeddings = model.embed_tokens.nbytes + model.lm_head.nbytes
    # The planner counts absmax as 1/64 byte a weight, and leaves out the double quantization's fp32
    # absmax of the absmax.
    nested = sum(w.nested_absmax.nbytes for w in nf4)
    assert 0 <= quantized + state + embeddings - frozen_weight_bytes(spec) <= nested
    lora = LoRAConfig(r=4).trained_weights(spec)
    assert lora == sum(p.numel() for p in model.trainable_parameters())


def test_kept_layer_bytes_follow_what_each_layer_kind_saves(tiny_qwen3_5, monkeypatch):
    """What one kept layer of each kind saves for backward, measured through autograd's saved-tensor
    hooks with every op on its Triton kernel (interpreted on the CPU, in bf16), against the planner."""
    from qlora_cli.model.planner import kept_layer_bytes

    lora_r4 = LoRAConfig(r=4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, spec = tiny_qwen3_5, tiny_qwen3_5.spec
    frozen = _storages([*model.parameters(), *model.buffers()])
    for layer in model.layers:
        for group in layer.projections.values():
            frozen |= _storages(t for w in group.weights for t in (w.packed, w.absmax, w.nested_absmax))
    batch, seq = 2, 64
    x = torch.randn(batch, seq, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq).expand(batch, seq)
    estimates = {}
    for layer in model.layers:
        saved = {}

        def keep(t, saved=saved):
            if t.untyped_storage().data_ptr() not in frozen:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            layer(x, None, positions, None, model.inv_freq, model.dropout_seed)
        estimates[layer.kind] = kept_layer_bytes(spec, RunShape(batch * seq, lora_r4), kind=layer.kind)
        # Not modelled: LoRA's rank-r intermediates (bf16, at most 4 projections of rank 4 in each of 4
        # groups) and the norms' fp32 statistics per row and head (2 + value heads); and the bf16 LoRA
        # copies the planner counts are not all kept.
        lora = lora_r4.lora_weights_per_layer(spec, layer.kind) * 2
        unmodelled = batch * seq * (2 * 4 * 4 * 4 + 4 * (2 + spec.linear_attention.num_value_heads)) + lora
        assert abs(sum(saved.values()) - estimates[layer.kind]) <= unmodelled, layer.kind
    assert estimates["linear_attention"] > 1.5 * estimates["full_attention"]


def test_the_plan_for_a_hybrid_model_follows_each_layers_kind(tiny_qwen3_5):
    """Recomputing one more layer saves what that layer's kind keeps; `auto` picks the fewest
    recomputed layers that fit the budget, on a hybrid model as on any other."""
    from qlora_cli.model.planner import estimated_peak_bytes, kept_layer_bytes, recomputed_layer_bytes

    spec, tokens = tiny_qwen3_5.spec, 4096
    shape = RunShape(tokens, LoRAConfig(r=4))
    peaks = [estimated_peak_bytes(spec, shape, r) for r in range(spec.num_layers + 1)]
    for r, kind in enumerate(spec.layer_types):
        saved = kept_layer_bytes(spec, shape, kind=kind) - recomputed_layer_bytes(spec, tokens, False)
        assert peaks[r] - peaks[r + 1] == saved
    budget = (peaks[1] + peaks[0]) / 2 / 2**30
    assert layers_to_checkpoint("auto", spec, RunShape(tokens, LoRAConfig(r=4), budget)) == 1
