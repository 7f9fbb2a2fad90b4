"""What a person watching a run sees, and the metrics.jsonl a program reads afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsLog:
    """One JSON object per line; on resume, lines past the resumed step are dropped."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = Path(path)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


class TrainProgress:
    """A rich progress bar with step, loss, lr, tokens/s, memory and ETA."""

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
        parts = [
            f"loss {record['loss']:.4f}",
            f"lr {record['lr']:.2e}",
            f"{record['tokens_per_s']:,.0f} tok/s",
        ]
        if record.get("memory_gib") is not None:
            parts.append(f"{record['memory_gib']:.1f} GiB")
        if "eval_loss" in record:
            parts.append(f"eval {record['eval_loss']:.4f}")
        self.progress.update(self.task, completed=step, info="  ".join(parts))

    def advance_to(self, step: int) -> None:
        self.progress.update(self.task, completed=step)
