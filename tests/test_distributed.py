"""Data-parallel training: two gloo processes on the CPU, started by torchrun as users start them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import subprocess_env, write_run
from safetensors.torch import load_file

from qlora_cli.cli import main
from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.rundir.folder import latest_checkpoint
from qlora_cli.train.distributed import Distributed
from qlora_cli.train.loop import resume, train

ROOT = Path(__file__).resolve().parent.parent
ENV = subprocess_env()

# Run by torchrun in place of `-m qlora_cli`: on rank 1 only, the QLORA_TEST_FAULT_CALL-th loss call
# raises (QLORA_TEST_FAULT=raise) or sends the process a SIGTERM (=sigterm). qlora never reads these.
FAULTY_RANK = """
import os, signal, sys
from qlora_cli.model.decoder import QLoRAModel

real_loss = QLoRAModel.loss
calls = []

def loss(self, *args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == int(os.environ["QLORA_TEST_FAULT_CALL"]):
        if os.environ["QLORA_TEST_FAULT"] == "raise":
            raise RuntimeError("injected failure")
        os.kill(os.getpid(), signal.SIGTERM)
    return real_loss(self, *args, **kwargs)

QLoRAModel.loss = loss
sys.argv = ["qlora", *sys.argv[1:]]
from qlora_cli.cli import main
main()
"""


def _torchrun(*args, script: Path | None = None, env_extra=None) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "qlora_cli"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.run(
        [*command, *target, *map(str, args)],
        cwd=ROOT,
        env={**ENV, **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def _losses(output_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _records(output_dir) if "loss" in r]


def _state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def _cli(monkeypatch, capfd, *args) -> tuple[int, str]:
    """`qlora ARGS` in this process; stderr read at the file descriptor, where torchrun's ranks write too."""
    monkeypatch.setattr(sys, "argv", ["qlora", *map(str, args)])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capfd.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_each_rank_reads_its_share_of_what_one_process_reads():
    """Step s of N ranks × A accumulation reads the micro-batches of step s of 1 process × A·N; an epoch of
    13 micro-batches ends with a short step, whose share may be empty for the last ranks."""
    for world, accumulation in ((2, 1), (2, 3), (3, 2)):
        per_step = accumulation * world
        for step in range(-(-13 // per_step)):
            step_indices = range(step * per_step, min(13, (step + 1) * per_step))
            shares = [Distributed(rank=r, world_size=world).micro_batches(step_indices) for r in range(world)]
            assert sorted(index for share in shares for index in share) == list(step_indices)
            assert all(len(share) == accumulation for share in shares) or step_indices.stop == 13


def test_torchrun_environment_must_be_complete(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(QLoraError, match="MASTER_ADDR, MASTER_PORT are not set"):
        Distributed.from_env(Distributed().device)


@pytest.mark.parametrize(
    "accumulation, settings",
    [
        # With dropout: each rank keeps the seed of its own micro-batch (DDP broadcasts no buffers).
        (1, dict(sample_packing=True, save_steps=2, lora_dropout=0.1)),
        (
            2,
            dict(
                gradient_checkpointing=True, train_norms=True, max_grad_norm=0, val_set_size=8, eval_steps=2
            ),
        ),
        (2, dict(gradient_checkpointing=True, activation_offloading=True, max_grad_norm=0)),
        # 5 micro-batches an epoch: step 3 holds one, and rank 1 runs an untrained one to join DDP.
        (1, dict(rows=10, lora_dropout=0.1)),
    ],
    ids=["qlora-nproc", "torchrun-accumulating", "torchrun-offloading-asked", "short-last-step"],
)
def test_two_processes_match_one_process_with_twice_the_accumulation(
    tmp_path, reference_ops, monkeypatch, capfd, accumulation, settings
):
    """2 processes × accumulation A against 1 process × 2A, same micro_batch_size: the same global batches.

    The first case starts through `qlora train --nproc 2`, the second through torchrun by hand.
    """
    one_config = write_run(
        tmp_path / "one", max_steps=4, gradient_accumulation_steps=2 * accumulation, **settings
    )
    one = train(load_config(one_config))
    two_config = write_run(
        tmp_path / "two", max_steps=4, gradient_accumulation_steps=accumulation, **settings
    )
    if accumulation == 1:
        code, err = _cli(monkeypatch, capfd, "train", two_config, "--nproc", "2")
        assert "Warning" not in err, err
    else:
        finished = _torchrun("train", two_config)
        code, err = finished.returncode, finished.stderr
    assert code == 0, err
    two = tmp_path / "two" / "out"
    assert err.count("done: 4 steps") == 1 and err.count("data parallel over 2 processes") == 1
    if settings.get("activation_offloading"):
        assert err.count("activation_offloading: not with several processes yet") == 1
    one_records, two_records = _records(one.output_dir), _records(two)
    assert [r["step"] for r in two_records] == [r["step"] for r in one_records] == [1, 2, 3, 4]
    for a, b in zip(one_records, two_records, strict=True):
        for key in ("loss", "eval_loss", "grad_norm"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert b["trained_tokens"] == a["trained_tokens"] and b["epoch"] == a["epoch"]
        assert "memory_gib_per_rank" not in a and len(b["memory_gib_per_rank"]) == 2
    state = _state(two / "checkpoint-4")
    assert state["world_size"] == 2 and state["batch_index"] == _state(one.checkpoint)["batch_index"]
    assert "rng" not in state
    assert (two / "adapter_model.safetensors").is_file()


def test_a_signal_on_one_rank_stops_every_rank_and_resume_equals_the_uninterrupted_run(
    tmp_path, monkeypatch, capfd
):
    """A SIGTERM that only rank 1 sees during step 3 of 6 stops both ranks after step 3 with a checkpoint;
    `resume` under 2 processes then ends where 6 uninterrupted steps end, loss for loss (each rank's
    dropout masks come from the seed of the micro-batch it reads, not from restored state)."""
    settings = dict(max_steps=6, gradient_accumulation_steps=2, lora_dropout=0.1, sample_packing=True)
    whole = _torchrun("train", write_run(tmp_path / "whole", **settings))
    assert whole.returncode == 0, whole.stderr
    script = tmp_path / "faulty_rank.py"
    script.write_text(FAULTY_RANK)
    fault = {"QLORA_TEST_FAULT": "sigterm", "QLORA_TEST_FAULT_CALL": "5"}  # step 3's first micro-batch
    stopped = _torchrun("train", write_run(tmp_path / "run", **settings), script=script, env_extra=fault)
    out = tmp_path / "run" / "out"
    assert stopped.returncode != 0
    assert stopped.stderr.count("stopped: SIGTERM received, so the run ended after step 3;") == 1
    assert f"qlora resume {out} --nproc 2" in stopped.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-3"]
    assert [s for s, _ in _losses(out)] == [1, 2, 3]

    resumed = _torchrun("resume", out)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and resumed.stderr.count("done: 6 steps") == 1
    assert _losses(out) == _losses(tmp_path / "whole" / "out")
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4, 5, 6]

    with pytest.raises(
        QLoraError, match=r"written by 2 processes and this run has 1; resume it with `--nproc 2`"
    ):
        resume(out)
    code, err = _cli(monkeypatch, capfd, "resume", out, "--nproc", "3")
    assert code == 2 and "this run has 3" in _one_error_line(err)


def test_a_failing_rank_ends_the_run_and_keeps_the_earlier_checkpoints(tmp_path):
    config = write_run(tmp_path / "run", max_steps=8, save_steps=1)
    script = tmp_path / "faulty_rank.py"
    script.write_text(FAULTY_RANK)
    failed = _torchrun(
        "train",
        config,
        script=script,
        env_extra={"QLORA_TEST_FAULT": "raise", "QLORA_TEST_FAULT_CALL": "3"},
    )
    out = tmp_path / "run" / "out"
    assert failed.returncode != 0
    assert "RuntimeError: injected failure" in failed.stderr
    assert failed.stderr.count("error: rank 1 failed: RuntimeError: injected failure") == 1
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-2"]
    assert latest_checkpoint(out).name == "checkpoint-2"
    assert _state(out / "checkpoint-2")["step"] == 2
    first, second = (load_file(out / f"checkpoint-{s}" / "adapter_model.safetensors") for s in (1, 2))
    assert first.keys() == second.keys() and any((first[k] != second[k]).any() for k in first)
    assert [s for s, _ in _losses(out)] == [1, 2]


def test_bad_data_found_by_the_ranks_ends_in_their_lines_and_exit_2(tmp_path, monkeypatch, capfd):
    """A dataset the ranks cannot read: one error line, whichever rank met it first, and the bad input's
    exit code, without torchrun's logging or traceback after it."""
    config = write_run(tmp_path / "run")
    code, err = _cli(
        monkeypatch, capfd, "train", config, "--nproc", "2", "--set", "datasets.0.path=nope.jsonl"
    )
    assert code == 2 and "nope.jsonl" in _one_error_line(err)


def test_a_bad_config_with_nproc_is_one_line_before_any_process_starts(tmp_path, monkeypatch, capfd):
    config = write_run(tmp_path / "run")
    config.write_text(config.read_text() + "lora_rank: 8\n")
    code, err = _cli(monkeypatch, capfd, "train", config, "--nproc", "2")
    assert code == 2 and "did you mean 'lora_r'" in _one_error_line(err)
    assert not (tmp_path / "run" / "out").exists()
