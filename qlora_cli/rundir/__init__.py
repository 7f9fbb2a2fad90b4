"""What an output_dir holds: its file names (names.py), checkpoints and the adapter in them, ownership,
the lock and free space. Imports qlora_cli.core, config, sources and model (the adapter's size)."""

from qlora_cli.rundir.checkpoint import (
    load_checkpoint,
    read_checkpoint_config,
    read_trainer_state,
    save_checkpoint,
)
from qlora_cli.rundir.folder import latest_checkpoint, owned_output_dir, usable_checkpoint

__all__ = [
    "latest_checkpoint",
    "load_checkpoint",
    "owned_output_dir",
    "read_checkpoint_config",
    "read_trainer_state",
    "save_checkpoint",
    "usable_checkpoint",
]
