"""The tokenizer files an export carries: the base model's, rendering chats as training did.

A config's `chat_template` and `special_tokens` change how examples were tokenized. An export that
kept the base's tokenizer unchanged would have transformers, vLLM or a chat UI prompt the model with
turns it was not trained on (or pad with another token), so the exported tokenizer_config.json (and
chat_template.jinja, which transformers prefers when present) carry the template and tokens of the
run, as Axolotl's saved tokenizer does.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.files import write_json
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.hf_files import (
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
)
from qlora_cli.sources.run_tokenizer import chat_tokenizer
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import stop_ids


def write_tokenizer(config: TrainConfig, base_folder: Path, folder: Path) -> None:
    """Copy the base's tokenizer files into `folder`, with the run's chat template and special tokens.
    ChatTokenizer.from_folder has read the base's settings when the run started, so they parse."""
    for name in TOKENIZER_FILES:
        if (base_folder / name).is_file():
            shutil.copyfile(base_folder / name, folder / name)
    tokens = {role: token for role, token in dataclasses.asdict(config.special_tokens).items() if token}
    if (
        config.chat_template in (None, "tokenizer_default")
        and config.chat_template_jinja is None
        and not tokens
    ):
        return
    base = ChatTokenizer.from_folder(base_folder)
    template = choose_template(base, config.chat_template, config.chat_template_jinja).chat_template
    config_file = folder / TOKENIZER_CONFIG
    settings = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    settings.update(tokens)
    if template is not None and template != base.chat_template:
        settings["chat_template"] = template
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            (folder / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    write_json(config_file, settings)


def write_generation_config(config: TrainConfig, base_folder: Path, folder: Path) -> None:
    """The base's generation_config.json (written in `folder` already, or none), its eos_token_id
    holding every token the run's answers end with, where `qlora generate` stops: a base trained on
    a chat template whose turns end in another token (Llama 3's <|eot_id|> beside <|end_of_text|>)
    would otherwise run on past the turn in transformers or vLLM."""
    path = folder / GENERATION_CONFIG
    settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    given = settings.get("eos_token_id")
    given = [] if given is None else [given] if isinstance(given, int) else list(given)
    stops = stop_ids(chat_tokenizer(config, base_folder), dict(config.chat_template_kwargs))
    ends = [*given, *sorted(stops - set(given))]
    if ends == given:
        return
    settings["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    write_json(path, settings)
