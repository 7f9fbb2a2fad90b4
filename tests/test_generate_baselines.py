"""The decoding baselines' shared parts on the CPU, on tiny plain (unquantized) Qwen2 and Qwen3.5: the LoRA
they attach and the timed greedy generate. The NF4 loads need bitsandbytes / Unsloth on a GPU."""

from types import SimpleNamespace

import pytest
import torch
from checkpoints import load_transformers, write_qwen2, write_qwen3_5

from benchmarks import generate_baselines
from benchmarks.generate_baselines import attach_lora, time_generation
from qlora_cli.core.names import ALL_PROJECTIONS


@pytest.fixture
def tiny_model(tmp_path):
    return load_transformers(write_qwen2(tmp_path / "model"))


def _lora_b(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_B" in name}


@pytest.mark.parametrize("writer", [write_qwen2, write_qwen3_5], ids=["qwen2", "qwen3_5"])
def test_random_lora_covers_every_projection_with_nonzero_b(tmp_path, writer):
    """Every projection the model has, Qwen3.5's linear-attention ones too, as qlora's side trains."""
    model = load_transformers(writer(tmp_path / "model"))
    projections = {
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ALL_PROJECTIONS
    }
    model, note = attach_lora(model, None)
    b = _lora_b(model)
    adapted = {name.removeprefix("base_model.model.").removesuffix(".lora_B.default.weight") for name in b}
    assert adapted == projections
    assert all(tensor.abs().sum() > 0 for tensor in b.values())
    assert f"({len(b)} B matrices)" in note


def test_saved_adapter_is_loaded_as_saved(tiny_model, tmp_path):
    model, _ = attach_lora(tiny_model, None)
    saved = _lora_b(model)
    model.save_pretrained(tmp_path / "adapter")
    reloaded, note = attach_lora(load_transformers(tmp_path / "model"), tmp_path / "adapter")
    loaded = _lora_b(reloaded)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    assert note == "adapter adapter"


def test_timed_generate_counts_exactly_new_tokens(tiny_model, monkeypatch):
    """Rates from the clock readings around the two timed generates (a fake clock: on a busy CPU
    the real one can time the one-token generate longer than the full one)."""
    readings = iter([10.0, 10.5, 20.0, 22.5])  # first token 0.5 s, full generate 2.5 s
    monkeypatch.setattr(generate_baselines, "time", SimpleNamespace(perf_counter=lambda: next(readings)))
    model, _ = attach_lora(tiny_model, None)
    result = time_generation(model, batch=2, prompt_len=5, new_tokens=6, device="cpu")
    assert result["ttft_s"] == 0.5 and result["generate_s"] == 2.5
    assert result["decode_tokens_per_s"] == pytest.approx(2 * 6 / 2.5)
    assert result["decode_only_tokens_per_s"] == pytest.approx(2 * 5 / 2.0)
    assert result["peak_gib"] == 0.0


def test_timing_needs_two_tokens(tiny_model):
    with pytest.raises(ValueError, match="at least 2"):
        time_generation(tiny_model, batch=1, prompt_len=4, new_tokens=1, device="cpu")
