"""Datasets to token ids with shifted labels, and the micro-batches a training epoch walks through.

Reading: `load_examples` turns one dataset entry of the config into `Example`s. Labels are stored already
shifted (labels[t] is the token position t must predict, or -100), so the loss never shifts and packed
documents never predict across a boundary.

Batching: `BatchPlan` decides which examples form each micro-batch. The order is a pure function of
(seed, epoch), and `batch(epoch, index)` is random access, so a resumed run continues at the exact
micro-batch it stopped at.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from qlora_cli.errors import QLoraError
from qlora_cli.tokenizer import ChatTokenizer

IGNORE_INDEX = -100
DATASET_TYPES = ("alpaca", "chat_template", "completion", "text")
DATA_SUFFIXES = (".jsonl", ".json")

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


class DatasetSpec(Protocol):
    """The fields of config.DatasetConfig this module reads."""

    path: str
    type: str
    split: str
    field_messages: str
    message_field_role: str
    message_field_content: str
    roles_to_train: list[str]
    field_instruction: str
    field_input: str
    field_output: str
    field_prompt: str
    field_completion: str
    field_text: str
    train_on_eos: bool


@dataclass
class Example:
    """One tokenized document; labels[t] is the token to predict at position t, or -100."""

    input_ids: list[int]
    labels: list[int]


class ExampleList(list):
    """The examples of a dataset (a plain list of Example) plus what loading did to them.

    rows: rows read from the files; truncated: examples cut to sequence_len; dropped: rows left with no
    trained token (after truncation), which are not in the list.
    """

    def __init__(
        self, examples: Iterable[Example] = (), *, rows: int = 0, truncated: int = 0, dropped: int = 0
    ):
        super().__init__(examples)
        self.rows = rows
        self.truncated = truncated
        self.dropped = dropped


# ----- reading rows -----


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _dataset_files(path: Path, split: str) -> list[Path]:
    """A file is itself; a folder gives its .jsonl/.json files in sorted order, only the split's if it names any."""
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise QLoraError(
                f"{path}: unsupported dataset file type {path.suffix!r} (expected .jsonl or .json)"
            )
        return [path]
    if not path.is_dir():
        raise QLoraError(f"{path}: dataset path does not exist")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in DATA_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise QLoraError(f"{path}: folder has no .jsonl or .json files")
    # Hub dataset repos name splits in file or folder names: train.jsonl, data/train-00000-of-00002.jsonl.
    in_split = [p for p in files if split in re.split(r"[/\\._-]", str(p.relative_to(path).with_suffix("")))]
    return in_split or files


def _read_rows(file: Path) -> Iterator[tuple[str, dict]]:
    """Yield (where, row) with `where` naming the file and line (or list item) for error messages."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise QLoraError(f"{file}: cannot read ({' '.join(str(error).split())})") from None
    if file.suffix == ".jsonl":
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{file}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise QLoraError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise QLoraError(f"{where}: expected a JSON object, got {_json_type(row)}")
            yield where, row
        return
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise QLoraError(
            f"{file}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno})"
        ) from None
    if not isinstance(items, list):
        raise QLoraError(f"{file}: expected a JSON list of objects, got {_json_type(items)}")
    for index, row in enumerate(items):
        where = f"{file}: item {index}"
        if not isinstance(row, dict):
            raise QLoraError(f"{where}: expected a JSON object, got {_json_type(row)}")
        yield where, row


def _string_field(row: dict, name: str, where: str, *, optional: bool = False) -> str:
    if name not in row or (optional and row[name] is None):
        if optional:
            return ""
        raise QLoraError(f"{where}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, str):
        raise QLoraError(f"{where}: field {name!r} must be a string, got {_json_type(value)}")
    return value


# ----- rows to (text, trained) segments -----

Segments = list[tuple[str, bool]]


def _alpaca_segments(row: dict, where: str, spec: DatasetSpec) -> Segments:
    instruction = _string_field(row, spec.field_instruction, where)
    context = _string_field(row, spec.field_input, where, optional=True)
    output = _string_field(row, spec.field_output, where)
    if context.strip():
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=context)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return [(prompt, False), (output, True)]


def _completion_segments(row: dict, where: str, spec: DatasetSpec) -> Segments:
    return [
        (_string_field(row, spec.field_prompt, where), False),
        (_string_field(row, spec.field_completion, where), True),
    ]


def _text_segments(row: dict, where: str, spec: DatasetSpec) -> Segments:
    return [(_string_field(row, spec.field_text, where), True)]


def _chat_messages(row: dict, where: str, spec: DatasetSpec) -> list[dict]:
    if spec.field_messages not in row:
        raise QLoraError(f"{where}: missing field {spec.field_messages!r}")
    raw = row[spec.field_messages]
    if not isinstance(raw, list) or not raw:
        raise QLoraError(f"{where}: field {spec.field_messages!r} must be a non-empty list of messages")
    messages = []
    for index, message in enumerate(raw):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise QLoraError(f"{at}: expected an object, got {_json_type(message)}")
        role = _string_field(message, spec.message_field_role, at)
        if spec.message_field_content not in message:
            raise QLoraError(f"{at}: missing field {spec.message_field_content!r}")
        content = message[spec.message_field_content]
        if content is not None and not isinstance(content, str):
            raise QLoraError(
                f"{at}: field {spec.message_field_content!r} must be a string, got {_json_type(content)}"
            )
        converted = {
            k: v for k, v in message.items() if k not in (spec.message_field_role, spec.message_field_content)
        }
        messages.append({**converted, "role": role, "content": content})
    return messages


def _render(
    tokenizer: ChatTokenizer, messages: list[dict], where: str, add_generation_prompt: bool = False
) -> str:
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    except QLoraError as error:
        raise QLoraError(f"{where}: {error}") from None


def _end_of_turn(turn: str, tokenizer: ChatTokenizer) -> tuple[int, int] | None:
    """Where a turn's end-of-turn token sits in its text: the special token the turn ends with (trailing
    whitespace aside), else its last eos token; None when it has neither."""
    body = turn.rstrip()
    for token in (tokenizer.eos_token, *tokenizer.special_tokens):
        if body.endswith(token):
            return len(body) - len(token), len(body)
    at = turn.rfind(tokenizer.eos_token)
    return None if at < 0 else (at, at + len(tokenizer.eos_token))


def _turn_end(full: str, start: int, turn: str, tokenizer: ChatTokenizer) -> int | None:
    """Where a turn whose own rendering is `turn` ends inside `full`, given it starts at `start`.

    Exact when the conversation's rendering extends the turn's own. Some templates decorate only the
    last assistant turn (Qwen3 adds an empty <think></think> block there), so otherwise the longest tail
    of the turn's own text, end-of-turn token included, found at `start` is taken; None when none is.
    """
    if full.startswith(turn, start):
        return start + len(turn)
    end_of_turn = _end_of_turn(turn, tokenizer)
    longest_cut = end_of_turn[0] if end_of_turn else len(turn) - 1
    for cut in range(1, longest_cut + 1):
        if full.startswith(turn[cut:], start):
            return start + len(turn) - cut
    return None


def _chat_segments(row: dict, where: str, spec: DatasetSpec, tokenizer: ChatTokenizer) -> Segments:
    """The full rendering, with trained spans found by rendering prefixes of the conversation.

    An assistant turn is trained from the end of the generation prompt (so never its role header) through
    its end-of-turn token (or up to it, without train_on_eos); other roles in roles_to_train are trained
    from the end of the previous turn.
    """
    messages = _chat_messages(row, where, spec)
    full = _render(tokenizer, messages, where)
    spans: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        if message["role"] not in spec.roles_to_train:
            continue
        is_assistant = message["role"] == "assistant"
        before = _render(tokenizer, messages[:index], where, is_assistant) if index or is_assistant else ""
        through = _render(tokenizer, messages[: index + 1], where)
        start = len(before)
        if not full.startswith(before) or not through.startswith(before) or (spans and start < spans[-1][1]):
            raise QLoraError(
                f"{where}: message {index}: the chat template does not render this conversation "
                "prefix-consistently (the text before the turn changes), so its trained tokens cannot be found"
            )
        end = _turn_end(full, start, through[start:], tokenizer)
        if end is None:
            raise QLoraError(
                f"{where}: message {index}: the chat template renders this turn differently inside the "
                "whole conversation, so its trained tokens cannot be found"
            )
        end_of_turn = _end_of_turn(full[start:end], tokenizer)
        if end_of_turn is not None:
            end = start + end_of_turn[1 if spec.train_on_eos else 0]
        spans.append((start, end))
    segments: Segments = []
    cursor = 0
    for start, end in spans:
        segments += [(full[cursor:start], False), (full[start:end], True)]
        cursor = end
    segments.append((full[cursor:], False))
    return segments


# ----- segments to examples -----


def _to_example(ids: list[int], trained: list[bool], sequence_len: int) -> tuple[Example, bool]:
    """Shift the trained mask into labels, after cutting to sequence_len; also says whether it cut."""
    truncated = len(ids) > sequence_len
    ids, trained = ids[:sequence_len], trained[:sequence_len]
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    labels += [IGNORE_INDEX] if ids else []
    return Example(input_ids=ids, labels=labels), truncated


def load_examples(dataset: DatasetSpec, tokenizer: ChatTokenizer, sequence_len: int) -> ExampleList:
    """Read and tokenize one dataset; rows without a trained token are dropped and counted.

    Types: alpaca (Alpaca prompt, trains the output), chat_template (the tokenizer's chat template, trains
    turns whose role is in roles_to_train), completion (trains the completion), text (trains all). For all
    but chat_template the eos token is appended, trained only when train_on_eos; for chat_template the
    template writes it, and train_on_eos says whether trained turns include it. No BOS is added.
    """
    if dataset.type not in DATASET_TYPES:
        raise QLoraError(
            f"dataset {dataset.path}: unknown type {dataset.type!r} (expected one of {', '.join(DATASET_TYPES)})"
        )
    if sequence_len < 2:
        raise QLoraError(f"sequence_len must be at least 2, got {sequence_len}")
    path = Path(dataset.path)
    all_segments: list[Segments] = []
    for file in _dataset_files(path, dataset.split):
        for where, row in _read_rows(file):
            if dataset.type == "chat_template":
                all_segments.append(_chat_segments(row, where, dataset, tokenizer))
            elif dataset.type == "alpaca":
                all_segments.append(_alpaca_segments(row, where, dataset))
            elif dataset.type == "completion":
                all_segments.append(_completion_segments(row, where, dataset))
            else:
                all_segments.append(_text_segments(row, where, dataset))
    if not all_segments:
        raise QLoraError(f"{path}: dataset has no rows")

    flat_texts = [text for segments in all_segments for text, _ in segments]
    flat_ids = iter(tokenizer.encode_batch(flat_texts))
    append_eos = dataset.type != "chat_template"
    result = ExampleList(rows=len(all_segments))
    for segments in all_segments:
        ids: list[int] = []
        trained: list[bool] = []
        for _, is_trained in segments:
            piece = next(flat_ids)
            ids += piece
            trained += [is_trained] * len(piece)
        if append_eos:
            ids.append(tokenizer.eos_token_id)
            trained.append(dataset.train_on_eos)
        example, was_cut = _to_example(ids, trained, sequence_len)
        result.truncated += was_cut
        if all(label == IGNORE_INDEX for label in example.labels):
            result.dropped += 1
        else:
            result.append(example)
    return result


def split_validation(
    examples: list[Example], val_set_size: float | int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Hold out a fraction (float in [0, 1)) or a count (int >= 1) of examples; both keep their order."""
    n = len(examples)
    if isinstance(val_set_size, bool) or not isinstance(val_set_size, (int, float)):
        raise QLoraError(f"val_set_size must be a number, got {val_set_size!r}")
    if isinstance(val_set_size, float):
        if not 0.0 <= val_set_size < 1.0:
            raise QLoraError(f"val_set_size {val_set_size} must be a fraction in [0, 1) or a whole count")
        count = 0 if val_set_size == 0.0 else max(1, round(val_set_size * n))
    else:
        if val_set_size < 0:
            raise QLoraError(f"val_set_size must not be negative, got {val_set_size}")
        count = val_set_size
    if count >= n and count > 0:
        raise QLoraError(
            f"val_set_size holds out {count} examples but there are only {n}; none would be left to train"
        )
    held_out = set(random.Random(f"{seed}:validation").sample(range(n), count))
    train = [e for i, e in enumerate(examples) if i not in held_out]
    validation = [e for i, e in enumerate(examples) if i in held_out]
    return train, validation


# ----- batches -----


@dataclass
class Batch:
    """One micro-batch: rows of packed or padded documents with what attention and RoPE need to keep them apart.

    position_ids restart at 0 for every document; doc_ids number the documents of a row, and padding
    carries an id no document in its row has. n_tokens counts trained labels.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    n_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            doc_ids=self.doc_ids.to(device, non_blocking=non_blocking),
            n_tokens=self.n_tokens,
        )

    def padded_to(self, rows: int) -> Batch:
        """This batch with at least `rows` rows: each added row is one document of untrained tokens.

        A CUDA graph replays one shape, and an epoch's last micro-batch may hold fewer rows.
        """
        missing = rows - self.input_ids.shape[0]
        if missing <= 0:
            return self
        width = self.input_ids.shape[1]

        def extended(tensor: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor, row.to(tensor.dtype).expand(missing, width)])

        return Batch(
            input_ids=extended(self.input_ids, torch.zeros(width)),
            labels=extended(self.labels, torch.full((width,), IGNORE_INDEX)),
            position_ids=extended(self.position_ids, torch.arange(width)),
            doc_ids=extended(self.doc_ids, torch.zeros(width)),
            n_tokens=self.n_tokens,
        )


def _pack_rows(lengths: list[int], order: list[int], capacity: int) -> list[list[int]]:
    """Best-fit packing in the given order: each example goes into the fullest row it still fits."""
    rows: list[list[int]] = []
    rows_by_space: dict[int, list[int]] = {}
    spaces: list[int] = []  # sorted distinct free spaces that some open row has
    for example in order:
        need = lengths[example]
        slot = bisect.bisect_left(spaces, need)
        if slot == len(spaces):
            rows.append([example])
            row, space = len(rows) - 1, capacity - need
        else:
            old_space = spaces[slot]
            row = rows_by_space[old_space].pop()
            if not rows_by_space[old_space]:
                del rows_by_space[old_space]
                spaces.pop(slot)
            rows[row].append(example)
            space = old_space - need
        if space > 0:
            if space not in rows_by_space:
                rows_by_space[space] = []
                bisect.insort(spaces, space)
            rows_by_space[space].append(row)
    return rows


class BatchPlan:
    """Which examples make up micro-batch `index` of epoch `epoch`, and the tensors for it.

    Without packing every row holds one example, padded to the batch's longest rounded up to a multiple
    of 8 (at most sequence_len). With packing, examples are packed once, in a seed-shuffled order, into
    rows of at most sequence_len tokens, each padded to sequence_len; every epoch then shuffles the rows.
    Either way every epoch has the same `num_batches`; the last micro-batch may hold fewer rows.
    """

    def __init__(
        self,
        examples: list[Example],
        *,
        micro_batch_size: int,
        sequence_len: int,
        sample_packing: bool,
        seed: int,
        pad_token_id: int,
    ):
        if not examples:
            raise ValueError("BatchPlan needs at least one example")
        if micro_batch_size < 1 or sequence_len < 1:
            raise ValueError("micro_batch_size and sequence_len must be positive")
        lengths = [len(e.input_ids) for e in examples]
        if max(lengths) > sequence_len:
            raise ValueError(f"an example has {max(lengths)} tokens, more than sequence_len {sequence_len}")
        self.examples = examples
        self.micro_batch_size = micro_batch_size
        self.sequence_len = sequence_len
        self.sample_packing = sample_packing
        self.seed = seed
        self.pad_token_id = pad_token_id
        if sample_packing:
            order = list(range(len(examples)))
            random.Random(f"{seed}:packing").shuffle(order)
            self.rows = _pack_rows(lengths, order, sequence_len)
        else:
            self.rows = [[i] for i in range(len(examples))]
        self.num_batches = math.ceil(len(self.rows) / micro_batch_size)
        self._cached_epoch: int | None = None
        self._cached_order: list[int] = []

    def _row_order(self, epoch: int) -> list[int]:
        if self._cached_epoch != epoch:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order

    def batch_rows(self, epoch: int, index: int) -> list[list[int]]:
        """The example indices of each row of micro-batch `index` in `epoch`."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"micro-batch {index} out of range (an epoch has {self.num_batches})")
        chosen = self._row_order(epoch)[index * self.micro_batch_size : (index + 1) * self.micro_batch_size]
        return [self.rows[r] for r in chosen]

    def batch(self, epoch: int, index: int) -> Batch:
        rows = self.batch_rows(epoch, index)
        lengths = [sum(len(self.examples[i].input_ids) for i in row) for row in rows]
        if self.sample_packing:
            width = self.sequence_len
        else:
            width = min(self.sequence_len, math.ceil(max(lengths) / 8) * 8)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.int64)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
        position_ids = torch.zeros(shape, dtype=torch.int64)
        doc_ids = torch.zeros(shape, dtype=torch.int32)
        for r, row in enumerate(rows):
            offset = 0
            for doc, example_index in enumerate(row):
                example = self.examples[example_index]
                end = offset + len(example.input_ids)
                input_ids[r, offset:end] = torch.tensor(example.input_ids, dtype=torch.int64)
                labels[r, offset:end] = torch.tensor(example.labels, dtype=torch.int64)
                position_ids[r, offset:end] = torch.arange(end - offset)
                doc_ids[r, offset:end] = doc
                offset = end
            position_ids[r, offset:] = torch.arange(width - offset)
            doc_ids[r, offset:] = len(row)
        n_tokens = int((labels != IGNORE_INDEX).sum())
        return Batch(
            input_ids=input_ids, labels=labels, position_ids=position_ids, doc_ids=doc_ids, n_tokens=n_tokens
        )
