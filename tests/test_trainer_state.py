"""trainer_state.json: read back as written, old checkpoints read with the defaults that say what they
lack, and one rule for what a checkpoint folder is."""

import json

import pytest

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.command import find_checkpoint
from qlora_cli.rundir.checkpoint import list_checkpoints, remove_checkpoint
from qlora_cli.rundir.folder import earlier_run_files
from qlora_cli.rundir.trainer_state import (
    TrainerState,
    is_checkpoint,
    read_trainer_state,
    write_trainer_state,
)

# The keys every checkpoint since manifests holds, in the order they are written: readers of existing
# checkpoints (and users' scripts) know them by these names.
KEYS = [
    "step",
    "total_steps",
    "epoch",
    "batch_index",
    "world_size",
    "compute_dtype",
    "lr",
    "metrics",
    "trackers",
    "run_id",
    "data_files",
    "base_weights",
    "manifest_written",
]

FULL = TrainerState(
    step=7,
    total_steps=12,
    epoch=1,
    batch_index=4,
    world_size=2,
    compute_dtype="bfloat16",
    lr=2.5e-4,
    metrics=[{"step": 7, "loss": 1.5}],
    trackers={"wandb_run_id": "abc"},
    run_id="run",
    data_files=[{"path": "/data/train.jsonl", "size": 10, "sha256": "00"}],
    base_fingerprint={"method": "m", "files": {}, "config": {}, "tokenizer": {}},
    manifest_written=True,
)


def test_a_trainer_state_reads_back_as_it_was_written(tmp_path):
    write_trainer_state(tmp_path, FULL)
    assert list(json.loads((tmp_path / "trainer_state.json").read_text())) == KEYS
    assert read_trainer_state(tmp_path) == FULL


def test_a_state_written_before_the_later_keys_reads_with_their_defaults(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 3, "rng": [1, 2]}))
    assert read_trainer_state(tmp_path) == TrainerState(
        step=3,
        total_steps=None,
        epoch=0,
        batch_index=0,
        world_size=1,
        compute_dtype=None,
        lr=None,
        metrics=[],
        trackers={},
        run_id=None,
        data_files=None,
        base_fingerprint=None,
        manifest_written=False,
    )


@pytest.mark.parametrize("text", ['{"run_id": "x"}', '{"step": "3"}', "[3]"])
def test_a_state_without_an_integer_step_is_corrupt(tmp_path, text):
    (tmp_path / "trainer_state.json").write_text(text)
    with pytest.raises(QLoraError, match=r"trainer_state.json is corrupt: it has no step$"):
        read_trainer_state(tmp_path)


def test_a_checkpoint_is_a_folder_holding_a_trainer_state(tmp_path):
    """Named like one is not enough, for listing, export and removal alike; named otherwise, it is still
    one where a folder is given by its path."""
    named = tmp_path / "checkpoint-3"
    named.mkdir()
    (named / "notes.txt").write_text("mine")
    (tmp_path / "checkpoint-4").write_text("a file")
    assert not is_checkpoint(named) and not is_checkpoint(tmp_path / "checkpoint-4")
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(QLoraError, match="holds no complete checkpoint"):
        find_checkpoint(named)
    remove_checkpoint(named)
    assert (named / "notes.txt").is_file()
    assert named in earlier_run_files(tmp_path)  # a run still keeps clear of what is named like its own

    write_trainer_state(named, TrainerState(3))
    renamed = tmp_path / "kept"
    renamed.mkdir()
    write_trainer_state(renamed, TrainerState(5))
    assert is_checkpoint(named) and is_checkpoint(renamed)
    assert list_checkpoints(tmp_path) == [(3, named)]
    assert find_checkpoint(named) == named and find_checkpoint(renamed) == renamed
    remove_checkpoint(named)
    assert not is_checkpoint(named) and (named / "notes.txt").is_file()
