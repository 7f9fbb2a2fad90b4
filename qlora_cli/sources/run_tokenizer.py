"""The tokenizer a run renders and packs with: the base's, with the config's special tokens, and the chat
template each dataset chooses. Training, `qlora data` and generation take it from here alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qlora_cli.config.schema import DatasetConfig, TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import number
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.tokenizer import ChatTokenizer


def run_tokenizer(folder: Path, config: TrainConfig) -> ChatTokenizer:
    """The base's tokenizer with the config's special_tokens: what training renders and packs with."""
    tokenizer = ChatTokenizer.from_folder(folder)
    tokenizer.use_special_tokens(**dataclasses.asdict(config.special_tokens))
    return tokenizer


def dataset_template(tokenizer: ChatTokenizer, dataset: DatasetConfig, config: TrainConfig) -> ChatTokenizer:
    """The tokenizer rendering `dataset`: its own chat template where it sets one, else the config's."""
    if dataset.chat_template is not None or dataset.chat_template_jinja is not None:
        return choose_template(tokenizer, dataset.chat_template, dataset.chat_template_jinja)
    return choose_template(tokenizer, config.chat_template, config.chat_template_jinja)


def chat_tokenizer(config: TrainConfig, folder: Path) -> ChatTokenizer:
    """The run's tokenizer with the chat template its (first) dataset rendered with."""
    tokenizer = run_tokenizer(folder, config)
    if not config.datasets:
        return choose_template(tokenizer, config.chat_template, config.chat_template_jinja)
    return dataset_template(tokenizer, config.datasets[0], config)


def check_token_id(tokenizer: ChatTokenizer, vocab_size: int, token_id: int, what: str) -> None:
    """The model's embedding has a row for `token_id` (`what` says where it comes from): a tokenizer
    larger than config.json's vocab_size, another model's, writes ids the embedding lookup fails on."""
    if token_id < vocab_size:
        return
    raise QLoraError(
        f"{what} {number(token_id)}, past the model's vocab_size of {number(vocab_size)} (config.json), "
        f"while its tokenizer in {tokenizer.source} has {number(tokenizer.vocab_size)} tokens: the embedding "
        "has no row for that id; give the model the tokenizer it was trained with"
    )
