"""Experiment trackers (Weights & Biases, TensorBoard, MLflow) behind the one interface the loop calls.

Each tool is an optional extra. A config that asks for one whose package is missing fails in one
line before any weights load. Only the main process opens runs and logs. The tools start all or
nothing: one that cannot start takes back the runs and files of those started before it. A resumed
run continues the same tracker runs (their ids travel in the checkpoint's trainer state), unless
the interrupted run logged steps past the checkpoint: those belong to a continuation the resume
replaces, which TensorBoard hides and W&B and MLflow cannot take back, so each of those two gets a
new run that starts with a copy of the steps up to the checkpoint.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from types import ModuleType, TracebackType

import yaml

from qlora_cli.config.loading import config_to_dict
from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError, RunInterrupted
from qlora_cli.rundir.names import ADAPTER_FILES


def _require(module: str, extra: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise QLoraError(
            f"config key '{key}' needs the {extra} extra: pip install 'qlora-cli[{extra}]'"
        ) from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}–{steps[-1]}"


def tracker_metrics(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as tracker metrics: `eval_loss` becomes `eval/loss`, `lr` `train/lr`."""
    metrics = {}
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        name = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        if isinstance(value, list):
            metrics.update({f"{name}/rank{rank}": float(v) for rank, v in enumerate(value) if v is not None})
        else:
            metrics[name] = float(value)
    return metrics


def flat_params(config: TrainConfig) -> dict[str, str]:
    """The config as flat string parameters (`datasets.0.path`), for tools that take no nesting."""
    flat: dict[str, str] = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
            for index, item in enumerate(value):
                visit(f"{prefix}.{index}", item)
        else:
            flat[prefix] = str(value)

    visit("", config_to_dict(config))
    return flat


class WandbTracker:
    """A W&B run; metrics are charted against `train/global_step`, so that a run continued under a
    fixed wandb_run_id can log steps again (as two points) instead of having them dropped as out of order."""

    name = "W&B"

    def __init__(self, wandb: ModuleType, config: TrainConfig, output_dir: Path, saved: dict, copied: list):
        """`copied`: the records up to a resumed run's checkpoint, which a new W&B run starts with."""
        self.wandb = wandb
        self.log_model = "end" if config.wandb_log_model is True else config.wandb_log_model
        run_id = config.wandb_run_id or saved.get("wandb_run_id")
        options = dict(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.wandb_name,
            mode=config.wandb_mode,
            id=run_id,
            resume="allow" if run_id else None,
            config=config_to_dict(config),
            allow_val_change=True,
        )
        if "WANDB_DIR" not in os.environ:
            options["dir"] = str(output_dir)
        try:
            self.run = wandb.init(**options)
        except wandb.errors.Error as err:
            raise QLoraError(f"W&B could not start a run: {_one_line(err)}") from None
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)
        self.last_saved: tuple[Path, int] | None = None
        for record in copied if run_id is None else []:
            self.log(record["step"], tracker_metrics(record))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "train/global_step": step})

    def saved(self, folder: Path, step: int) -> None:
        self.last_saved = (folder, step)
        if self.log_model == "checkpoint":
            self._upload(folder, step)

    def _upload(self, folder: Path, step: int) -> None:
        artifact = self.wandb.Artifact(f"adapter-{self.run.id}", type="model", metadata={"step": step})
        for name in ADAPTER_FILES:
            artifact.add_file(str(folder / name), name=name)
        self.run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def state(self) -> dict:
        return {"wandb_run_id": self.run.id}

    def withdraw(self) -> None:
        """W&B starts last, so no tracker's failure ever has to take back its run."""

    def finish(self, status: str) -> None:
        if status == "finished" and self.log_model == "end" and self.last_saved is not None:
            self._upload(*self.last_saved)
        self.run.finish(exit_code=0 if status == "finished" else 1)


class TensorBoardTracker:
    """Event files in output_dir/runs. TensorBoard hides the events of earlier files from the first
    step this run logs on: a resumed run replaces what the interrupted one logged past its checkpoint."""

    name = "TensorBoard"

    def __init__(
        self, tensorboard: ModuleType, config: TrainConfig, output_dir: Path, start_step: int, copied: list
    ):
        """`copied`: the records up to a resumed run's checkpoint, written when no earlier events exist."""
        self.log_dir = output_dir / "runs"
        self.had = set(self.log_dir.iterdir()) if self.log_dir.is_dir() else None
        try:
            self.writer = tensorboard.SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step + 1)
        except OSError as err:
            raise QLoraError(f"TensorBoard cannot write to {self.log_dir}: {err.strerror}") from None
        if start_step == 0:
            text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
            self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))
        for record in copied if self.had is None else []:
            self.log(record["step"], tracker_metrics(record))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def saved(self, folder: Path, step: int) -> None:
        pass

    def state(self) -> dict:
        return {}

    def withdraw(self) -> None:
        """Close the writer and remove the event file it began (and `runs` if it made it)."""
        self.writer.close()
        for path in set(self.log_dir.iterdir()) - (self.had or set()):
            path.unlink()
        if self.had is None:
            self.log_dir.rmdir()

    def finish(self, status: str) -> None:
        self.writer.close()


class MlflowTracker:
    """An MLflow run with the config as its parameters; resume reopens the run saved in the checkpoint."""

    name = "MLflow"
    STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}

    def __init__(self, config: TrainConfig, saved: dict, notes: list[str], copied: list):
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self.Metric = Metric
        uri = config.mlflow_tracking_uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = saved.get("mlflow_run_id")
            self.continued: str | None = None  # the continued run's status before this start
            if self.run_id is not None:
                try:
                    status = self.client.get_run(self.run_id).info.status
                    self.client.update_run(self.run_id, status="RUNNING")
                    self.continued = status
                    return
                except MlflowException:
                    notes.append(f"MLflow run {self.run_id} is not in this tracking store: a new run starts")
            name = config.mlflow_experiment_name or "Default"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=config.mlflow_run_name).info.run_id
            params = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in flat_params(config).items()]
            for start in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[start : start + 100])
            now = int(time.time() * 1000)
            metrics = [
                Metric(name, value, now, record["step"])
                for record in copied
                for name, value in tracker_metrics(record).items()
            ]
            for start in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        except MlflowException as err:
            where = f" at {uri}" if uri else ""
            raise QLoraError(f"MLflow could not start a run{where}: {_one_line(err)}") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self.Metric(name, value, now, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def saved(self, folder: Path, step: int) -> None:
        pass

    def state(self) -> dict:
        return {"mlflow_run_id": self.run_id}

    def withdraw(self) -> None:
        """Delete the run this start created, or give a continued one back its status."""
        if self.continued is None:
            self.client.delete_run(self.run_id)
        else:
            self.client.update_run(self.run_id, status=self.continued)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS[status])


class Trackers:
    """Every tracker a config asks for, as one: start, log each record, note checkpoints, finish.

    Built from the config first thing, so a missing extra fails before any weights load; used as a
    context manager, which finishes each run as finished, interrupted or failed.
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self.notes: list[str] = []
        self.modules: dict[str, ModuleType] = {}
        self.trackers: list = []
        self.warn = print
        if config.wandb_project and config.wandb_mode != "disabled":
            self.modules["wandb"] = _require("wandb", "wandb", "wandb_project")
            if config.wandb_watch not in (None, False, "false"):
                self.notes.append(
                    "wandb_watch: parameter and gradient histograms are not logged; "
                    "the global grad_norm is logged at every logging step"
                )
        else:
            unused = [key for key in ("wandb_entity", "wandb_name", "wandb_run_id") if getattr(config, key)]
            if unused and config.wandb_mode != "disabled":
                self.notes.append(f"{', '.join(unused)} set without wandb_project: nothing is logged to W&B")
        if config.use_tensorboard:
            self.modules["tensorboard"] = _require(
                "torch.utils.tensorboard", "tensorboard", "use_tensorboard"
            )
        if config.mlflow_tracking_uri or config.mlflow_experiment_name:
            key = "mlflow_tracking_uri" if config.mlflow_tracking_uri else "mlflow_experiment_name"
            self.modules["mlflow"] = _require("mlflow", "mlflow", key)

    def start(
        self,
        output_dir: Path,
        start_step: int,
        saved: dict | None,
        warn=print,
        logged: list[dict] | None = None,
    ) -> Trackers:
        """Open each run; `saved` is the tracker state of the checkpoint a resumed run starts from, and
        `logged` the records metrics.jsonl holds (a resumed run's records past `start_step` are a
        superseded continuation).

        MLflow starts first and W&B last: a tracker that cannot start raises QLoraError after taking
        back what those before it made, and an online W&B run, which nothing can take back, is made only
        once the others stand. `warn` shows a message to the person watching: a tracker that fails while
        the run trains is dropped with a warning, since a tracking server's outage must not end a run.
        """
        self.warn = warn
        saved = dict(saved or {})
        logged = logged or []
        superseded = [record["step"] for record in logged if record.get("step", 0) > start_step]
        copied = [record for record in logged if record.get("step", 0) <= start_step]
        if superseded:
            self._start_new_runs(saved, superseded, start_step)
        openers = {
            "mlflow": lambda: MlflowTracker(self.config, saved, self.notes, copied),
            "tensorboard": lambda: TensorBoardTracker(
                self.modules["tensorboard"], self.config, output_dir, start_step, copied
            ),
            "wandb": lambda: WandbTracker(self.modules["wandb"], self.config, output_dir, saved, copied),
        }
        try:
            for module, open_tracker in openers.items():
                if module in self.modules:
                    self.trackers.append(open_tracker())
        except BaseException:
            for tracker in reversed(self.trackers):
                tracker.withdraw()
            self.trackers = []
            raise
        return self

    def _start_new_runs(self, saved: dict, superseded: list[int], start_step: int) -> None:
        """The checkpoint's W&B and MLflow runs hold `superseded` steps that this resume replaces."""
        past = f"{_steps(superseded)} past step {start_step}, logged by the continuation this resume replaces"
        copy = f"a new run, which starts with a copy of the steps up to {start_step}"
        if "mlflow" in self.modules and "mlflow_run_id" in saved:
            self.notes.append(
                f"MLflow run {saved.pop('mlflow_run_id')} holds {past}: this run logs to {copy}"
            )
        if "wandb" in self.modules and "wandb_run_id" in saved:
            if self.config.wandb_run_id:
                self.notes.append(
                    f"W&B run {self.config.wandb_run_id} (wandb_run_id) holds {past}: they show twice there"
                )
            else:
                self.notes.append(
                    f"W&B run {saved.pop('wandb_run_id')} holds {past}: this run logs to {copy}"
                )

    def log(self, record: dict) -> None:
        metrics = tracker_metrics(record)
        self._each("log", record["step"], metrics)

    def saved(self, folder: Path, step: int) -> None:
        self._each("saved", folder, step)

    def _each(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:  # the tool's own errors, whatever their class
                self.trackers.remove(tracker)
                self.warn(f"[yellow]warning:[/] {tracker.name} stopped logging: {_one_line(err)}")

    def state(self) -> dict:
        """What a checkpoint keeps so that resume continues the same tracker runs."""
        state: dict = {}
        for tracker in self.trackers:
            state.update(tracker.state())
        return state

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        status = (
            "finished"
            if error is None
            else "interrupted"
            if isinstance(error, (RunInterrupted, KeyboardInterrupt))
            else "failed"
        )
        self._each("finish", status)
        self.trackers = []
