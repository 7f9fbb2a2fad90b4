"""The benchmarks time with the profiler's helper and write their numbers as JSON beside the text."""

import json
import subprocess
import sys

import pytest
from checkpoints import REPO_ROOT, subprocess_env, write_qwen2


def test_compare_writes_its_numbers_as_json(tmp_path):
    """qlora's eager runner on the CPU (the GPU runs all four): each step timed on its own, tokens/s
    from the median step, the same numbers in the JSON file as on stdout."""
    checkpoint = write_qwen2(tmp_path / "model")
    out = tmp_path / "results" / "compare.json"
    command = [sys.executable, "-m", "benchmarks.compare", str(checkpoint), "--device", "cpu"]
    command += ["--runners", "qlora-eager", "--batch", "1", "--seq", "32", "--steps", "3", "--warmup", "1"]
    proc = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    printed = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("JSON "))[5:])
    assert data["results"] == printed
    assert data["command"].startswith("python -m benchmarks.compare ") and data["device"] == "cpu"
    result = data["results"]["qlora-eager"]
    assert 0 < result["step_ms_min"] <= result["step_s"] * 1e3
    assert result["tokens_per_s"] == pytest.approx(32 / result["step_s"])


def test_generate_benchmark_times_qlora_decoding(tmp_path, monkeypatch):
    """benchmarks.generate's qlora side on the CPU (the GPU runs it against the baselines): exactly
    new_tokens per row, the rates computed from the timed generate, and ratios against a baseline."""
    from benchmarks.generate import qlora_decode, qlora_model, ratios

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = qlora_model(write_qwen2(tmp_path / "model"), device="cpu")
    result = qlora_decode(model, batch=2, prompt_len=8, new_tokens=5)
    assert result["decode_tokens_per_s"] == pytest.approx(2 * 5 / result["generate_s"])
    assert result["ttft_s"] > 0 and result["generate_s"] > 0  # a busy CPU may time one token longer than five
    baseline = {"decode_tokens_per_s": result["decode_tokens_per_s"] / 4, "ttft_s": result["ttft_s"] * 2}
    assert ratios({"qlora": result, "hf": baseline}) == pytest.approx({"speed_vs_hf": 4.0, "ttft_vs_hf": 0.5})
    assert any(".lora_B." in name and param.abs().sum() > 0 for name, param in model.named_parameters())
