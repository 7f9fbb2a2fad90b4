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
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.hub import resolve_model
from qlora_cli.sources.run_tokenizer import dataset_template, run_tokenizer
from qlora_cli.sources.tokenizer import ChatTokenizer

CONFIG_SUFFIXES = (".yaml", ".yml")
_PROBE = "\ue000qlora-answer\ue001"
# Llama 3 closes a chat turn with <|eot_id|>, a tool call's turn with <|eom_id|> and a text with
# <|end_of_text|>; a model may end its answer with any of them.
_ALSO_ENDS = {"<|eot_id|>": ("<|eom_id|>", "<|end_of_text|>")}


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


def chat_tokenizer(config: TrainConfig, folder: Path) -> ChatTokenizer:
    """The run's tokenizer with the chat template its (first) dataset rendered with."""
    tokenizer = run_tokenizer(folder, config)
    if not config.datasets:
        return choose_template(tokenizer, config.chat_template, config.chat_template_jinja)
    return dataset_template(tokenizer, config.datasets[0], config)


def end_of_turn(tokenizer: ChatTokenizer, variables: dict) -> str | None:
    """The special token that closes an assistant turn: the one a shipped template declares, else the
    first special token the chat template writes after an assistant's answer, if it writes one."""
    if tokenizer.end_of_turn is not None:
        return tokenizer.end_of_turn
    if tokenizer.chat_template is None:
        return None
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.render_chat(messages, **variables)
    except QLoraError:
        return None
    after = text[text.find(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
    found = [(after.find(t), t) for t in tokenizer.special_tokens if t in after]
    return min(found)[1] if found else None


def stop_ids(tokenizer: ChatTokenizer, variables: dict) -> set[int]:
    """eos, the end of a turn, and the other ends of a turn's family that the vocabulary holds."""
    turn_end = end_of_turn(tokenizer, variables)
    ends = [tokenizer.eos_token, *([turn_end, *_ALSO_ENDS.get(turn_end, ())] if turn_end else [])]
    return {id_ for id_ in map(tokenizer.token_to_id, ends) if id_ is not None}


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
