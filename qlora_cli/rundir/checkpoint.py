"""Checkpoint folders: written whole or not at all, found again on resume, pruned one run at a time.

A checkpoint is built in a hidden temporary folder, every file fsynced, then renamed into
`checkpoint-<step>`; a folder that goes away (pruned, or replaced by a newer save of the same step) is
first renamed to a hidden name and only then deleted. A crash at any moment therefore leaves every
`checkpoint-<step>` folder complete. Each checkpoint records the run it belongs to, so pruning, resume
and export never take another run's, and a manifest of its files' hashes (manifest.py), which every read
of its contents checks first. Only safetensors, JSON and YAML are written and read back: never pickles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from qlora_cli.config.loading import config_from_dict, read_yaml, save_config
from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, fsync_dir, fsync_tree, save_tensors, write_json
from qlora_cli.rundir.adapter import adapter_config, adapter_state_dict, load_adapter_state
from qlora_cli.rundir.manifest import has_manifest, manifest_problem, write_manifest
from qlora_cli.rundir.names import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINT_FILES,
    CHECKPOINT_NAME,
    CONFIG_FILE,
    DISCARD_PREFIX,
    MANIFEST_FILE,
    OPTIMIZER_SETTINGS,
    OPTIMIZER_TENSORS,
    STATE_FILE,
    TEMP_PREFIX,
    checkpoint_name,
)
from qlora_cli.rundir.trainer_state import (
    TrainerState,
    is_checkpoint,
    read_trainer_state,
    write_trainer_state,
)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer's state as flat tensors (safetensors) plus its hyperparameters (JSON)."""
    state = optimizer.state_dict()
    tensors = {}
    for index, slots in state["state"].items():
        for slot, value in slots.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{index}.{slot}"] = value.detach().to("cpu").contiguous()
    return tensors, {"param_groups": state["param_groups"]}


def restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, slot = key.split(".", 1)
        state.setdefault(int(index), {})[slot] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _named_checkpoints(output_dir: Path, keep: Callable[[Path], bool]) -> list[tuple[int, Path]]:
    """(step, folder) of the folders named like checkpoints that `keep` takes, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for entry in output_dir.iterdir():
        match = CHECKPOINT_NAME.match(entry.name)
        if match and keep(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder of every run, oldest first. Temporary folders are never listed."""
    return _named_checkpoints(output_dir, is_checkpoint)


def checkpoints_and_stateless(output_dir: Path) -> list[tuple[int, Path]]:
    """Every checkpoint folder, and those named like one that hold the files only a checkpoint writes
    (the optimizer's, the manifest) but no trainer state, oldest first. The latter are damaged (a file
    deleted, a copy cut short), since a save writes the state before the folder takes its name. An
    export named like a checkpoint holds none of them; a removal killed midway leaves one, but removes
    old checkpoints, never the newest."""

    def checkpoint_or_stateless(folder: Path) -> bool:
        only_checkpoints_write = (OPTIMIZER_TENSORS, OPTIMIZER_SETTINGS, MANIFEST_FILE)
        held = any((folder / name).exists() for name in only_checkpoints_write)
        return is_checkpoint(folder) or (folder.is_dir() and held)

    return _named_checkpoints(output_dir, checkpoint_or_stateless)


def checkpoint_run(folder: Path) -> str | None:
    """The run id a checkpoint records (None for checkpoints written before runs had ids).

    An unreadable trainer_state.json raises QLoraError."""
    return read_trainer_state(folder).run_id


def readable_checkpoints(output_dir: Path) -> Iterator[tuple[int, Path, str | None]]:
    """(step, folder, run id) of every checkpoint whose trainer state reads, oldest first; an unreadable
    one is skipped, since nothing can say which run it belongs to."""
    for step, folder in list_checkpoints(output_dir):
        try:
            run_id = checkpoint_run(folder)
        except QLoraError:
            continue
        yield step, folder, run_id


def run_checkpoints(output_dir: Path, run_id: str | None) -> list[tuple[int, Path]]:
    """The readable checkpoints of one run, oldest first."""
    return [(step, folder) for step, folder, owner in readable_checkpoints(output_dir) if owner == run_id]


def remove_partial(output_dir: Path) -> None:
    """Leftovers of a save or a removal that was killed midway."""
    for prefix in (TEMP_PREFIX, DISCARD_PREFIX):
        for entry in Path(output_dir).glob(prefix + "*"):
            shutil.rmtree(entry, ignore_errors=True)


def discard(folder: Path) -> None:
    """Remove a checkpoint folder so that no crash can leave part of it under its listed name."""
    hidden = folder.with_name(f"{DISCARD_PREFIX}{folder.name}-{os.getpid()}")
    folder.rename(hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def foreign_files(folder: Path) -> list[str]:
    """What a checkpoint folder holds that no checkpoint writes (an export put inside it, a user's notes)."""
    return sorted(entry.name for entry in Path(folder).iterdir() if entry.name not in CHECKPOINT_FILES)


def remove_checkpoint(folder: Path) -> None:
    """Remove a checkpoint folder, never what qlora did not write there. One that also holds other files
    keeps them and loses only the checkpoint's own, its trainer state first, so that it is no checkpoint
    from then on; without trainer state it is no checkpoint at all (an export named like one), and stays."""
    folder = Path(folder)
    if not foreign_files(folder):
        discard(folder)
    elif is_checkpoint(folder):
        for name in (STATE_FILE, *CHECKPOINT_FILES):
            (folder / name).unlink(missing_ok=True)


def write_adapter(folder: Path, model, config: TrainConfig) -> None:
    save_tensors(adapter_state_dict(model), folder / ADAPTER_WEIGHTS)
    write_json(folder / ADAPTER_CONFIG, adapter_config(model, config))


def save_checkpoint(
    output_dir: Path,
    step: int,
    model,
    optimizer: torch.optim.Optimizer,
    trainer_state: TrainerState,
    config: TrainConfig,
) -> Path:
    """Write checkpoint-<step> atomically, then prune this run's old ones down to save_total_limit.

    A failed write (a full disk, a folder that went read-only) raises WriteFailed naming the file and
    the reason; the temporary folder is removed and earlier checkpoints are untouched.
    """
    output_dir = Path(output_dir)
    final = output_dir / checkpoint_name(step)
    temp = output_dir / f"{TEMP_PREFIX}{step}-{os.getpid()}"
    previous = run_checkpoints(output_dir, trainer_state.run_id)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_partial(output_dir)
        temp.mkdir()
        write_adapter(temp, model, config)
        tensors, meta = optimizer_tensors(optimizer)
        save_tensors(tensors, temp / OPTIMIZER_TENSORS)
        write_json(temp / OPTIMIZER_SETTINGS, meta)
        save_config(config, temp / CONFIG_FILE)
        write_trainer_state(temp, dataclasses.replace(trainer_state, manifest_written=True))
        write_manifest(temp)
        fsync_tree(temp)
        if final.exists():
            remove_checkpoint(final)
        temp.rename(final)
        fsync_dir(output_dir)
    except OSError as err:
        kept = [folder for s, folder in previous if s != step]
        intact = f"; the last complete checkpoint is still {kept[-1]}" if kept else ""
        raise WriteFailed(f"could not write checkpoint {final}: {describe(err, temp)}{intact}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    if config.save_total_limit:
        for _, old in run_checkpoints(output_dir, trainer_state.run_id)[: -config.save_total_limit]:
            remove_checkpoint(old)
    return final


def _manifest_problem(folder: Path) -> str | None:
    """What a checkpoint's manifest finds changed, or that a checkpoint written with a manifest has lost
    it; None when neither (a checkpoint written before manifests has none to check)."""
    if has_manifest(folder):
        return manifest_problem(folder)
    try:
        written = read_trainer_state(folder).manifest_written
    except QLoraError as err:
        return str(err)
    if written:
        return (
            f"checkpoint {folder} is damaged: its {MANIFEST_FILE} is missing, and its {STATE_FILE} says "
            "it was written with one, so nothing can tell its files are intact"
        )
    return None


def verify(folder: Path) -> None:
    """A checkpoint's files are as it wrote them; a damaged one is refused, naming the newest intact
    checkpoint of its run. Checkpoints written before manifests pass, to be checked by parsing as they
    are read."""
    folder = Path(folder)
    if (problem := _manifest_problem(folder)) is None:
        return
    try:
        others = run_checkpoints(folder.parent, checkpoint_run(folder))
    except QLoraError:
        others = list_checkpoints(folder.parent)
    for _, other in reversed(others):
        if other != folder and checkpoint_problem(other) is None:
            raise QLoraError(f"{problem}; the newest intact checkpoint of this run is {other}")
    raise QLoraError(f"{problem}; no intact checkpoint of this run is left in {folder.parent}")


def read_checkpoint_config(folder: Path) -> TrainConfig:
    verify(folder)
    try:
        return config_from_dict(read_yaml(Path(folder) / CONFIG_FILE))
    except QLoraError as err:
        raise QLoraError(f"checkpoint {folder}: {err}") from None


def read_checkpoint_adapter(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors a checkpoint saved, as they are on disk (load_adapter_state fits them to a model)."""
    verify(folder)
    path = Path(folder) / ADAPTER_WEIGHTS
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise QLoraError(f"checkpoint {folder} is incomplete: {ADAPTER_WEIGHTS} is missing") from None
    except (SafetensorError, OSError) as err:
        raise QLoraError(f"{path} is corrupt: {err}") from None


def _read_files(folder: Path) -> tuple[TrainerState, dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    verify(folder)
    state = read_trainer_state(folder)
    adapter = read_checkpoint_adapter(folder)
    try:
        tensors = load_file(str(folder / OPTIMIZER_TENSORS))
        meta = json.loads((folder / OPTIMIZER_SETTINGS).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise QLoraError(f"checkpoint {folder} is incomplete: {Path(err.filename).name} is missing") from None
    except (SafetensorError, OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QLoraError(f"checkpoint {folder} is corrupt: {err}") from None
    return state, adapter, tensors, meta


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a file that is missing, unreadable or not as its manifest
    recorded it), or None when it can."""
    folder = Path(folder)
    if (problem := _manifest_problem(folder)) is not None or has_manifest(folder):
        return problem
    try:
        _read_files(folder)
        read_checkpoint_config(folder)
        json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except QLoraError as err:
        return str(err)
    except FileNotFoundError:
        return f"checkpoint {folder} is incomplete: {ADAPTER_CONFIG} is missing"
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"checkpoint {folder} is corrupt: {ADAPTER_CONFIG}: {err}"
    return None


def load_checkpoint(folder: Path, model, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore adapter weights and optimizer state in place; returns the trainer state."""
    folder = Path(folder)
    state, adapter, tensors, meta = _read_files(folder)
    load_adapter_state(model, adapter, str(folder))
    try:
        restore_optimizer(optimizer, tensors, meta)
    except (ValueError, KeyError, RuntimeError) as err:
        raise QLoraError(f"checkpoint {folder}: optimizer state does not fit this model: {err}") from None
    return state
