"""The base model a checkpoint is read with: the folder it trained on, where its config names it, or where
`--base-model` points after the folder moved or the run was copied to another machine.

Each checkpoint records a fingerprint of its local base (qlora_cli/sources/fingerprint.py): its weights,
what its config.json makes it compute, and its tokenizer files. Another folder stands for the base only
when its weights and config.json match it, and the recorded folder itself is checked the same way, so
changes in place are found too; another tokenizer or chat template is a note, since it changes only how
text becomes ids. A hub model is named by its repo id and the commit the checkpoint pinned, and found
again by them as before.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.rundir.trainer_state import read_trainer_state
from qlora_cli.sources.fingerprint import (
    base_fingerprint,
    config_difference,
    tokenizer_difference,
    weights_difference,
)

BASE_MODEL_OPTION = "--base-model"


def is_local_base(base_model: str) -> bool:
    """Saved configs name a local base by its absolute path and a hub model by its repo id."""
    return Path(base_model).is_absolute()


def check_base(checkpoint: Path, trained_on: str, base_model: str) -> list[str]:
    """base_model may be read as the local base folder `trained_on` of the checkpoint: it holds the weights
    and config.json the checkpoint recorded. Returns the notes to print: a base found elsewhere, other
    tokenizer files, or what could not be checked against a checkpoint written before the record."""
    folder = Path(base_model).expanduser()
    if not folder.is_dir():
        if base_model == trained_on:
            raise QLoraError(
                f"cannot find the base model of checkpoint {checkpoint}: model folder {trained_on} does not "
                f"exist; if it moved, give its new place with {BASE_MODEL_OPTION} PATH"
            )
        raise QLoraError(
            f"base model '{base_model}' is not a local model folder: checkpoint {checkpoint} trained on the "
            f"folder {trained_on}, and only a folder holding the same weights can take its place"
        )
    folder = folder.resolve()
    moved = folder != Path(trained_on).resolve()
    recorded = read_trainer_state(checkpoint).base_fingerprint
    if recorded is None:
        if not moved:
            return []
        return [
            f"checkpoint {checkpoint} records no fingerprint of its base (written before qlora kept one), "
            f"so {folder} is used unchecked in place of {trained_on}"
        ]
    current = base_fingerprint(folder)
    difference = weights_difference(recorded, current) or config_difference(recorded, current)
    if difference is not None and moved:
        raise QLoraError(
            f"{folder} is not the base model checkpoint {checkpoint} trained on ({trained_on}): {difference}"
        )
    if difference is not None:
        raise QLoraError(
            f"the base model {folder} changed since checkpoint {checkpoint} was written: {difference}"
        )
    notes = []
    if moved:
        notes.append(
            f"base model found at {folder}, with the weights checkpoint {checkpoint} trained on at {trained_on}"
        )
    if "config" not in recorded:
        if moved:
            notes.append(
                f"checkpoint {checkpoint} records no fingerprint of its base's config.json and tokenizer "
                f"(written before qlora kept one), so those of {folder} are used unchecked"
            )
    elif (changed := tokenizer_difference(recorded, current)) is not None:
        notes.append(
            f"the tokenizer files of {folder} are not those checkpoint {checkpoint} trained with ({changed}): "
            "text may become other token ids, or chats another prompt, than in training"
        )
    return notes


def checkpoint_base(
    checkpoint: Path, config: TrainConfig, base_model: str | None
) -> tuple[TrainConfig, list[str]]:
    """The checkpoint's config on its base, at `base_model` when given (export, generate), with the notes
    to print. A hub model cannot be replaced: its id and pinned commit find its weights anywhere."""
    if not is_local_base(config.base_model):
        if base_model is not None and base_model != config.base_model:
            raise QLoraError(
                f"{BASE_MODEL_OPTION}: checkpoint {checkpoint} trained on hub repo '{config.base_model}' "
                f"(revision {config.revision}), which is found again by its id; {BASE_MODEL_OPTION} takes "
                "the place of a local base folder only"
            )
        return config, []
    notes = check_base(checkpoint, config.base_model, base_model or config.base_model)
    if base_model is None:
        return config, notes
    return dataclasses.replace(config, base_model=str(Path(base_model).expanduser().resolve())), notes
