"""Layers to recompute from a memory budget, at Qwen2.5-7B's shape and 4 x 2048 tokens."""

from checkpoints import QWEN25_7B

from qlora_cli.memory import kept_activation_bytes, layers_to_checkpoint

TOKENS = 4 * 2048


def test_a_kept_layer_costs_about_a_gibibyte_without_dropout():
    """Measured on an H200 (benchmarks/RESULTS.md): about 1.2 GiB a layer before SwiGLU's output
    stopped being kept; gate/up alone is 0.58 GiB of what remains."""
    kept = kept_activation_bytes(QWEN25_7B, TOKENS) / 2**30
    assert 0.9 < kept < 1.1
    dropped = kept_activation_bytes(QWEN25_7B, TOKENS, lora_dropout=0.05) / 2**30
    assert dropped - kept > 2 * 18944 * TOKENS * 2 / 2**30


def test_budget_decides_how_many_layers_recompute():
    def recomputed(budget, dropout=0.0):
        return layers_to_checkpoint("auto", QWEN25_7B, TOKENS, budget, 16, dropout)

    assert recomputed(8) == 28
    assert recomputed(60) == 0
    middle = recomputed(25)
    assert 0 < middle < 28
    assert recomputed(25, dropout=0.05) > middle
    assert layers_to_checkpoint(True, QWEN25_7B, TOKENS, None, 16) == 28
    assert layers_to_checkpoint(False, QWEN25_7B, TOKENS, 1, 16) == 0
