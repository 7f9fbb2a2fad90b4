"""What `qlora generate` and `qlora chat` run: SOURCE (a run's output_dir, a checkpoint-<step> folder or a
config file) resolved into the NF4 base model with the checkpoint's adapter, the tokenizer rendering chats
as training did, and the stop tokens of a turn."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from qlora_cli.config.loading import load_config
from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import compute_dtype, lora_config, select_device
from qlora_cli.rundir.adapter import load_adapter_state
from qlora_cli.rundir.base_model import checkpoint_base
from qlora_cli.rundir.checkpoint import read_checkpoint_adapter, read_checkpoint_config
from qlora_cli.rundir.folder import usable_checkpoint
from qlora_cli.rundir.names import ADAPTER_WEIGHTS
from qlora_cli.rundir.trainer_state import is_checkpoint
from qlora_cli.sources.hub import resolve_model
from qlora_cli.sources.run_tokenizer import chat_tokenizer
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import stop_ids

CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass
class GenerationSource:
    """A model ready to generate, with what it was trained on."""

    model: QLoRAModel
    tokenizer: ChatTokenizer
    config: TrainConfig
    checkpoint: Path | None
    template_variables: dict
    stop_ids: set[int]
    load_s: float
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def sequence_len(self) -> int:
        return min(self.config.sequence_len, self.model.spec.max_position_embeddings)

    def describe(self) -> str:
        adapter = f"adapter of {self.checkpoint}" if self.checkpoint else "no adapter (--base-only)"
        return f"{self.config.base_model} + {adapter}"


def find_source(
    source: Path, *, base_only: bool, base_model: str | None = None
) -> tuple[TrainConfig, Path | None, list[str]]:
    """The config and checkpoint SOURCE names, and the notes to print; the checkpoint is None only with
    base_only. `base_model`: where the checkpoint's local base is now, when it moved (without a
    checkpoint, the base to run)."""
    source = Path(source)
    usage = "give a run's output_dir, a checkpoint-<step> folder or a config file"
    if not source.exists():
        raise QLoraError(f"{source} does not exist; {usage}")
    if source.is_file():
        if source.suffix not in CONFIG_SUFFIXES:
            raise QLoraError(f"{source} is not a config file (.yaml); {usage}")
        config = load_config(source)
        output_dir = Path(config.output_dir)
        checkpoint = _checkpoint_of(output_dir) if output_dir.is_dir() else None
        if checkpoint is None and not base_only:
            raise QLoraError(
                f"{source}: its output_dir {output_dir} holds no checkpoint yet; train first "
                f"(qlora train {source}) or add --base-only to run the base model alone"
            )
        if checkpoint is None and base_model is not None:
            return dataclasses.replace(config, base_model=base_model), None, []
        if checkpoint is None:
            return config, None, []
        config = read_checkpoint_config(checkpoint)
    else:
        checkpoint = source if is_checkpoint(source) else _checkpoint_of(source)
        if checkpoint is None:
            raise QLoraError(f"{source} holds no complete checkpoint and is not a checkpoint folder; {usage}")
        config = read_checkpoint_config(checkpoint)
    config, notes = checkpoint_base(checkpoint, config, base_model)
    return config, None if base_only else checkpoint, notes


def _checkpoint_of(output_dir: Path) -> Path | None:
    return usable_checkpoint(output_dir, lambda found: f"generate with it: `qlora generate {found} …`")


def load_source(
    source: Path, *, base_only: bool = False, device: str = "auto", base_model: str | None = None
) -> GenerationSource:
    """Load SOURCE's base model (NF4 when the run quantized it; at `base_model` when it moved) on
    `device`, with its adapter."""
    started = time.perf_counter()
    torch_device = select_device(device, "--device")
    config, checkpoint, notes = find_source(source, base_only=base_only, base_model=base_model)
    adapter = read_checkpoint_adapter(checkpoint) if checkpoint is not None else None
    try:
        folder = resolve_model(config.base_model, config.revision)
    except QLoraError as err:
        raise QLoraError(f"cannot find the base model of {source}: {err}") from None
    tokenizer = chat_tokenizer(config, folder)
    model = QLoRAModel.from_pretrained(
        folder,
        quantize=config.quantize,
        lora=lora_config(config) if adapter is not None else None,
        device=torch_device,
        dtype=compute_dtype(config, torch_device),
    )
    if adapter is not None:
        load_adapter_state(model, adapter, str(checkpoint / ADAPTER_WEIGHTS))
    model.eval().requires_grad_(False)
    variables = dict(config.chat_template_kwargs)
    return GenerationSource(
        model,
        tokenizer,
        config,
        checkpoint,
        variables,
        stop_ids(tokenizer, variables),
        time.perf_counter() - started,
        notes,
    )
