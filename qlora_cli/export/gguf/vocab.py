"""The tokenizer of a GGUF export: tokenizer.json's byte-level BPE as llama.cpp's 'gpt2' tokenizer model.

llama.cpp does not run tokenizer.json's pre-tokenizer; it splits text with a built-in regex chosen by
the file's `tokenizer.ggml.pre` name. Only a vocabulary that Qwen's own split feeds (the 'qwen2' name) is
exported, so llama.cpp cuts text into the same pieces as the tokenizer the model trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.tokenizer import ChatTokenizer

TOKENIZER_MODEL, PRE_TOKENIZER = "gpt2", "qwen2"
# The split Qwen2, Qwen2.5 and Qwen3 tokenizers run before byte-level BPE (tokenizer.json's Split regex).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# gguf's TokenType values, named here so that this module needs no gguf import.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_id: int
    pad_id: int
    bos_id: int | None
    chat_template: str | None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QLoraError(f"{path}: cannot read ({err})") from None


def _is_qwen_split(pre_tokenizer: dict | None) -> bool:
    """tokenizer.json's pre-tokenizer is Qwen's regex split followed by a byte-level step without a regex."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    if (pre_tokenizer or {}).get("type") != "Sequence" or len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") == QWEN2_SPLIT
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
    )


def check_tokenizer(folder: Path) -> dict:
    """tokenizer.json of `folder`, refused when llama.cpp's 'qwen2' tokenizer would split text otherwise."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise QLoraError(f"{folder} has no tokenizer.json; --gguf exports need the base's fast tokenizer")
    data = _read(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or not _is_qwen_split(data.get("pre_tokenizer")):
        raise QLoraError(
            f"{path}: --gguf exports only Qwen's byte-level BPE tokenizer (a BPE model after Qwen's regex "
            "split); llama.cpp's 'qwen2' pre-tokenizer would cut this one's text differently"
        )
    return data


def _merge_text(merge) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def read_vocabulary(
    folder: Path, chat: ChatTokenizer, vocab_size: int, bos_fallback: int | None
) -> Vocabulary:
    """Every id below the model's `vocab_size` with its token and llama.cpp token type (ids the tokenizer
    leaves unused become [PAD<id>], as the model's embedding has rows for them), the merges, the special
    ids and the chat template of the exported tokenizer in `folder`, which `chat` has loaded."""
    data = check_tokenizer(folder)
    by_id: dict[int, str] = {index: token for token, index in data["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, NORMAL)
    for added in data.get("added_tokens") or []:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    largest = max(by_id)
    if largest >= vocab_size:
        raise QLoraError(
            f"{folder}/tokenizer.json has token id {largest}, but the model's vocab_size is {vocab_size}; "
            "the GGUF needs an embedding row for every token"
        )
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    token_types = [types.get(index, UNUSED) for index in range(vocab_size)]
    bos = chat.bos_token_id
    if bos is None and bos_fallback is not None and 0 <= bos_fallback < vocab_size:
        bos = bos_fallback
    return Vocabulary(
        tokens=tokens,
        token_types=token_types,
        merges=[_merge_text(merge) for merge in data["model"].get("merges") or []],
        eos_id=chat.eos_token_id,
        pad_id=chat.pad_token_id,
        bos_id=bos,
        chat_template=chat.chat_template,
    )
