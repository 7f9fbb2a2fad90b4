"""Experiment trackers, each read back from the files its own tool writes: W&B offline run files,
TensorBoard event files, an MLflow file store. No network: W&B runs offline."""

import io
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from checkpoints import subprocess_env
from rich.console import Console

from qlora_cli.config.loading import config_from_dict
from qlora_cli.core.errors import QLoraError, RunInterrupted
from qlora_cli.train.trackers import Trackers, flat_params, tracker_metrics

RECORDS = [
    {"step": 1, "loss": 2.5, "lr": 1e-4, "grad_norm": 0.8, "tokens_per_s": 100.0, "memory_gib": None},
    {"step": 2, "loss": 2.0, "lr": 2e-4, "grad_norm": 0.6, "tokens_per_s": 120.0, "eval_loss": 2.25},
]


def _config(**keys):
    return config_from_dict({"base_model": "unused", "datasets": [{"path": "unused.jsonl"}], **keys})


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_records_become_train_and_eval_metrics():
    record = {"step": 3, "loss": 1.5, "memory_gib": None, "memory_gib_per_rank": [2.0, 3.0], "eval_ppl": 4.0}
    assert tracker_metrics(record) == {
        "train/loss": 1.5,
        "train/memory_gib_per_rank/rank0": 2.0,
        "train/memory_gib_per_rank/rank1": 3.0,
        "eval/ppl": 4.0,
    }


def test_config_parameters_are_flat_strings():
    params = flat_params(_config(lora_r=8))
    assert params["lora_r"] == "8"
    assert params["datasets.0.path"] == "unused.jsonl"
    assert params["lora_target_modules"].startswith("['q_proj'")


# W&B writes a run as a LevelDB-style log of protobuf records: 32 KiB blocks of chunks, each with a
# 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last), after a 7-byte file header.
def wandb_records(run_dir: Path):
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, chunks, block = 7, [], 32768
    while position + 7 <= len(data):
        room = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if room < 7 or (kind == 0 and length == 0):
            position += room
            continue
        if position + 7 + length > len(data):
            return  # W&B is still writing this record
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_run(run_dir: Path) -> dict:
    """The run's id, project, name, config, logged history rows and artifacts, from its run file.

    W&B's service process may still be writing the file when `finish` returns: wait for the exit record.
    """
    import json

    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_dir)):
        assert time.monotonic() < deadline, f"no exit record in {run_dir}"
        time.sleep(0.2)
    run = {"history": [], "artifacts": []}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
            run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            items = record.history.item
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "artifact":
            run["artifacts"].append((record.artifact.name, set(record.artifact.aliases)))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


@pytest.fixture
def offline_wandb(monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_run_reads_back_and_resume_continues_it(tmp_path, offline_wandb):
    out = tmp_path / "out"
    config = _config(
        wandb_project="qlora-tests", wandb_name="tiny", wandb_mode="offline", wandb_log_model="end"
    )
    with Trackers(config).start(out, 0, None) as trackers:
        for record in RECORDS:
            trackers.log(record)
        trackers.saved(_adapter(out / "checkpoint-2"), 2)
        state = trackers.state()
    (first,) = (out / "wandb").glob("offline-run-*")
    run = wandb_run(first)
    assert (run["id"], run["project"], run["name"]) == (state["wandb_run_id"], "qlora-tests", "tiny")
    assert run["config"]["lora_r"] == 16 and run["config"]["datasets"][0]["path"] == "unused.jsonl"
    steps = [(row["train/global_step"], row["train/loss"]) for row in run["history"]]
    assert steps == [(1, 2.5), (2, 2.0)]
    assert run["history"][1]["eval/loss"] == 2.25 and "train/memory_gib" not in run["history"][0]
    assert run["artifacts"] == [(f"adapter-{run['id']}", {"step-2", "latest"})]
    assert run["exit_code"] == 0

    with pytest.raises(RunInterrupted), Trackers(config).start(out, 2, state) as trackers:
        trackers.log({"step": 3, "loss": 1.5})
        raise RunInterrupted("SIGTERM received", 15)
    (second,) = set((out / "wandb").glob("offline-run-*")) - {first}
    resumed = wandb_run(second)
    assert resumed["id"] == run["id"]
    assert [(row["train/global_step"], row["train/loss"]) for row in resumed["history"]] == [(3, 1.5)]
    assert resumed["artifacts"] == [] and resumed["exit_code"] == 1


def test_wandb_run_id_from_the_config_names_the_run(tmp_path, offline_wandb):
    config = _config(wandb_project="p", wandb_mode="offline", wandb_run_id="chosen1")
    with Trackers(config).start(tmp_path, 0, None) as trackers:
        assert trackers.state() == {"wandb_run_id": "chosen1"}
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert wandb_run(run_dir)["id"] == "chosen1"


def test_wandb_log_model_checkpoint_uploads_each_checkpoints_adapter(tmp_path, offline_wandb):
    config = _config(wandb_project="p", wandb_mode="offline", wandb_log_model="checkpoint")
    with Trackers(config).start(tmp_path, 0, None) as trackers:
        for step in (1, 2):
            trackers.saved(_adapter(tmp_path / f"checkpoint-{step}"), step)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    run = wandb_run(run_dir)
    name = f"adapter-{run['id']}"
    assert run["artifacts"] == [(name, {"step-1", "latest"}), (name, {"step-2", "latest"})]


def test_wandb_notes_and_disabled_mode(tmp_path):
    watched = Trackers(_config(wandb_project="p", wandb_mode="disabled", wandb_watch="gradients"))
    assert watched.modules == {} and watched.notes == []
    orphan = Trackers(_config(wandb_name="n", wandb_entity="e"))
    assert orphan.notes == ["wandb_entity, wandb_name set without wandb_project: nothing is logged to W&B"]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_events_read_back_and_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    config = _config(use_tensorboard=True)
    with Trackers(config).start(tmp_path, 0, None) as trackers:
        for record in RECORDS:
            trackers.log(record)
        trackers.log({"step": 3, "loss": 9.0})
    scalars = tensorboard_scalars(tmp_path / "runs")
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0), (3, 9.0)]
    assert scalars["eval/loss"] == [(2, 2.25)]
    # The interrupted run logged step 3 after its last checkpoint (step 2); the resumed run redoes it.
    with Trackers(config).start(tmp_path, 2, {}) as trackers:
        trackers.log({"step": 3, "loss": 1.5})
    assert tensorboard_scalars(tmp_path / "runs")["train/loss"] == [(1, 2.5), (2, 2.0), (3, 1.5)]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_file_store_reads_back_and_resume_continues_the_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    config = _config(mlflow_tracking_uri=mlflow_store, mlflow_experiment_name="tiny", mlflow_run_name="r1")
    with Trackers(config).start(tmp_path / "out", 0, None) as trackers:
        for record in RECORDS:
            trackers.log(record)
        state = trackers.state()
    client = MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_id == state["mlflow_run_id"]
    assert (run.info.run_name, run.info.status) == ("r1", "FINISHED")
    assert run.data.params["lora_r"] == "16" and run.data.params["datasets.0.path"] == "unused.jsonl"

    def history(name):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]

    assert history("train/loss") == [(1, 2.5), (2, 2.0)]
    assert history("eval/loss") == [(2, 2.25)]

    with pytest.raises(ValueError), Trackers(config).start(tmp_path / "out", 2, state) as trackers:
        trackers.log({"step": 3, "loss": 1.5})
        raise ValueError("a failure inside the loop")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [r.info.run_id for r in runs] == [run.info.run_id]
    assert runs[0].info.status == "FAILED"
    assert history("train/loss") == [(1, 2.5), (2, 2.0), (3, 1.5)]


def test_a_metric_of_zero_reaches_every_tracker(tmp_path, offline_wandb, mlflow_store):
    """Zero is a value (lr at warmup's start, a grad_norm of frozen weights, an idle rank's memory),
    not a missing one: W&B, TensorBoard and MLflow each get it."""
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient

    record = {
        "step": 1,
        "loss": 0.0,
        "lr": 0,
        "grad_norm": 0.0,
        "memory_gib_per_rank": [0.0, 2.0],
        "eval_loss": 0.0,
    }
    expected = {
        "train/loss": 0.0,
        "train/lr": 0.0,
        "train/grad_norm": 0.0,
        "train/memory_gib_per_rank/rank0": 0.0,
        "train/memory_gib_per_rank/rank1": 2.0,
        "eval/loss": 0.0,
    }
    config = _config(
        wandb_project="p", wandb_mode="offline", use_tensorboard=True, mlflow_tracking_uri=mlflow_store
    )
    with Trackers(config).start(tmp_path, 0, None) as trackers:
        trackers.log(record)
        run_id = trackers.state()["mlflow_run_id"]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (row,) = wandb_run(run_dir)["history"]
    assert row == {**expected, "train/global_step": 1}
    assert tensorboard_scalars(tmp_path / "runs") == {name: [(1, value)] for name, value in expected.items()}
    client = MlflowClient(tracking_uri=mlflow_store)
    assert {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)] for name in expected
    } == {name: [(1, value)] for name, value in expected.items()}
    assert set(client.get_run(run_id).data.metrics) == set(expected)


def test_mlflow_run_missing_from_the_store_starts_a_new_one(tmp_path, mlflow_store):
    config = _config(mlflow_tracking_uri=mlflow_store)
    with Trackers(config) as trackers:
        trackers.start(tmp_path, 2, {"mlflow_run_id": "0123456789abcdef0123456789abcdef"})
        assert trackers.state()["mlflow_run_id"] != "0123456789abcdef0123456789abcdef"
    assert trackers.notes == [
        "MLflow run 0123456789abcdef0123456789abcdef is not in this tracking store: a new run starts"
    ]


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning(tmp_path, mlflow_store):
    """A tracking store gone away must not end the training run: the tracker stops, the run goes on."""
    import shutil

    warnings = []
    with Trackers(_config(mlflow_tracking_uri=mlflow_store)) as trackers:
        trackers.start(tmp_path, 0, None, warn=warnings.append)
        trackers.log(RECORDS[0])
        shutil.rmtree(tmp_path / "mlruns")
        trackers.log(RECORDS[1])
        assert trackers.trackers == [] and trackers.state() == {}
    (warning,) = warnings
    assert warning.startswith("[yellow]warning:[/] MLflow stopped logging: ") and "\n" not in warning


def test_mlflow_unusable_tracking_uri_is_one_line(tmp_path):
    pytest.importorskip("mlflow")
    with pytest.raises(QLoraError, match=r"^MLflow could not start a run at bogus://store: [^\n]+$"):
        Trackers(_config(mlflow_tracking_uri="bogus://store")).start(tmp_path, 0, None)


@pytest.mark.parametrize(
    "keys, module, extra",
    [
        ({"wandb_project": "p"}, "wandb", "wandb"),
        ({"use_tensorboard": True}, "tensorboard", "tensorboard"),
        ({"mlflow_tracking_uri": "file:./mlruns"}, "mlflow", "mlflow"),
    ],
)
def test_missing_extra_is_one_line_before_any_weights_load(tmp_path, keys, module, extra):
    """The model folder is empty: had the run loaded weights first, the error would be about them."""
    (tmp_path / "model").mkdir()
    config = tmp_path / "config.yaml"
    settings = {
        "base_model": str(tmp_path / "model"),
        "datasets": [{"path": str(tmp_path / "train.jsonl")}],
        "output_dir": str(tmp_path / "out"),
        **keys,
    }
    config.write_text(yaml.safe_dump(settings))
    script = (
        f"import sys; sys.modules[{module!r}] = None; sys.argv = ['qlora', 'train', {str(config)!r}]; "
        "from qlora_cli.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert done.returncode == 2, done.stderr
    key = next(iter(keys))
    assert done.stderr.strip() == (
        f"error: config key '{key}' needs the {extra} extra: pip install 'qlora-cli[{extra}]'"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("reference_ops")
def test_a_run_and_its_resume_log_to_the_same_tracker_runs(tmp_path, offline_wandb, mlflow_store):
    """Two steps, then `resume` to four: W&B and MLflow continue one run, TensorBoard one log, and
    each holds the losses of metrics.jsonl."""
    import json

    from checkpoints import write_run
    from mlflow.tracking import MlflowClient

    from qlora_cli.config.loading import load_config
    from qlora_cli.train.loop import resume, train

    trackers = dict(
        wandb_project="qlora-tests",
        wandb_mode="offline",
        use_tensorboard=True,
        mlflow_tracking_uri=mlflow_store,
        mlflow_experiment_name="tiny",
    )
    path = write_run(tmp_path / "run", max_steps=2, logging_steps=2, **trackers)
    out = train(load_config(path)).output_dir
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["trackers"]
    assert set(state) == {"wandb_run_id", "mlflow_run_id"}
    resume(out, overrides=["max_steps=4"])
    losses = [
        (r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]
    assert [step for step, _ in losses] == [2, 4]

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert [wandb_run(run)["id"] for run in runs] == [state["wandb_run_id"]] * 2
    rows = [row for run in runs for row in wandb_run(run)["history"]]
    assert [(row["train/global_step"], row["train/loss"]) for row in rows] == losses

    assert tensorboard_scalars(out / "runs")["train/loss"] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in losses
    ]

    client = MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_id == state["mlflow_run_id"] and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == losses


@pytest.mark.usefixtures("reference_ops")
def test_resume_from_an_earlier_checkpoint_logs_no_step_twice(tmp_path, offline_wandb, mlflow_store):
    """Four steps, then `resume --checkpoint checkpoint-2`: the steps 3 and 4 logged first belong to a
    continuation the resume replaces. metrics.jsonl and TensorBoard drop them; W&B and MLflow, which
    cannot, keep them in the first runs, and the resumed run logs to new ones that start with a copy
    of steps 1 and 2: each of its runs holds every step once, as metrics.jsonl does."""
    import json

    from checkpoints import write_run
    from mlflow.tracking import MlflowClient

    from qlora_cli.config.loading import load_config
    from qlora_cli.train.loop import resume, train

    trackers = dict(
        wandb_project="qlora-tests",
        wandb_mode="offline",
        use_tensorboard=True,
        mlflow_tracking_uri=mlflow_store,
        mlflow_experiment_name="tiny",
    )
    path = write_run(tmp_path / "run", max_steps=4, save_steps=2, logging_steps=1, **trackers)
    out = train(load_config(path)).output_dir
    first = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["trackers"]
    (first_wandb,) = (out / "wandb").glob("offline-run-*")
    screen = io.StringIO()
    resume(out, checkpoint=out / "checkpoint-2", console=Console(file=screen, width=400))
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["trackers"]
    assert state["mlflow_run_id"] != first["mlflow_run_id"] and state["wandb_run_id"] != first["wandb_run_id"]
    past = (
        "steps 3–4 past step 2, logged by the continuation this resume replaces: this run logs to a new run"
    )
    notes = [line for line in screen.getvalue().splitlines() if "past step 2" in line]
    assert notes == [
        f"note: MLflow run {first['mlflow_run_id']} holds {past}, which starts with a copy of the steps up to 2",
        f"note: W&B run {first['wandb_run_id']} holds {past}, which starts with a copy of the steps up to 2",
    ]
    losses = [
        (r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]
    assert [step for step, _ in losses] == [1, 2, 3, 4]

    (second_wandb,) = set((out / "wandb").glob("offline-run-*")) - {first_wandb}
    for run_dir, run_id in ((first_wandb, first["wandb_run_id"]), (second_wandb, state["wandb_run_id"])):
        run = wandb_run(run_dir)
        assert run["id"] == run_id
        assert [row["train/global_step"] for row in run["history"]] == [1, 2, 3, 4]
    resumed = [(row["train/global_step"], row["train/loss"]) for row in wandb_run(second_wandb)["history"]]
    assert resumed == losses

    assert tensorboard_scalars(out / "runs")["train/loss"] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in losses
    ]

    client = MlflowClient(tracking_uri=mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert {r.info.run_id for r in runs} == {first["mlflow_run_id"], state["mlflow_run_id"]}
    for run_id in (first["mlflow_run_id"], state["mlflow_run_id"]):
        assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4]
    assert [
        (m.step, m.value) for m in client.get_metric_history(state["mlflow_run_id"], "train/loss")
    ] == losses


def test_a_tracker_that_cannot_start_leaves_no_other_trackers_files(tmp_path, offline_wandb):
    """MLflow's store is unusable: no W&B run and no TensorBoard file is left behind."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out = tmp_path / "out"
    config = _config(
        wandb_project="p", wandb_mode="offline", use_tensorboard=True, mlflow_tracking_uri="bogus://x"
    )
    trackers = Trackers(config)
    with pytest.raises(QLoraError, match="^MLflow could not start a run at bogus://x: "):
        trackers.start(out, 0, None)
    assert trackers.trackers == []
    assert not out.exists() or list(out.iterdir()) == []


def test_a_tracker_that_cannot_start_takes_back_the_runs_of_those_before_it(
    tmp_path, offline_wandb, mlflow_store, monkeypatch
):
    """W&B fails last: the MLflow run just made is deleted, a continued one gets its status back, and
    TensorBoard's new event file goes (an earlier one stays)."""
    pytest.importorskip("tensorboard")
    import wandb
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    config = _config(
        wandb_project="p", wandb_mode="offline", use_tensorboard=True, mlflow_tracking_uri=mlflow_store
    )
    client = MlflowClient(tracking_uri=mlflow_store)
    with (
        pytest.raises(RunInterrupted),
        Trackers(_config(use_tensorboard=True, mlflow_tracking_uri=mlflow_store)).start(
            out, 0, None
        ) as trackers,
    ):
        trackers.log(RECORDS[0])
        saved = trackers.state()
        raise RunInterrupted("SIGINT received", 2)
    earlier_events = set((out / "runs").iterdir())

    def refuse(**options):
        raise wandb.errors.CommError("the W&B server refused the run")

    monkeypatch.setattr(wandb, "init", refuse)
    for start_step, state in ((0, None), (1, saved)):
        trackers = Trackers(config)
        with pytest.raises(QLoraError, match="^W&B could not start a run: the W&B server refused the run$"):
            trackers.start(out, start_step, state)
        assert trackers.trackers == []
        assert set((out / "runs").iterdir()) == earlier_events
        runs = client.search_runs([client.get_experiment_by_name("Default").experiment_id])
        assert [(r.info.run_id, r.info.status) for r in runs] == [(saved["mlflow_run_id"], "KILLED")]
    assert not (out / "wandb").exists()
