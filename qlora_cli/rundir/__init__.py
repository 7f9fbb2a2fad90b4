"""What an output_dir holds: file names (names.py), checkpoints, their trainer state and adapter, ownership,
the lock and free space. Imports qlora_cli.core, config, sources and model (the adapter's size)."""

from qlora_cli.rundir.checkpoint import (
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from qlora_cli.rundir.folder import latest_checkpoint, owned_output_dir, usable_checkpoint
from qlora_cli.rundir.trainer_state import TrainerState, is_checkpoint, read_trainer_state

__all__ = [
    "TrainerState",
    "is_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "owned_output_dir",
    "read_checkpoint_config",
    "read_trainer_state",
    "save_checkpoint",
    "usable_checkpoint",
]
