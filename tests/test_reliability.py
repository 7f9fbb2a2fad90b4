"""Nothing lost: a run owns its output_dir, checks it before loading, survives full disks and damaged
checkpoints with one clear line, and can be resumed or exported from any directory."""

import dataclasses
import functools
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from checkpoints import (
    add_demo_tokenizer,
    as_written_before_manifests,
    subprocess_env,
    suggested,
    write_llama,
    write_mistral,
    write_qwen3,
    write_qwen3_5,
    write_run,
)
from safetensors.torch import load_file

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.rundir import checkpoint as checkpoint_module
from qlora_cli.rundir.base_model import checkpoint_base
from qlora_cli.rundir.checkpoint import (
    checkpoint_problem,
    list_checkpoints,
    read_checkpoint_config,
    run_checkpoints,
    save_checkpoint,
)
from qlora_cli.rundir.folder import foreign_checkpoints, latest_checkpoint, owner_run, run_lock, space_needed
from qlora_cli.rundir.names import LOCK_FILE, RUN_FILE
from qlora_cli.rundir.trainer_state import TrainerState, read_trainer_state
from qlora_cli.sources.fingerprint import base_fingerprint, config_difference
from qlora_cli.sources.model_config import read_spec
from qlora_cli.train import loop as train_loop
from qlora_cli.train.loop import train

pytestmark = pytest.mark.usefixtures("reference_ops")


def error_line(result, code: int = 2) -> str:
    got, _, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == code and "Traceback" not in err, err
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def _cli(args, *, cwd=None, file_size_limit=None, **popen):
    """`qlora ARGS` in a child process; with file_size_limit, no file it writes may grow past that many
    bytes (RLIMIT_FSIZE: the kernel refuses the write with EFBIG, as a full disk refuses with ENOSPC)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "qlora_cli", *map(str, args)],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit if file_size_limit else None,
        **popen,
    )


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    return error_line((proc.returncode, proc.stdout, proc.stderr), code)


# ----- a run owns its output_dir -----


def test_training_into_another_runs_folder_refuses_and_names_the_choices(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    line = error_line(run_cli("train", config))
    assert f"qlora resume {out}" in line and "new output_dir" in line
    assert "--overwrite" in line and "overwrite_output_dir" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_training_into_an_exported_adapter_says_it_is_no_run(tmp_path, run_cli):
    """`qlora export`'s folder holds an adapter but no run: nothing there to resume, so the line says not to."""
    config = write_run(tmp_path / "run", max_steps=2)
    assert run_cli("train", config)[0] == 0
    exported = tmp_path / "adapter"
    assert run_cli("export", tmp_path / "run" / "out", "--out", exported)[0] == 0
    before = {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()}
    code, _, err = run_cli("train", config, "--set", f"output_dir={exported}")
    assert len(err.strip().splitlines()) == 1 and error_line((code, "", err)) == (
        f"error: output_dir {exported} holds an adapter but no run (no {RUN_FILE}, no checkpoints), as "
        "`qlora export` writes one; choose another output_dir for the new run"
    )
    (exported / LOCK_FILE).unlink()  # the check runs under the run's lock, which stays behind
    assert {p: p.read_bytes() for p in exported.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("how", ["option", "config key"])
def test_overwrite_removes_the_old_runs_files_first(tmp_path, run_cli, how):
    config = write_run(tmp_path / "run", max_steps=6, save_steps=2, save_total_limit=2, lora_r=8)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    (out / "notes.txt").write_text("mine")
    old_run = json.loads((out / RUN_FILE).read_text())["run_id"]
    args = ["--overwrite"] if how == "option" else ["--set", "overwrite_output_dir=true"]
    assert run_cli("train", config, "--set", "max_steps=2", "--set", "lora_r=4", *args)[0] == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / RUN_FILE).read_text())["run_id"] != old_run
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    code, _, _ = run_cli("export", out, "--out", tmp_path / "adapter")
    assert code == 0 and json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


def test_resume_of_a_run_started_with_overwrite_keeps_its_checkpoints(tmp_path, run_cli):
    """overwrite_output_dir is saved in the run's config; resuming that run must not delete what it wrote."""
    config = write_run(tmp_path / "run", max_steps=4, save_steps=2, overwrite_output_dir=True)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    assert read_checkpoint_config(out / "checkpoint-4").overwrite_output_dir is True
    before = {p: p.read_bytes() for p in out.glob("checkpoint-*/*") if p.is_file()}
    assert run_cli("resume", out, "--set", "max_steps=6")[0] == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert {p: p.read_bytes() for p in before} == before
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        *range(1, 7)
    ]


def _tiny_model(tmp_path):
    config = load_config(write_run(tmp_path / "run"))
    model = QLoRAModel(read_spec(Path(config.base_model)), LoRAConfig(r=4, alpha=8))
    return config, model, torch.optim.AdamW(model.trainable_parameters())


def test_rotation_resume_and_export_never_take_another_runs_checkpoints(tmp_path):
    config, model, optimizer = _tiny_model(tmp_path)
    out = tmp_path / "out"
    for step in (10, 12):
        save_checkpoint(out, step, model, optimizer, TrainerState(step, run_id="old"), config)
    config.save_total_limit = 2
    for step in (2, 4, 6):
        save_checkpoint(out, step, model, optimizer, TrainerState(step, run_id="new"), config)
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert names == ["checkpoint-10", "checkpoint-12", "checkpoint-4", "checkpoint-6"]
    (out / RUN_FILE).write_text(json.dumps({"run_id": "new"}))
    assert latest_checkpoint(out) == out / "checkpoint-6"
    (out / RUN_FILE).write_text(json.dumps({"run_id": "old"}))
    assert latest_checkpoint(out) == out / "checkpoint-12"


def test_a_checkpoint_whose_state_cannot_be_read_belongs_to_no_run(tmp_path):
    """Ownership, rotation and the foreign-checkpoint check all skip it: nothing says whose it is."""
    config, model, optimizer = _tiny_model(tmp_path)
    out = tmp_path / "out"
    for step in (2, 4):
        save_checkpoint(out, step, model, optimizer, TrainerState(step, run_id="mine"), config)
    (out / "checkpoint-4" / "trainer_state.json").write_text("{not json")
    assert owner_run(out) == "mine"
    assert run_checkpoints(out, "mine") == [(2, out / "checkpoint-2")]
    assert foreign_checkpoints(out, "mine") == []


def test_a_second_process_cannot_train_into_a_folder_in_use(tmp_path):
    config = write_run(tmp_path / "run", max_steps=2)
    out = tmp_path / "run" / "out"
    out.mkdir()
    with run_lock(out):
        proc = _cli(["train", config])
    line = _one_line(proc, 2)
    assert "is in use by another qlora process" in line and str(os.getpid()) in line
    assert not list(out.glob("checkpoint-*"))


def _files(folder: Path) -> dict[Path, bytes]:
    """Every file under folder, by its path inside it, with its bytes."""
    return {path.relative_to(folder): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_an_export_is_refused_where_the_run_prunes_replaces_or_sets_aside(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2, save_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    before = _files(out)
    for target, where in [
        (out / "checkpoint-2" / "exp", f"is inside {out / 'checkpoint-2'}, one of"),
        (out / "checkpoint-99", "is named like"),
        (out / "superseded-checkpoint-4" / "exp", f"is inside {out / 'superseded-checkpoint-4'}, one of"),
    ]:
        assert error_line(run_cli("export", out, "--out", target)) == (
            f"error: --out {target} {where} the checkpoint folders of the run in {out}, which the run prunes, "
            "replaces and sets aside; choose a folder outside them"
        )
    assert _files(out) == before
    assert run_cli("export", out, "--out", out / "exports" / "checkpoint-2")[0] == 0


def test_pruning_and_overwrite_never_delete_what_the_run_did_not_write(tmp_path, run_cli):
    """An export put inside a checkpoint (before export refused that) outlives its pruning, which takes
    only the checkpoint's own files; --overwrite refuses a folder named like a checkpoint that is none,
    or a checkpoint holding other files, naming it, and deletes nothing."""
    config = write_run(tmp_path / "run", max_steps=2, save_steps=2, save_total_limit=1)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    exported = tmp_path / "adapter"
    assert run_cli("export", out, "--out", exported)[0] == 0
    shutil.copytree(exported, out / "checkpoint-2" / "exp")
    assert run_cli("resume", out, "--set", "max_steps=4")[0] == 0
    assert latest_checkpoint(out) == out / "checkpoint-4"
    assert [path.name for path in (out / "checkpoint-2").iterdir()] == ["exp"]
    assert _files(out / "checkpoint-2" / "exp") == _files(exported)
    shutil.copytree(exported, out / "checkpoint-99")
    (out / "checkpoint-4" / "notes.txt").write_text("mine")
    before = _files(out)
    refused = f"error: output_dir {out}: --overwrite deletes only what a run wrote, and "
    move = "; move it out of output_dir first, or choose another output_dir"
    for folder, why in [
        ("checkpoint-2", "is no checkpoint (it has no trainer_state.json)"),
        ("checkpoint-4", "holds notes.txt, which no checkpoint writes"),
        ("checkpoint-99", "is no checkpoint (it has no trainer_state.json)"),
    ]:
        assert error_line(run_cli("train", config, "--overwrite")) == f"{refused}{folder} {why}{move}"
        assert _files(out) == before
        shutil.move(out / folder, tmp_path / folder)
        before = _files(out)
    assert run_cli("train", config, "--overwrite")[0] == 0
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2"]


# ----- preflight: before any weights load -----


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (lambda tmp: tmp / "file.txt" / "out", "cannot be created: "),
        (lambda tmp: Path("/proc/qlora-output"), "cannot be created: "),
        (lambda tmp: Path("/proc"), "is not writable: "),
        (lambda tmp: tmp / "file.txt", "exists and is not a folder"),
    ],
)
def test_an_unusable_output_dir_is_one_line_before_loading(tmp_path, run_cli, monkeypatch, where, message):
    (tmp_path / "file.txt").write_text("x")
    config = write_run(tmp_path / "run")
    monkeypatch.setattr(QLoRAModel, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    line = error_line(run_cli("train", config, "--set", f"output_dir={where(tmp_path)}"))
    assert message in line and str(where(tmp_path)) in line


def test_space_estimate_covers_two_checkpoints_and_the_adapter(tmp_path):
    result = train(load_config(write_run(tmp_path / "run", max_steps=2, save_steps=1)))
    config = read_checkpoint_config(result.checkpoint)
    used = sum(
        p.stat().st_size for p in result.output_dir.rglob("*") if p.is_file() and p.name != "metrics.jsonl"
    )
    needed = space_needed(read_spec(Path(config.base_model)), config)
    assert used <= needed < used + (3 << 20)


def _unshare_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    not _unshare_available(), reason="needs user namespaces to mount a small tmpfs without root"
)


def _on_tmpfs(size: str, out: Path, script: str) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace where `out` is a tmpfs of `size`: a real disk
    that really fills up, mounted without root."""
    out.mkdir(parents=True, exist_ok=True)
    mount = f"mount -t tmpfs -o size={size} none {out} && {script}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@needs_tmpfs
def test_too_little_free_space_is_refused_before_loading(tmp_path):
    config = write_run(tmp_path / "run", max_steps=2)
    out = tmp_path / "run" / "out"
    proc = _on_tmpfs("200k", out, f"{sys.executable} -m qlora_cli train {config}")
    line = _one_line(proc, 2)
    assert f"output_dir {out} has" in line and "two checkpoints and the final adapter" in line


# ----- a full disk or another OS error while writing -----


CHECK_AFTER_DISK_FULL = """
import sys
from pathlib import Path
from qlora_cli.rundir.checkpoint import checkpoint_problem
out = Path(sys.argv[1])
for folder in sorted(out.iterdir(), key=lambda p: (len(p.name), p.name)):
    if folder.is_dir():
        print(folder.name, checkpoint_problem(folder) or "complete")
"""


@needs_tmpfs
def test_disk_full_after_a_checkpoint_keeps_it_and_stops(tmp_path):
    config = write_run(tmp_path / "run", max_steps=40, save_steps=2)
    out = tmp_path / "run" / "out"
    check = tmp_path / "check.py"
    check.write_text(CHECK_AFTER_DISK_FULL)
    fill = f"while [ ! -d {out}/checkpoint-2 ]; do sleep 0.02; done; cat /dev/zero > {out}/filler 2>/dev/null"
    script = (
        f"{sys.executable} -m qlora_cli train {config} & {fill}; wait $!; code=$?; "
        f"{sys.executable} {check} {out}; exit $code"
    )
    proc = _on_tmpfs("16m", out, script)
    line = _one_line(proc, 1)
    assert "No space left on device" in line and str(out) in line
    # The disk fills while training goes on, so a later checkpoint may still have fitted; every one
    # left is complete, and the line names the newest.
    kept = [row.split(" ", 1) for row in proc.stdout.splitlines()]
    assert kept[0] == ["checkpoint-2", "complete"], proc.stdout
    assert all(name.startswith("checkpoint-") and state == "complete" for name, state in kept), proc.stdout
    assert f"the last complete checkpoint is still {out / kept[-1][0]}" in line


def test_a_refused_checkpoint_write_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    config = write_run(tmp_path / "run", max_steps=6, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _cli(["train", config], file_size_limit=40_000)
    line = _one_line(proc, 1)
    assert f"could not write checkpoint {out / 'checkpoint-2'}" in line and "File too large" in line
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_the_previous_checkpoint_survives_a_refused_save(tmp_path, monkeypatch):
    path = write_run(tmp_path / "run", max_steps=4, save_steps=2)
    real_save = checkpoint_module.save_tensors

    def refuse_second_checkpoint(tensors, path, *args, **kwargs):
        if "-4-" in path.parent.name and path.name == "optimizer.safetensors":
            with open("/dev/full", "wb") as full:
                full.write(b"x" * 4096)
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_tensors", refuse_second_checkpoint)
    with pytest.raises(QLoraError, match="No space left on device") as error:
        train(load_config(path))
    out = tmp_path / "run" / "out"
    assert f"could not write checkpoint {out / 'checkpoint-4'}" in str(error.value)
    assert f"the last complete checkpoint is still {out / 'checkpoint-2'}" in str(error.value)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2") is None


def test_a_refused_metrics_write_stops_the_run_in_one_line(tmp_path):
    config = write_run(tmp_path / "run", max_steps=30)
    proc = _cli(["train", config], file_size_limit=1500)
    line = _one_line(proc, 1)
    assert f"could not write metrics: {tmp_path / 'run' / 'out' / 'metrics.jsonl'}: File too large" in line


def test_a_refused_export_write_is_one_line_and_leaves_nothing(tmp_path):
    config = write_run(tmp_path / "run", max_steps=2)
    assert _cli(["train", config]).returncode == 0
    proc = _cli(["export", tmp_path / "run" / "out", "--out", tmp_path / "exported"], file_size_limit=10_000)
    line = _one_line(proc, 1)
    assert f"could not write the export to {tmp_path / 'exported'}" in line and "File too large" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ----- portable runs -----


def test_a_run_resumes_and_exports_from_any_directory(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_run(run, max_steps=4, save_steps=2)
    relative = yaml.safe_load((run / "config.yaml").read_text())
    relative.update(
        base_model="model", output_dir="out", datasets=[{"path": "train.jsonl", "type": "chat_template"}]
    )
    (run / "config.yaml").write_text(yaml.safe_dump(relative))
    assert _cli(["train", "config.yaml", "--set", "max_steps=2"], cwd=run).returncode == 0
    saved = read_checkpoint_config(run / "out" / "checkpoint-2")
    assert saved.base_model == str(run / "model") and saved.datasets[0].path == str(run / "train.jsonl")
    assert saved.output_dir == str(run / "out")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _cli(
        ["resume", run / "out", "--set", "max_steps=4", "--set", f"base_model={run / 'model'}"], cwd=elsewhere
    )
    assert proc.returncode == 0, proc.stderr
    proc = _cli(
        ["resume", run / "out", "--set", "max_steps=4", "--set", "base_model=../run/model"], cwd=elsewhere
    )
    assert proc.returncode == 0, proc.stderr
    assert _cli(["export", run / "out", "--out", "adapter"], cwd=elsewhere).returncode == 0
    adapter_config = json.loads((elsewhere / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(run / "model")

    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tmp_path)
    AutoPeftModelForCausalLM.from_pretrained(elsewhere / "adapter")


def test_a_run_follows_its_base_model_to_a_new_folder_with_the_same_weights(tmp_path, run_cli):
    """The base folder moved: resume, export and generate name --base-model, take the new folder when it
    holds the recorded weights, and refuse another model of the same shape, naming what differs."""
    config = write_run(tmp_path / "run", max_steps=2, save_steps=2)
    assert run_cli("train", config)[0] == 0
    out, checkpoint = tmp_path / "run" / "out", tmp_path / "run" / "out" / "checkpoint-2"
    moved = tmp_path / "moved" / "model"
    moved.parent.mkdir()
    shutil.move(tmp_path / "run" / "model", moved)
    commands = [
        ("resume", out, "--set", "max_steps=3"),
        ("export", checkpoint, "--out", tmp_path / "adapter"),
        ("generate", checkpoint, "--prompt", "hi", "--max-new-tokens", "2"),
    ]
    for command in commands:
        line = error_line(run_cli(*command))
        assert f"model folder {tmp_path / 'run' / 'model'} does not exist" in line, command
        assert line.endswith("if it moved, give its new place with --base-model PATH"), command

    other = add_demo_tokenizer(write_qwen3(tmp_path / "other", vocab_size=1024, seed=1))
    for command in commands:
        line = error_line(run_cli(*command, "--base-model", other))
        assert line == (
            f"error: {other} is not the base model checkpoint {checkpoint} trained on "
            f"({tmp_path / 'run' / 'model'}): model.safetensors holds other values (the same tensors, other bytes)"
        ), command

    found = f"note: base model found at {moved}, with the weights checkpoint {checkpoint} trained on"
    for command in commands:
        code, _, err = run_cli(*command, "--base-model", moved)
        assert code == 0 and found in " ".join(err.split()), (command, err)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(moved)
    assert read_checkpoint_config(out / "checkpoint-3").base_model == str(moved)
    assert run_cli("resume", out, "--set", "max_steps=4")[0] == 0

    shutil.copy(other / "model.safetensors", moved / "model.safetensors")
    line = error_line(run_cli("export", out, "--out", tmp_path / "again"))
    assert line.startswith(f"error: the base model {moved} changed since checkpoint {out / 'checkpoint-4'}")


def test_a_checkpoint_without_a_base_fingerprint_takes_the_new_folder_with_a_note(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2, save_steps=2)
    assert run_cli("train", config)[0] == 0
    checkpoint = tmp_path / "run" / "out" / "checkpoint-2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["base_weights"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    as_written_before_manifests(checkpoint)  # as checkpoints written before either
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "run" / "model", moved)
    code, _, err = run_cli("export", checkpoint, "--out", tmp_path / "adapter", "--base-model", moved)
    assert code == 0, err
    assert (
        f"note: checkpoint {checkpoint} records no fingerprint of its base (written before qlora kept one), "
        f"so {moved} is used unchecked in place of {tmp_path / 'run' / 'model'}"
    ) in " ".join(err.split())


def _base_copy(base: Path, folder: Path, change_config=None) -> Path:
    """A copy of the base folder, its config.json changed by `change_config` (on the parsed object)."""
    shutil.copytree(base, folder)
    if change_config is not None:
        config = json.loads((folder / "config.json").read_text())
        change_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_base_whose_config_json_computes_otherwise_is_refused_naming_the_field(tmp_path, run_cli):
    """Llama 3's weights under a config.json with rope_theta 10,000 (not 500,000) or a RoPE factor of 2
    (not 8) answer otherwise: refused, in a folder given as --base-model and in place. Another tokenizer
    file is a note. A checkpoint whose record predates the config's takes any config.json, with a note."""
    config = write_run(
        tmp_path / "run", model_writer=write_llama, chat_template="llama3", max_steps=1, save_steps=1
    )
    assert run_cli("train", config)[0] == 0
    base, out = tmp_path / "run" / "model", tmp_path / "run" / "out"
    checkpoint = out / "checkpoint-1"
    generate = ("generate", checkpoint, "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    theta = _base_copy(base, tmp_path / "theta", lambda c: c["rope_parameters"].update(rope_theta=10000.0))
    factor = _base_copy(base, tmp_path / "factor", lambda c: c["rope_parameters"].update(factor=2.0))
    for folder, field, now, before in [
        (theta, "rope_theta", "10000.0", "500000.0"),
        (factor, "rope_scaling.factor", "2.0", "8.0"),
    ]:
        line = error_line(run_cli(*generate, "--base-model", folder))
        assert line == (
            f"error: {folder} is not the base model checkpoint {checkpoint} trained on ({base}): "
            f"config.json's {field} is {now} where the trained-on one had {before}"
        )

    retokenized = _base_copy(base, tmp_path / "retokenized")
    tokenizer_config = json.loads((retokenized / "tokenizer_config.json").read_text())
    (retokenized / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "model_max_length": 64})
    )
    code, _, err = run_cli(*generate, "--base-model", retokenized)
    assert code == 0, err
    assert (
        f"note: the tokenizer files of {retokenized} are not those checkpoint {checkpoint} trained with "
        "(another tokenizer_config.json): text may become other token ids, or chats another prompt, than in "
        "training"
    ) in " ".join(err.split())

    shutil.copy(factor / "config.json", base / "config.json")
    line = error_line(run_cli("resume", out, "--set", "max_steps=2"))
    assert line == (
        f"error: the base model {base} changed since checkpoint {checkpoint} was written: "
        "config.json's rope_scaling.factor is 2.0 where the trained-on one had 8.0"
    )

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["base_weights"]["config"], state["base_weights"]["tokenizer"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    as_written_before_manifests(checkpoint)  # as checkpoints written before either
    code, _, err = run_cli(*generate, "--base-model", theta)
    assert code == 0, err
    assert (
        f"note: checkpoint {checkpoint} records no fingerprint of its base's config.json and tokenizer "
        f"(written before qlora kept one), so those of {theta} are used unchecked"
    ) in " ".join(err.split())


def _rope(**change):
    return lambda config: config["rope_parameters"].update(change)


@pytest.mark.parametrize(
    ("writer", "change", "named"),
    [
        (write_llama, lambda c: c.update(rms_norm_eps=1e-6), "rms_norm_eps"),
        # q_proj's 64 rows as 2 heads of 32 instead of 4 of 16: the same weights, other attention.
        (write_llama, lambda c: c.update(num_attention_heads=2, head_dim=32), "num_attention_heads"),
        (write_llama, lambda c: c.update(num_key_value_heads=1), "num_key_value_heads"),
        (write_llama, lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
        (write_llama, _rope(rope_type="default"), "rope_scaling.rope_type"),
        (write_llama, _rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (
            functools.partial(write_mistral, sliding_window=64),
            lambda c: c.update(sliding_window=32),
            "sliding_window",
        ),
        (write_qwen3_5, lambda c: c["layer_types"].reverse(), "layer_types"),
        (write_llama, lambda c: c.update(max_position_embeddings=512), None),
    ],
    ids=[
        "eps",
        "heads",
        "kv-heads",
        "tied",
        "rope-type",
        "partial-rotary",
        "window",
        "layer-types",
        "context",
    ],
)
def test_the_base_fingerprint_holds_each_config_field_the_model_computes_with(
    tmp_path, writer, change, named
):
    """Every ModelSpec field that changes what the layers compute; a longer context changes none of it."""
    base = writer(tmp_path / "base")
    recorded = json.loads(json.dumps(base_fingerprint(base)))  # as trainer_state.json keeps it
    assert config_difference(recorded, base_fingerprint(_base_copy(base, tmp_path / "same"))) is None
    difference = config_difference(recorded, base_fingerprint(_base_copy(base, tmp_path / "changed", change)))
    if named is None:
        assert difference is None
    else:
        assert difference is not None and difference.startswith(f"config.json's {named} is "), difference


def test_a_hub_base_is_found_by_its_id_and_cannot_be_replaced(tmp_path):
    config = load_config(write_run(tmp_path / "run"))
    config = dataclasses.replace(config, base_model="org/model", revision="0" * 40)
    with pytest.raises(QLoraError, match="trained on hub repo 'org/model'.*local base folder only"):
        checkpoint_base(tmp_path, config, str(tmp_path / "run" / "model"))
    assert checkpoint_base(tmp_path, config, None) == (config, [])


def test_a_signal_after_the_done_line_is_ignored(tmp_path, run_cli):
    """Once train, resume or export prints `done:`, the work is on disk: a Ctrl-C in the moment before
    the process exits neither turns the exit into 130 nor prints a traceback from interpreter shutdown."""
    config = write_run(tmp_path / "run", max_steps=1)
    try:
        for command in (("train", config), ("export", tmp_path / "run" / "out", "--out", tmp_path / "x")):
            code, _, err = run_cli(*command)
            assert code == 0 and "done: " in err, err
            assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in (signal.SIGINT, signal.SIGTERM))
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_signal_after_data_or_generate_has_printed_is_ignored(tmp_path, run_cli):
    """data and generate end with their report or completions, not `done:`: a Ctrl-C while the process
    exits after them (torch's teardown takes a moment) must not turn the exit into 130 either."""
    config = write_run(tmp_path / "run", max_steps=1)
    generate = ("generate", config, "--base-only", "--prompt", "Hi", "--max-new-tokens", "2")
    try:
        for command in (("data", config), generate):
            code, _, err = run_cli(*command)
            assert code == 0, err
            assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in (signal.SIGINT, signal.SIGTERM))
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_saved_files_follow_the_umask(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    assert run_cli("export", out, "--out", tmp_path / "adapter")[0] == 0
    mask = os.umask(0o022)
    os.umask(mask)
    expected = 0o666 & ~mask
    for path in [*out.rglob("*.safetensors"), *(tmp_path / "adapter").glob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


# ----- a damaged checkpoint -----


def test_resume_with_a_corrupt_newest_checkpoint_names_the_one_to_use(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=4, save_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    adapter = out / "checkpoint-4" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    line = error_line(run_cli("resume", out, "--set", "max_steps=6"))
    assert str(out / "checkpoint-4") in line and "corrupt" in line
    assert line.endswith(f"`qlora resume {out} --checkpoint {out / 'checkpoint-2'} --set max_steps=6`")
    assert f"qlora export {out / 'checkpoint-2'}" in error_line(
        run_cli("export", out, "--out", tmp_path / "x")
    )
    code, _, err = run_cli(*suggested(line))
    assert code == 0, err
    assert checkpoint_problem(out / "checkpoint-4") is None
    assert (out / "superseded-checkpoint-4" / "adapter_model.safetensors").stat().st_size == 100
    assert load_file(out / "checkpoint-6" / "adapter_model.safetensors")
    assert read_trainer_state(out / "checkpoint-6").step == 6


def test_resume_export_and_generate_read_a_damaged_adapter_alike(tmp_path, run_cli):
    """Given the checkpoint folder itself, all three refuse a missing or a truncated adapter with the
    same line, naming the checkpoint and the file."""
    config = write_run(tmp_path / "run", max_steps=2, save_steps=2)
    assert run_cli("train", config)[0] == 0
    checkpoint = tmp_path / "run" / "out" / "checkpoint-2"
    adapter = checkpoint / "adapter_model.safetensors"
    saved = adapter.read_bytes()
    commands = [
        ("resume", checkpoint.parent, "--checkpoint", checkpoint),
        ("export", checkpoint, "--out", tmp_path / "x"),
        ("generate", checkpoint, "--prompt", "hi"),
    ]
    for damage, expected in [
        (adapter.unlink, f"checkpoint {checkpoint} is incomplete: adapter_model.safetensors is missing"),
        (lambda: adapter.write_bytes(saved[:100]), f"{adapter} is corrupt: "),
    ]:
        damage()
        for command in commands:
            assert error_line(run_cli(*command)).startswith(f"error: {expected}"), command


def _change_a_byte_inside(path: Path) -> None:
    """Other bytes at the same size: a safetensors file that still loads."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_bytes_changed_inside_is_refused_naming_the_newest_intact_one(tmp_path, run_cli):
    """Resuming a finished run must not copy a damaged checkpoint over the final adapter: its manifest's
    SHA-256 finds the change, and resume, export and generate name the newest intact checkpoint."""
    config = write_run(tmp_path / "run", max_steps=4, save_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    final = (out / "adapter_model.safetensors").read_bytes()
    adapter = out / "checkpoint-4" / "adapter_model.safetensors"
    _change_a_byte_inside(adapter)
    assert load_file(adapter)
    corrupt = f"error: {adapter} is corrupt: its SHA-256 is not the one its manifest recorded"
    line = error_line(run_cli("resume", out))
    assert line.startswith(corrupt) and f"qlora resume {out} --checkpoint {out / 'checkpoint-2'}" in line
    assert (out / "adapter_model.safetensors").read_bytes() == final
    assert f"qlora export {out / 'checkpoint-2'}" in error_line(
        run_cli("export", out, "--out", tmp_path / "x")
    )
    for command in [
        ("resume", out, "--checkpoint", out / "checkpoint-4"),
        ("export", out / "checkpoint-4", "--out", tmp_path / "x"),
        ("generate", out / "checkpoint-4", "--prompt", "hi"),
    ]:
        line = error_line(run_cli(*command))
        assert line.startswith(corrupt), command
        assert line.endswith(f"the newest intact checkpoint of this run is {out / 'checkpoint-2'}"), command
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_that_lost_its_manifest_is_damaged(tmp_path, run_cli):
    """A checkpoint whose trainer state says it was written with a manifest, and that has none, lost it:
    with its adapter's bytes changed as well, resume and export refuse it naming the newest intact one,
    and the final adapter stays as it was."""
    config = write_run(tmp_path / "run", max_steps=4, save_steps=2)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    final = (out / "adapter_model.safetensors").read_bytes()
    (out / "checkpoint-4" / "manifest.json").unlink()
    _change_a_byte_inside(out / "checkpoint-4" / "adapter_model.safetensors")
    damaged = f"error: checkpoint {out / 'checkpoint-4'} is damaged: its manifest.json is missing"
    line = error_line(run_cli("resume", out))
    assert line.startswith(damaged), line
    assert line.endswith(f"continue from it with `qlora resume {out} --checkpoint {out / 'checkpoint-2'}`")
    assert (out / "adapter_model.safetensors").read_bytes() == final
    line = error_line(run_cli("export", out, "--out", tmp_path / "x"))
    assert line.startswith(damaged) and f"qlora export {out / 'checkpoint-2'}" in line
    for command in [
        ("resume", out, "--checkpoint", out / "checkpoint-4"),
        ("export", out / "checkpoint-4", "--out", tmp_path / "x"),
    ]:
        line = error_line(run_cli(*command))
        assert line.startswith(damaged), command
        assert line.endswith(f"the newest intact checkpoint of this run is {out / 'checkpoint-2'}"), command
    assert not (tmp_path / "x").exists()


def test_a_newest_checkpoint_without_its_trainer_state_is_damaged(tmp_path, run_cli):
    """A checkpoint folder that lost its trainer state (the file that marks a checkpoint) is named as
    damaged, as one missing any other file is, not passed over for an older one without a word; an
    older one in that state (a removal killed midway) is never in the way."""
    config = write_run(tmp_path / "run", max_steps=6, save_steps=2, save_total_limit=5)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    (out / "checkpoint-2" / "trainer_state.json").unlink()
    assert run_cli("export", out, "--out", tmp_path / "ok")[0] == 0
    (out / "checkpoint-6" / "trainer_state.json").unlink()
    missing = f"error: checkpoint {out / 'checkpoint-6'} is incomplete: trainer_state.json is missing"
    line = error_line(run_cli("export", out, "--out", tmp_path / "x"))
    assert line.startswith(missing) and line.endswith(f"`qlora export {out / 'checkpoint-4'} --out …`")
    line = error_line(run_cli("resume", out))
    assert line.startswith(missing) and f"qlora resume {out} --checkpoint {out / 'checkpoint-4'}" in line
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_written_before_manifests_still_loads(tmp_path):
    config, model, optimizer = _tiny_model(tmp_path)
    folder = save_checkpoint(tmp_path / "out", 2, model, optimizer, TrainerState(2, run_id="old"), config)
    as_written_before_manifests(folder)
    assert checkpoint_problem(folder) is None
    assert checkpoint_module.load_checkpoint(folder, model, optimizer).step == 2
    assert read_checkpoint_config(folder).lora_r == config.lora_r


# ----- signals: the first saves, the second asks for patience, the third aborts -----

SLOW_SAVE = """
import os, time
from qlora_cli.rundir import checkpoint
real = checkpoint.save_tensors
def slow(tensors, path, *args, **kwargs):
    real(tensors, path, *args, **kwargs)
    if path.parent.name.startswith(".tmp-checkpoint-4-"):
        open(os.environ["QLORA_TEST_MARKER"], "w").close()
        time.sleep(60)
checkpoint.save_tensors = slow
"""

# The child signals itself from inside the save of checkpoint-2, after its adapter is written: the
# handler runs there, while the save is under way, whatever the machine's speed.
SIGNAL_DURING_SAVE = """
import signal
from qlora_cli.rundir import checkpoint
real = checkpoint.save_tensors
def signalling(tensors, path, *args, **kwargs):
    real(tensors, path, *args, **kwargs)
    if path.parent.name.startswith(".tmp-checkpoint-2-") and path.name == "adapter_model.safetensors":
        signal.raise_signal(signal.SIGINT)
checkpoint.save_tensors = signalling
"""

# Two more SIGINT once the run, stopped after that save, closes its trackers (as a W&B upload would take).
SIGNALS_WHILE_CLOSING = (
    SIGNAL_DURING_SAVE
    + """
from qlora_cli.train import trackers
real_exit = trackers.Trackers.__exit__
def closing(self, *exc):
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)
    return real_exit(self, *exc)
trackers.Trackers.__exit__ = closing
"""
)

# Three SIGINT reach the process while its main thread cannot run Python (as during a long tensor write
# in C): another thread raises them at itself, so each is delivered at once and none is merged by the
# kernel, while the main thread waits for that thread; Python then runs its handler once for all three.
THREE_SIGNALS_IN_ONE_HANDLER_CALL = """
import signal, sys, threading
from qlora_cli.rundir import checkpoint
real = checkpoint.save_tensors
def three_signals():
    for _ in range(3):
        signal.raise_signal(signal.SIGINT)
def signalling(tensors, path, *args, **kwargs):
    real(tensors, path, *args, **kwargs)
    if path.parent.name.startswith(".tmp-checkpoint-4-") and path.name == "adapter_model.safetensors":
        sys.setswitchinterval(1000)
        sender = threading.Thread(target=three_signals)
        sender.start()
        sender.join()
checkpoint.save_tensors = signalling
"""

# Each step lasts half a second and marks its start (MARKER.step-N), so quick signals 30 ms apart sent
# once a step has begun all land inside it however fast the machine trains.
SLOW_STEP = """
import os, time
from qlora_cli.train import loop as train
real = train.train_step
def slow(run, step, *args, **kwargs):
    open(os.environ["QLORA_TEST_MARKER"] + f".step-{step + 1}", "w").close()
    time.sleep(0.5)
    return real(run, step, *args, **kwargs)
train.train_step = slow
"""


# A Ctrl-C pressed just after the command starts: the child signals itself as its first import of torch
# begins, which is where a start-up spends its first second.
SIGNAL_WHILE_TORCH_IMPORTS = """
import signal, sys
class SignalOnTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, SignalOnTorch())
"""


# After a script's patch, the child trains the config given as its argument.
TRAIN_WITH_THE_PATCH = """
import sys
sys.argv = ["qlora", "train", sys.argv[1]]
from qlora_cli.cli import main
main()
"""


def _start_training(tmp_path, config, script: str | None = None) -> subprocess.Popen:
    marker = tmp_path / "saving"
    command = [sys.executable, "-m", "qlora_cli", "train", str(config)]
    if script is not None:
        (tmp_path / "child.py").write_text(script + TRAIN_WITH_THE_PATCH)
        command = [sys.executable, str(tmp_path / "child.py"), str(config)]
    return subprocess.Popen(
        command,
        env=subprocess_env(QLORA_TEST_MARKER=str(marker)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _signal(proc: subprocess.Popen, times: int, gap: float = 0.03) -> tuple[int, str]:
    for _ in range(times):
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()][-1]


def test_a_signal_before_the_first_step_stops_at_once_with_a_line(tmp_path):
    config = write_run(tmp_path / "run", max_steps=40)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config)
    _wait_for(out / RUN_FILE, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received before the first step; nothing was saved" in _last_line(err)


def test_a_signal_before_a_resumes_first_step_names_the_checkpoints_it_keeps(tmp_path, run_cli, monkeypatch):
    """A fresh run has nothing saved before its first step (above); a resumed one keeps its checkpoints."""
    config = write_run(tmp_path / "run", max_steps=2, save_steps=1)
    assert run_cli("train", config)[0] == 0
    out = tmp_path / "run" / "out"
    before = {p: p.read_bytes() for p in out.glob("checkpoint-*/*") if p.is_file()}
    real_build_run = train_loop.build_run

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real_build_run(*args, **kwargs)

    monkeypatch.setattr(train_loop, "build_run", interrupted)
    code, _, err = run_cli("resume", out, "--set", "max_steps=4")
    assert code == 128 + signal.SIGINT, err
    assert _last_line(err) == (
        "interrupted: SIGINT received before the first step; no new checkpoint was written, and the earlier "
        f"ones are kept: the last complete checkpoint is {out / 'checkpoint-2'}; continue with "
        f"`qlora resume {out}`"
    )
    assert {p: p.read_bytes() for p in out.glob("checkpoint-*/*") if p.is_file()} == before


def test_a_ctrl_c_while_the_command_starts_up_stops_with_a_line(tmp_path):
    """The CLI answers signals before it imports torch, so a Ctrl-C during start-up is no traceback."""
    config = write_run(tmp_path / "run", max_steps=40)
    proc = _start_training(tmp_path, config, SIGNAL_WHILE_TORCH_IMPORTS)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "interrupted: SIGINT received" in _last_line(err)
    assert not (tmp_path / "run" / "out").exists()


def test_a_second_ctrl_c_asks_for_patience_and_the_checkpoint_is_saved(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=1)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, SLOW_STEP)
    _wait_for(tmp_path / "saving.step-2", proc)
    code, err = _signal(proc, 2)
    assert code == 128 + signal.SIGINT
    assert "finishing step" in err and "please wait" in err
    last = _last_line(err)
    assert (
        last.startswith("stopped: SIGINT received, so the run ended after step")
        and f"qlora resume {out}" in last
    )
    assert checkpoint_problem(latest_checkpoint(out)) is None


def test_three_quick_ctrl_c_abort_and_name_the_last_checkpoint(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, SLOW_STEP)
    _wait_for(tmp_path / "saving.step-3", proc)
    code, err = _signal(proc, 3)
    assert code == 128 + signal.SIGINT
    last = _last_line(err)
    assert "SIGINT received three times: aborted during step" in last
    assert f"the last complete checkpoint is {out}/checkpoint-" in last and f"qlora resume {out}" in last
    for _, folder in list_checkpoints(out):
        assert checkpoint_problem(folder) is None
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-checkpoint")]


def test_a_third_ctrl_c_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, SLOW_SAVE)
    _wait_for(tmp_path / "saving", proc)
    code, err = _signal(proc, 3)
    assert code == 128 + signal.SIGINT
    assert "received again" in err
    last = _last_line(err)
    assert (
        "aborted while saving the checkpoint of step 4 without saving it; "
        f"the last complete checkpoint is {out / 'checkpoint-2'}" in last
    )
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2") is None


def test_a_ctrl_c_during_a_save_stops_right_after_it(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, SIGNAL_DURING_SAVE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT received: finishing the checkpoint of step 2, then stopping" in err
    assert _last_line(err).startswith(
        f"stopped: SIGINT received, so the run ended after step 2; its checkpoint is {out / 'checkpoint-2'}; "
    )
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2") is None


def test_three_ctrl_c_that_python_answers_in_one_call_still_abort(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, THREE_SIGNALS_IN_ONE_HANDLER_CALL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "received again" in err
    assert (
        "SIGINT received three times: aborted while saving the checkpoint of step 4 without saving it; "
        f"the last complete checkpoint is {out / 'checkpoint-2'}" in _last_line(err)
    )
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2"]


def test_a_third_ctrl_c_while_the_stopped_run_closes_says_its_checkpoint_is_saved(tmp_path):
    config = write_run(tmp_path / "run", max_steps=400, save_steps=2)
    out = tmp_path / "run" / "out"
    proc = _start_training(tmp_path, config, SIGNALS_WHILE_CLOSING)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT received again: the checkpoint of step 2 is saved; closing the run" in err
    assert _last_line(err).startswith(
        "interrupted: SIGINT received three times: aborted while closing the run, after saving the "
        f"checkpoint of step 2; the last complete checkpoint is {out / 'checkpoint-2'}; "
    )
    assert checkpoint_problem(out / "checkpoint-2") is None


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_reader_that_goes_away_does_not_stop_the_command(command, tmp_path):
    """`qlora train ... | head -2`: once the pipes close, the run still trains, saves and logs, and
    exits 0 as it would have (it died at its next line, with no checkpoint kept)."""
    config = write_run(tmp_path / "run", max_steps=4, save_steps=2)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qlora_cli",
            command,
            str(config),
            *(["--show", "3"] if command == "data" else []),
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    child.stdout.close()
    child.stderr.close()
    assert child.wait(timeout=600) == 0
    if command == "train":
        out = tmp_path / "run" / "out"
        assert (out / "adapter_model.safetensors").is_file() and (out / "checkpoint-4").is_dir()
        assert "finished: 4 steps" in (out / "train.log").read_text()
