"""The tokenizer of a GGUF export: tokenizer.json's byte-level BPE as llama.cpp's 'gpt2' tokenizer model.

llama.cpp does not run tokenizer.json's pre-tokenizer; it splits text with a built-in regex chosen by
the file's `tokenizer.ggml.pre` name. Only a vocabulary fed by a split llama.cpp has under a name (Qwen's,
Qwen3.5's, Llama 3's, Mistral's Tekken) is exported, under that name, so llama.cpp cuts text into the
same pieces as the tokenizer the model trained with. A SentencePiece vocabulary (Mistral 7B's) is
refused: llama.cpp's 'llama' tokenizer merges by the scores in tokenizer.model, which tokenizer.json
does not carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.hf_files import TOKENIZER_FILE
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import end_of_turn

TOKENIZER_MODEL = "gpt2"
# Each split a byte-level BPE tokenizer runs first (tokenizer.json's Split regex), by llama.cpp's name for
# it: Qwen2, Qwen2.5 and Qwen3; Qwen3.5 and 3.6 (combining marks join letters); Llama 3 and
# DeepSeek-R1-Distill-Llama (digits in threes); Mistral Nemo and Small 3 (Tekken).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    QWEN2_SPLIT: "qwen2",
    QWEN35_SPLIT: "qwen35",
    LLAMA3_SPLIT: "llama-bpe",
    TEKKEN_SPLIT: "tekken",
}
# gguf's TokenType values, named here so that this module needs no gguf import.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre_tokenizer: str
    eos_id: int
    pad_id: int
    bos_id: int | None
    add_bos: bool
    eot_id: int | None
    chat_template: str | None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QLoraError(f"{path}: cannot read ({err})") from None


def pre_tokenizer_name(pre_tokenizer: dict | None) -> str | None:
    """llama.cpp's name for tokenizer.json's pre-tokenizer when it is a known regex split followed by a
    byte-level step without a regex, else None."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or []
    if (pre_tokenizer or {}).get("type") != "Sequence" or len(steps) != 2:
        return None
    split, byte_level = steps
    if not (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
    ):
        return None
    return PRE_TOKENIZERS.get((split.get("pattern") or {}).get("Regex"))


def _is_sentencepiece(data: dict) -> bool:
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    return bool(model.get("byte_fallback")) or pre.get("type") == "Metaspace"


def check_tokenizer(folder: Path) -> dict:
    """tokenizer.json of `folder`, refused when llama.cpp would split or merge its text otherwise."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise QLoraError(f"{folder} has no tokenizer.json; --gguf exports need the base's fast tokenizer")
    data = _read(path)
    if _is_sentencepiece(data):
        raise QLoraError(
            f"{path}: --gguf cannot export a SentencePiece tokenizer (Mistral 7B's): llama.cpp merges its "
            "pieces by tokenizer.model's scores, which qlora cannot read, and a file without them would "
            "tokenize wrongly"
        )
    if (data.get("model") or {}).get("type") != "BPE" or pre_tokenizer_name(
        data.get("pre_tokenizer")
    ) is None:
        raise QLoraError(
            f"{path}: --gguf exports byte-level BPE tokenizers after a split llama.cpp knows (Qwen's, "
            "Qwen3.5's, Llama 3's, Tekken's); llama.cpp would cut this one's text differently"
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
    probe = Tokenizer.from_file(str(Path(folder) / TOKENIZER_FILE)).encode("a").ids
    return Vocabulary(
        tokens=tokens,
        token_types=token_types,
        merges=[_merge_text(merge) for merge in data["model"].get("merges") or []],
        pre_tokenizer=pre_tokenizer_name(data["pre_tokenizer"]),
        eos_id=chat.eos_token_id,
        pad_id=chat.pad_token_id,
        bos_id=bos,
        add_bos=bos is not None and probe[:1] == [bos],
        eot_id=_end_of_turn(chat),
        chat_template=chat.chat_template,
    )


def _end_of_turn(chat: ChatTokenizer) -> int | None:
    """The token that closes a turn when it is not EOS (Llama 3's <|eot_id|> beside <|end_of_text|>):
    llama.cpp otherwise guesses it by name, and may pick either."""
    for token in (end_of_turn(chat, {}), "<|eot_id|>", "<|im_end|>"):
        index = chat.token_to_id(token) if token else None
        if index is not None and index != chat.eos_token_id:
            return index
    return None
