"""Checkpoint folders: written whole or not at all, found again on resume.

A checkpoint is built in a hidden temporary folder, every file fsynced, then renamed into
`checkpoint-<step>`; a crash at any moment leaves either the previous checkpoints alone or the new
one complete. Only safetensors, JSON and YAML are written and read back: never pickles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qlora_cli.adapter import adapter_config, adapter_state_dict, load_adapter_state
from qlora_cli.config import TrainConfig, config_from_dict, read_yaml, save_config
from qlora_cli.errors import QLoraError

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
TEMP_PREFIX = ".tmp-checkpoint-"
STATE_FILE = "trainer_state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


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


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. Temporary folders are never listed."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for entry in output_dir.iterdir():
        match = CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def remove_partial(output_dir: Path) -> None:
    """Leftovers of a save that was killed midway."""
    for entry in Path(output_dir).glob(TEMP_PREFIX + "*"):
        shutil.rmtree(entry, ignore_errors=True)


def write_adapter(folder: Path, model, config: TrainConfig) -> None:
    save_file(adapter_state_dict(model), str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config(model, config), indent=2) + "\n")


def save_checkpoint(
    output_dir: Path,
    step: int,
    model,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    config: TrainConfig,
) -> Path:
    """Write checkpoint-<step> atomically and prune old ones down to save_total_limit."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    temp = output_dir / f"{TEMP_PREFIX}{step}-{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_partial(output_dir)
        temp.mkdir()
        write_adapter(temp, model, config)
        tensors, meta = optimizer_tensors(optimizer)
        save_file(tensors, str(temp / "optimizer.safetensors"))
        (temp / "optimizer.json").write_text(json.dumps(meta, indent=2) + "\n")
        save_config(config, temp / "config.yaml")
        (temp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        _fsync_tree(temp)
        if final.exists():
            shutil.rmtree(final)
        temp.rename(final)
        _fsync_dir(output_dir)
    except OSError as err:
        shutil.rmtree(temp, ignore_errors=True)
        raise QLoraError(f"could not write checkpoint {final}: {err.strerror or err}") from None
    if config.save_total_limit:
        for _, old in list_checkpoints(output_dir)[: -config.save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint_config(folder: Path) -> TrainConfig:
    try:
        return config_from_dict(read_yaml(Path(folder) / "config.yaml"))
    except QLoraError as err:
        raise QLoraError(f"checkpoint {folder}: {err}") from None


def read_trainer_state(folder: Path) -> dict:
    path = Path(folder) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QLoraError(f"checkpoint {folder} has no {STATE_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QLoraError(f"{path} is corrupt: {err}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise QLoraError(f"{path} is corrupt: it has no step")
    return state


def load_checkpoint(folder: Path, model, optimizer: torch.optim.Optimizer) -> dict:
    """Restore adapter weights and optimizer state in place; returns the trainer state."""
    folder = Path(folder)
    state = read_trainer_state(folder)
    try:
        adapter = load_file(str(folder / "adapter_model.safetensors"))
        tensors = load_file(str(folder / "optimizer.safetensors"))
        meta = json.loads((folder / "optimizer.json").read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise QLoraError(f"checkpoint {folder} is incomplete: {Path(err.filename).name} is missing") from None
    except (SafetensorError, OSError, json.JSONDecodeError) as err:
        raise QLoraError(f"checkpoint {folder} is corrupt: {err}") from None
    load_adapter_state(model, adapter, str(folder))
    try:
        restore_optimizer(optimizer, tensors, meta)
    except (ValueError, KeyError, RuntimeError) as err:
        raise QLoraError(f"checkpoint {folder}: optimizer state does not fit this model: {err}") from None
    return state
