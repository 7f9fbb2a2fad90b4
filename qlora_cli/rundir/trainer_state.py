"""A checkpoint's trainer state: where the run is (step, data position), whose it is, and what it trained
on, as trainer_state.json holds it.

This module alone knows the file's keys. A key added later is missing from the checkpoints written
before it, which read with the default that says so (no run id, one process, no fingerprint of the base,
no manifest); keys no longer written (the "rng" of older checkpoints) are not read. A folder is a
checkpoint when it holds this file: a save writes it inside the atomic rename, and a removal deletes it
first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.files import write_json
from qlora_cli.rundir.names import STATE_FILE


@dataclass(frozen=True)
class TrainerState:
    """None where a checkpoint written before the key existed has nothing to say."""

    step: int
    total_steps: int | None = None
    epoch: int = 0
    batch_index: int = 0  # the micro-batch of the epoch the next step starts at
    world_size: int = 1
    compute_dtype: str | None = None  # "bfloat16", as torch names it without "torch."
    lr: float | None = None
    metrics: list[dict] = field(default_factory=list)  # the last logged records
    trackers: dict = field(default_factory=dict)  # the tracker runs' ids, to continue them
    run_id: str | None = None
    data_files: list[dict] | None = None  # the local data files read, by size and SHA-256
    base_fingerprint: dict | None = None  # a local base's (qlora_cli/sources/fingerprint.py)
    manifest_written: bool = False

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "world_size": self.world_size,
            "compute_dtype": self.compute_dtype,
            "lr": self.lr,
            "metrics": self.metrics,
            "trackers": self.trackers,
            "run_id": self.run_id,
            "data_files": self.data_files,
            # Named when the fingerprint held the weights' alone.
            "base_weights": self.base_fingerprint,
            "manifest_written": self.manifest_written,
        }

    @classmethod
    def from_json(cls, data) -> TrainerState:
        """Raises ValueError for anything without an integer step: nothing places the run without it."""
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise ValueError("it has no step")
        return cls(
            step=data["step"],
            total_steps=data.get("total_steps"),
            epoch=data.get("epoch", 0),
            batch_index=data.get("batch_index", 0),
            world_size=data.get("world_size", 1),
            compute_dtype=data.get("compute_dtype"),
            lr=data.get("lr"),
            metrics=data.get("metrics", []),
            trackers=data.get("trackers", {}),
            run_id=data.get("run_id"),
            data_files=data.get("data_files"),
            base_fingerprint=data.get("base_weights"),
            manifest_written=data.get("manifest_written", False),
        )


def is_checkpoint(folder: Path) -> bool:
    return (Path(folder) / STATE_FILE).is_file()


def write_trainer_state(folder: Path, state: TrainerState) -> None:
    write_json(Path(folder) / STATE_FILE, state.to_json())


def read_trainer_state(folder: Path) -> TrainerState:
    path = Path(folder) / STATE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QLoraError(f"checkpoint {folder} has no {STATE_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise QLoraError(f"{path} is corrupt: {err}") from None
    try:
        return TrainerState.from_json(data)
    except ValueError as err:
        raise QLoraError(f"{path} is corrupt: {err}") from None
