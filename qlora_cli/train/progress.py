"""What a person watching a run sees, train.log that keeps it, and the metrics.jsonl a program reads."""

from __future__ import annotations

import datetime
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, replace_file


class MetricsLog:
    """One JSON object per line; on resume, lines past the resumed step are dropped, and so is a line
    that a killed run left half-written. A refused write ends the run with WriteFailed."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = Path(path)
        kept = []
        if resume_step is not None and self.path.exists():
            kept = [record for record in logged_records(self.path) if record.get("step", 0) <= resume_step]
        with self._writing():
            replace_file(self.path, "".join(json.dumps(record) + "\n" for record in kept).encode())

    def write(self, record: dict) -> None:
        with self._writing(), self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    @contextmanager
    def _writing(self):
        try:
            yield
        except OSError as err:
            raise WriteFailed(f"could not write metrics: {describe(err, self.path)}") from None


def logged_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (none when there is none), skipping a half-written line."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def training_fields(record: dict) -> list[str]:
    """Loss, learning rate, speed and memory of a logged training step, as the bar and the lines show them."""
    fields = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if record.get("memory_gib") is not None:
        fields.append(f"{record['memory_gib']:.1f} GiB")
    return fields


def step_line(record: dict, total_steps: int, eta_seconds: float | None) -> str:
    """One plain line for a logged step: the bar's fields, for logs and files that are not terminals."""
    parts = [f"step {record['step']}/{total_steps}"]
    if "loss" in record:
        parts += training_fields(record)
    if "eval_loss" in record:
        parts += [f"eval_loss {record['eval_loss']:.4f}", f"eval_ppl {record['eval_ppl']:.2f}"]
    if eta_seconds is not None:
        parts.append(f"ETA {_duration(eta_seconds)}")
    return "  ".join(parts)


class RunOutput:
    """What the run prints goes to the console and, as plain timestamped text, to train.log.

    train.log is appended to, so a resumed run continues it; an error that ends the run is its last line.
    """

    def __init__(self, console: Console, log_path: Path | None):
        self.console = console
        self.log_path = log_path
        self.file = None
        self.file_console: Console | None = None

    def __enter__(self) -> RunOutput:
        if self.log_path is not None:
            self.file = Path(self.log_path).open("a", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
            self.file_console = OutputConsole(file=self.file, color_system=None, highlight=False)
        return self

    def __exit__(self, kind, error, tb) -> None:
        if isinstance(error, KeyboardInterrupt):
            self.to_file("interrupted")
        elif isinstance(error, QLoraError):
            self.to_file(f"error: {error}")
        elif error is not None:
            self.to_file(f"error: {kind.__name__}: {error}")
        if self.file is not None:
            self.file.close()
            self.file = self.file_console = None

    def print(self, text: str) -> None:
        """A message for the person watching, kept in train.log too (rich markup allowed); long lines
        are not broken, so that each stays one line in a log file."""
        self.console.print(text, soft_wrap=True)
        self.to_file(text)

    def to_file(self, text: str) -> None:
        if self.file_console is not None:
            stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            self.file_console.print(f"{stamp}  {text}", soft_wrap=True)
            self.file.flush()

    def progress(self, total_steps: int, start_step: int) -> StepProgress:
        return StepProgress(self, total_steps, start_step)


class StepProgress:
    """Logged steps as a live bar on a terminal, with a plain line per step in train.log; anywhere
    else (a pipe, a file, a job scheduler's log) the plain lines go to the console too, for the bar."""

    def __init__(self, output: RunOutput, total_steps: int, start_step: int):
        self.output = output
        self.total_steps = total_steps
        self.start_step = start_step
        self.started = time.perf_counter()
        console = output.console
        live = console.is_terminal or console.is_jupyter
        self.bar = TrainProgress(console, total_steps, start_step) if live else None

    def __enter__(self) -> StepProgress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, record: dict) -> None:
        """A logged step: training metrics, an evaluation, or both."""
        step = record["step"]
        done = step - self.start_step
        eta = (time.perf_counter() - self.started) / done * (self.total_steps - step) if done > 0 else None
        line = step_line(record, self.total_steps, eta)
        if self.bar is None:
            self.output.print(line)
        else:
            self.bar.update(step, record)
            self.output.to_file(line)

    def advance_to(self, step: int) -> None:
        if self.bar is not None:
            self.bar.advance_to(step)


class TrainProgress:
    """A rich progress bar with step, loss, lr, tokens/s, memory and ETA, for a terminal."""

    def __init__(self, console: Console, total_steps: int, start_step: int):
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")

    def __enter__(self) -> TrainProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, record: dict) -> None:
        if "loss" not in record:
            return
        parts = training_fields(record)
        if "eval_loss" in record:
            parts.append(f"eval {record['eval_loss']:.4f}")
        self.progress.update(self.task, completed=step, info="  ".join(parts))

    def advance_to(self, step: int) -> None:
        self.progress.update(self.task, completed=step)
