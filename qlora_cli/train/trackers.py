"""Experiment trackers (Weights & Biases, TensorBoard, MLflow) behind the one interface the loop calls.

Each tool is an optional extra. A config that asks for one whose package is missing fails in one
line before any weights load. Only the main process opens runs and logs. A resumed run continues
the same tracker run where the tool allows it: the run ids travel in the checkpoint's trainer state.
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
    """A W&B run; metrics are charted against `train/global_step`, so a resumed run's repeated steps
    are kept instead of being dropped as out of order."""

    name = "W&B"

    def __init__(self, wandb: ModuleType, config: TrainConfig, output_dir: Path, saved: dict):
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

    def finish(self, status: str) -> None:
        if status == "finished" and self.log_model == "end" and self.last_saved is not None:
            self._upload(*self.last_saved)
        self.run.finish(exit_code=0 if status == "finished" else 1)


class TensorBoardTracker:
    """Event files in output_dir/runs. TensorBoard hides the events of earlier files from the first
    step this run logs on: a resumed run replaces what the interrupted one logged past its checkpoint."""

    name = "TensorBoard"

    def __init__(self, tensorboard: ModuleType, config: TrainConfig, output_dir: Path, start_step: int):
        self.log_dir = output_dir / "runs"
        try:
            self.writer = tensorboard.SummaryWriter(log_dir=str(self.log_dir), purge_step=start_step + 1)
        except OSError as err:
            raise QLoraError(f"TensorBoard cannot write to {self.log_dir}: {err.strerror}") from None
        if start_step == 0:
            text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
            self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def saved(self, folder: Path, step: int) -> None:
        pass

    def state(self) -> dict:
        return {}

    def finish(self, status: str) -> None:
        self.writer.close()


class MlflowTracker:
    """An MLflow run with the config as its parameters; resume reopens the run saved in the checkpoint."""

    name = "MLflow"
    STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}

    def __init__(self, config: TrainConfig, saved: dict, notes: list[str]):
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        self.Metric = Metric
        uri = config.mlflow_tracking_uri
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = saved.get("mlflow_run_id")
            if self.run_id is not None:
                try:
                    self.client.update_run(self.run_id, status="RUNNING")
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

    def start(self, output_dir: Path, start_step: int, saved: dict | None, warn=print) -> Trackers:
        """Open each run; `saved` is the tracker state of the checkpoint a resumed run starts from.

        `warn` shows a message to the person watching: a tracker that fails while the run trains
        is dropped with a warning, since a tracking server's outage must not end a training run.
        """
        self.warn = warn
        saved = saved or {}
        if "wandb" in self.modules:
            self.trackers.append(WandbTracker(self.modules["wandb"], self.config, output_dir, saved))
        if "tensorboard" in self.modules:
            self.trackers.append(
                TensorBoardTracker(self.modules["tensorboard"], self.config, output_dir, start_step)
            )
        if "mlflow" in self.modules:
            self.trackers.append(MlflowTracker(self.config, saved, self.notes))
        return self

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
