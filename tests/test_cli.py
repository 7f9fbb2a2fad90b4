"""The command line: help everywhere, and every bad input as one line and exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from checkpoints import write_run
from safetensors.torch import load_file, save_file

from qlora_cli.sources.families import FAMILIES

pytestmark = pytest.mark.usefixtures("reference_ops")
ROOT = Path(__file__).resolve().parent.parent


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def test_help_on_every_command():
    for args in ([], ["train"], ["resume"]):
        proc = subprocess.run(
            [sys.executable, "-m", "qlora_cli", *args, "--help"], capture_output=True, text=True, cwd=ROOT
        )
        assert proc.returncode == 0 and "Usage" in proc.stdout
        if not args:
            listed = " ".join(proc.stdout.split())
            assert all(row.covers in listed for row in FAMILIES), listed


def test_version(run_cli):
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("qlora ")


def _edit(path: Path, **changes) -> Path:
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data))
    return path


ROW_THEN_BAD_ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"text": "x"}\n'
CASES = {
    "missing config": (lambda p: p.parent / "nope.yaml", "does not exist"),
    "yaml syntax": (
        lambda p: (p.write_text("base_model: x\nlora_r: [1,\n"), p)[1],
        "YAML syntax error at line",
    ),
    "unknown key": (lambda p: _edit(p, lora_rank=8), "did you mean 'lora_r'"),
    "wrong type": (lambda p: _edit(p, micro_batch_size="two"), "'micro_batch_size': expected an integer"),
    "lora_r zero": (lambda p: _edit(p, lora_r=0), "'lora_r': expected a value >= 1"),
    "sequence_len above max": (lambda p: _edit(p, sequence_len=4096), "above the model's maximum of 256"),
    "dataset missing": (
        lambda p: _edit(p, datasets=[{"path": str(p.parent / "none.jsonl"), "type": "alpaca"}]),
        "does not exist",
    ),
    "empty dataset": (lambda p: (p.parent.joinpath("train.jsonl").write_text(""), p)[1], "no rows"),
    "row lacks fields": (
        lambda p: (p.parent.joinpath("train.jsonl").write_text(ROW_THEN_BAD_ROW), p)[1],
        "train.jsonl:2: missing field 'messages'",
    ),
    "model without config.json": (
        lambda p: (p.parent.joinpath("model", "config.json").unlink(), p)[1],
        "no config.json",
    ),
    "unsupported model_type": (
        lambda p: (_set_model_config(p, model_type="gemma2"), p)[1],
        "model_type 'gemma2' is not supported",
    ),
    "output_dir is a file": (lambda p: (p.parent.joinpath("out").write_text("x"), p)[1], "is not a folder"),
    "cuda_graphs not a choice": (
        lambda p: _edit(p, cuda_graphs="always"),
        "'cuda_graphs': expected",
    ),
    "cuda_graphs true on the CPU": (
        lambda p: _edit(p, cuda_graphs=True),
        "'cuda_graphs' is true, but they need a CUDA device and this run trains on cpu",
    ),
}


def _set_model_config(config_path: Path, **changes) -> None:
    path = config_path.parent / "model" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _truncate(config_path: Path) -> Path:
    path = config_path.parent / "model" / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return config_path


def _wrong_shape(config_path: Path) -> Path:
    path = config_path.parent / "model" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][
        :, :10
    ].clone()
    save_file(tensors, path)
    return config_path


CASES["truncated safetensors"] = (_truncate, "truncated or corrupt")
CASES["tensor of the wrong shape"] = (_wrong_shape, "down_proj.weight has shape [64, 10], expected [64, 96]")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_train_input_is_one_line_and_exit_2(tmp_path, run_cli, case):
    break_it, message = CASES[case]
    config = break_it(write_run(tmp_path / "run"))
    code, _, err = run_cli("train", config)
    assert code == 2
    assert message in _one_error_line(err)


def test_bad_input_never_touches_existing_checkpoints(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _edit(config, lora_r=0)
    assert run_cli("train", config)[0] == 2
    _edit(config, lora_r=4)
    _wrong_shape(config)
    assert run_cli("train", config)[0] == 2
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_without_checkpoint(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("resume", tmp_path / "empty")
    assert code == 2 and "has no complete checkpoint" in _one_error_line(err)
    code, _, err = run_cli("resume", tmp_path / "missing")
    assert code == 2 and "is not a folder" in _one_error_line(err)


def test_resume_with_corrupt_trainer_state(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    assert run_cli("train", config)[0] == 0
    state = tmp_path / "run" / "out" / "checkpoint-2" / "trainer_state.json"
    state.write_text("{not json")
    code, _, err = run_cli("resume", tmp_path / "run" / "out", "--checkpoint", state.parent)
    assert code == 2 and "trainer_state.json is corrupt" in _one_error_line(err)
    assert state.read_text() == "{not json"


def test_bad_set_override(tmp_path, run_cli):
    config = write_run(tmp_path / "run")
    code, _, err = run_cli("train", config, "--set", "lora_r")
    assert code == 2 and "--set expects key=value" in _one_error_line(err)


def test_train_through_the_cli(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    code, _, err = run_cli("train", config, "--set", "max_steps=3")
    assert code == 0 and "done: 3 steps" in err
    assert os.path.isfile(tmp_path / "run" / "out" / "checkpoint-3" / "adapter_model.safetensors")


def test_done_and_resuming_lines_stay_whole_in_captured_output_however_long_the_path(tmp_path, run_cli):
    """stderr here is no terminal, as in a job log: each line holds the whole output_dir, unbroken, its
    brackets printed rather than read as markup."""
    output_dir = tmp_path / ("o" * 150) / "[exp1]" / ("p" * 150)
    code, _, err = run_cli("train", write_run(tmp_path / "run", max_steps=2, output_dir=str(output_dir)))
    assert code == 0, err
    done = [line for line in err.splitlines() if line.startswith("done: ")]
    assert (
        len(done) == 1
        and done[0].startswith("done: 2 steps")
        and done[0].endswith(f", adapter in {output_dir}")
    )
    code, _, err = run_cli("resume", output_dir, "--set", "max_steps=3")
    assert code == 0, err
    lines = err.splitlines()
    assert f"resuming from {output_dir / 'checkpoint-2'} at step 2" in lines
    assert lines[-1].startswith("done: 3 steps") and lines[-1].endswith(f", adapter in {output_dir}")


def test_fp8_where_it_cannot_run_stops_before_loading(tmp_path, run_cli):
    """On the CPU fp8: true is one line and no run folder content: it is never silently bf16."""
    config = write_run(tmp_path / "run", fp8=True)
    code, _, err = run_cli("train", config)
    line = _one_error_line(err)
    assert code == 2 and "'fp8' needs an NVIDIA GPU of compute capability 8.9 or newer" in line
    assert line.endswith("this run is on the CPU")
    assert not list((tmp_path / "run").glob("**/checkpoint-*"))


def test_profile_refuses_several_processes(tmp_path, run_cli):
    config = write_run(tmp_path / "run")
    code, _, err = run_cli("train", config, "--profile", "--nproc", "2")
    assert code == 2 and "--profile times a single process" in _one_error_line(err)


def test_profile_refuses_torchrun(tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_cli("profile", write_run(tmp_path / "run"))
    assert code == 2 and "times a single process" in _one_error_line(err)
