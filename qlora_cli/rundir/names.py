"""Every name qlora gives a file or folder in an output_dir, and the patterns that find them again.

Train, resume, export, generate and the trackers read and write these files; one home for their names
keeps a rename from leaving one reader behind. The adapter's names are PEFT's, so
`PeftModel.from_pretrained` loads a checkpoint or an exported adapter as it is.
"""

import re

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)

# Inside checkpoint-<step>: the adapter, the optimizer's tensors and hyperparameters, the config, the
# trainer state (step, run id, data position, metrics) and the manifest (size and SHA-256 of the others).
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_SETTINGS = "optimizer.json"
CONFIG_FILE = "config.yaml"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = (
    *ADAPTER_FILES,
    OPTIMIZER_TENSORS,
    OPTIMIZER_SETTINGS,
    CONFIG_FILE,
    STATE_FILE,
    MANIFEST_FILE,
)

CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
TEMP_PREFIX = ".tmp-checkpoint-"  # a checkpoint being written
DISCARD_PREFIX = ".old-checkpoint-"  # a checkpoint being deleted
SUPERSEDED_PREFIX = "superseded-checkpoint-"  # a resume from an earlier step set it aside

# At the top of output_dir: the owner's run id, the lock of the process training into it, what the run
# logs, and (beside them) the final adapter.
RUN_FILE = "qlora_run.json"
LOCK_FILE = ".qlora.lock"
WRITE_PROBE_PREFIX = ".qlora-write-test-"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
RUN_FILES = (*ADAPTER_FILES, METRICS_FILE, LOG_FILE, RUN_FILE)


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def names_a_checkpoint_folder(name: str) -> bool:
    """Whether a folder of this name in a run's output_dir is one of those the run removes, replaces or
    sets aside: a checkpoint, a superseded one, or one being written or deleted."""
    return bool(CHECKPOINT_NAME.match(name)) or name.startswith(
        (SUPERSEDED_PREFIX, TEMP_PREFIX, DISCARD_PREFIX)
    )
