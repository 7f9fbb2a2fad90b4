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
