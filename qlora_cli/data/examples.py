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
import dataclasses
import functools
import math
import random
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_cli.config.schema import DatasetConfig, TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.text import text_problem
from qlora_cli.core.wording import count, number
from qlora_cli.data import prompts
from qlora_cli.data.files import files_for_split, fingerprint, read_split, split_file_list, unread_files
from qlora_cli.sources.hub import resolve_dataset, snapshot_commit
from qlora_cli.sources.run_tokenizer import check_token_id, dataset_template
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.tokenizer import ChatTokenizer

IGNORE_INDEX = -100

# Why a row left no example, in the words the statistics and errors use.
WRONG_ROLES = "no turn of a trained role"
EMPTY = "nothing to train (empty response)"
TOO_LONG = "no trained token within sequence_len"
LONGER = "more tokens than sequence_len (excess_length_strategy: drop)"


@dataclass
class Example:
    """One tokenized document; labels[t] is the token to predict at position t, or -100."""

    input_ids: list[int]
    labels: list[int]


class ExampleList(list):
    """The examples of a dataset (a plain list of Example) plus what loading did to them.

    rows: rows read from the files; truncated: examples cut to sequence_len; dropped: why rows left no
    example (reason -> count); roles_seen: the template roles of dropped chats, for the error message;
    unread: the files of the dataset's folder in no format qlora reads.
    """

    def __init__(self, examples: Iterable[Example] = (), *, rows: int = 0, truncated: int = 0):
        super().__init__(examples)
        self.rows = rows
        self.truncated = truncated
        self.dropped: Counter[str] = Counter()
        self.roles_seen: Counter[str] = Counter()
        self.unread: list[str] = []


def _to_example(ids: list[int], trained: list[bool], sequence_len: int) -> tuple[Example, bool]:
    """Shift the trained mask into labels, after cutting to sequence_len; also says whether it cut."""
    truncated = len(ids) > sequence_len
    ids, trained = ids[:sequence_len], trained[:sequence_len]
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(ids[1:], trained[1:], strict=True)]
    labels += [IGNORE_INDEX] if ids else []
    return Example(input_ids=ids, labels=labels), truncated


def _shard(rows: list, shards: int, index: int) -> list:
    """The index-th of `shards` contiguous, nearly equal parts (the first ones one row longer)."""
    size, extra = divmod(len(rows), shards)
    start = index * size + min(index, extra)
    return rows[start : start + size + (index < extra)]


def _refuse_untokenizable(rows: list[tuple[str, dict]], rendered: list) -> None:
    """The row whose text the tokenizer refused (a JSON \\ud800 escape leaves a lone surrogate), named."""
    for (where, _), row in zip(rows, rendered, strict=True):
        for text, _ in row.segments:
            if problem := text_problem(text):
                raise QLoraError(f"{where}: the row {problem}")


def load_examples(
    dataset: DatasetConfig,
    tokenizer: ChatTokenizer,
    sequence_len: int,
    *,
    train_on_inputs: bool = False,
    template_variables: dict | None = None,
    drop_long: bool = False,
) -> ExampleList:
    """Read, render and tokenize one dataset; rows that leave no trained token are dropped and counted.

    `dataset.path` is a local file or folder (hub repos are downloaded before). No BOS is added; the
    end-of-sequence token ends alpaca, completion and text rows, trained unless train_on_eos is none.
    Rows longer than sequence_len are cut, or dropped with drop_long.
    """
    if sequence_len < 2:
        raise QLoraError(f"sequence_len must be at least 2, got {sequence_len}")
    prompts.prompt_format(dataset.type)
    path = Path(dataset.path)
    rows = read_split(
        path, dataset.split, data_files=dataset.data_files, subset=dataset.name, file_format=dataset.ds_type
    )
    if dataset.shards is not None:
        rows = _shard(rows, dataset.shards, dataset.shards_idx)
    if not rows:
        raise QLoraError(f"{path}: dataset has no rows (split '{dataset.split}')")
    variables = template_variables or {}
    rendered = [
        prompts.render_row(
            row, where, dataset, tokenizer, train_on_inputs=train_on_inputs, variables=variables
        )
        for where, row in rows
    ]
    try:
        flat_ids = iter(tokenizer.encode_batch([text for r in rendered for text, _ in r.segments]))
    except TypeError:
        _refuse_untokenizable(rows, rendered)
        raise
    result = ExampleList(rows=len(rendered))
    result.unread = unread_files(path, data_files=dataset.data_files, subset=dataset.name)
    for row in rendered:
        ids: list[int] = []
        trained: list[bool] = []
        for _, is_trained in row.segments:
            piece = next(flat_ids)
            ids += piece
            trained += [is_trained] * len(piece)
        if drop_long and len(ids) > sequence_len:
            result.dropped[LONGER] += 1
            continue
        example, was_cut = _to_example(ids, trained, sequence_len)
        if any(trained[1 : len(example.input_ids)]):
            result.truncated += was_cut
            result.append(example)
            continue
        if not row.trains_a_turn:
            result.dropped[WRONG_ROLES] += 1
            result.roles_seen.update(set(row.roles))
        elif any(trained[1:]):
            result.dropped[TOO_LONG] += 1
        else:
            result.dropped[EMPTY] += 1
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
        held = 0 if val_set_size == 0.0 else max(1, round(val_set_size * n))
    else:
        if val_set_size < 0:
            raise QLoraError(f"val_set_size must not be negative, got {val_set_size}")
        held = val_set_size
    if held >= n and held > 0:
        raise QLoraError(
            f"val_set_size holds out {count(held, 'example')} but there are only {number(n)}; none would be left "
            "to train"
        )
    held_out = set(random.Random(f"{seed}:validation").sample(range(n), held))
    train = [e for i, e in enumerate(examples) if i not in held_out]
    validation = [e for i, e in enumerate(examples) if i in held_out]
    return train, validation


# ----- a config's datasets -----


@dataclass
class PreparedData:
    """The training and evaluation examples of a config, with what loading each dataset did."""

    train: list[Example]
    validation: list[Example]
    loaded: list[tuple[str, ExampleList]]
    duplicates: int = 0
    datasets: list = dataclasses.field(default_factory=list)  # the entries read, hub ones pinned
    test_datasets: list = dataclasses.field(default_factory=list)
    files: list[dict] = dataclasses.field(default_factory=list)  # fingerprints of the local files read

    def notes(self) -> list[str]:
        """One line per dataset whose rows were cut or dropped, and one for removed duplicates."""
        lines = []
        for name, examples in self.loaded:
            if examples.truncated:
                lines.append(f"{name}: {count(examples.truncated, 'example')} truncated to sequence_len")
            if examples.dropped:
                lines.append(f"{name}: {dropped_text(examples)} dropped")
            if examples.unread:
                lines.append(f"{name}: {unread_text(examples.unread)}")
        if self.duplicates:
            lines.append(
                f"{count(self.duplicates, 'duplicate example')} removed (dataset_exact_deduplication)"
            )
        return lines


def dropped_text(examples: ExampleList, roles_to_train: Iterable[str] = ()) -> str:
    """How many rows were dropped for which reason, in one line."""
    parts = []
    for reason, rows in examples.dropped.most_common():
        text = f"{count(rows, 'row')} with {reason}"
        if reason == WRONG_ROLES and examples.roles_seen:
            wanted = f"roles_to_train: {', '.join(roles_to_train)}; " if roles_to_train else ""
            text += f" ({wanted}their roles: {', '.join(sorted(examples.roles_seen))})"
        parts.append(text)
    return ", ".join(parts)


def unread_text(files: list[str], shown: int = 5) -> str:
    """Which files of a folder no format reads, in one line however many there are (a folder of images)."""
    names = ", ".join(files[:shown]) + (
        f" and {number(len(files) - shown)} more" if len(files) > shown else ""
    )
    return f"{count(len(files), 'file')} not read, in no format qlora reads: {names}"


# `path: json` (or parquet, csv, arrow) with data_files: the `datasets` idiom for local files.
LOADERS = ("json", "parquet", "csv", "arrow")


def reads_local_files(dataset: DatasetConfig) -> bool:
    """Whether a datasets entry, as a checkpoint saves it (local paths absolute), reads local files, which
    the checkpoint records by their bytes (local_files), rather than a hub repo, pinned by its commit."""
    return Path(dataset.path).is_absolute() or (dataset.path in LOADERS and dataset.data_files is not None)


def local_dataset(dataset):
    """The dataset entry with a hub dataset repo id replaced by the folder it downloads to (only the
    asked split's files, when the files name splits).

    `path: json` (or parquet, csv, arrow) with data_files is the `datasets` idiom for local files:
    data_files are then relative to the working directory.
    """
    if dataset.path in LOADERS and dataset.data_files is not None:
        return dataclasses.replace(dataset, path=".", ds_type=dataset.ds_type or dataset.path)
    if Path(dataset.path).exists():
        return dataset
    choose = None
    if dataset.data_files is None:
        choose = functools.partial(files_for_split, split=dataset.split, subset=dataset.name)
    folder = resolve_dataset(dataset.path, dataset.revision, choose=choose)
    return dataclasses.replace(dataset, path=str(folder))


def pinned_dataset(dataset, local):
    """The entry as a run saves it: a hub dataset at the commit `local` was downloaded at, so a
    resumed run reads the rows it started with even after the repo has changed."""
    commit = snapshot_commit(Path(local.path)) if local.path != dataset.path else None
    return dataclasses.replace(dataset, revision=commit) if commit else dataset


def local_files(dataset, local) -> list[dict]:
    """Fingerprints of the files a local dataset reads; none for a hub one, which its commit pins."""
    if local.path != dataset.path and snapshot_commit(Path(local.path)):
        return []
    files = split_file_list(Path(local.path), local.split, data_files=local.data_files, subset=local.name)
    return [fingerprint(file) for file in files]


def _load_all(
    datasets: list, tokenizer: ChatTokenizer, config: TrainConfig, key: str
) -> tuple[list[tuple[str, ExampleList]], list, list[dict]]:
    """Each dataset's examples, the entries as pinned_dataset saves them, and the local files' fingerprints."""
    loaded, pinned, files = [], [], []
    for dataset in datasets:
        chosen = dataset_template(tokenizer, dataset, config)
        local = local_dataset(dataset)
        examples = load_examples(
            local,
            chosen,
            config.sequence_len,
            train_on_inputs=config.train_on_inputs,
            template_variables=config.chat_template_kwargs,
            drop_long=config.excess_length_strategy == "drop",
        )
        if not examples:
            raise QLoraError(
                f"{key}: every one of the {count(examples.rows, 'row')} of {dataset.path} was dropped: "
                f"{dropped_text(examples, dataset.roles_to_train)}"
            )
        loaded.append((dataset.path, examples))
        pinned.append(pinned_dataset(dataset, local))
        files += [entry for entry in local_files(dataset, local) if entry not in files]
    return loaded, pinned, files


def _deduplicated(examples: list[Example]) -> list[Example]:
    seen = set()
    kept = []
    for example in examples:
        key = (tuple(example.input_ids), tuple(example.labels))
        if key not in seen:
            seen.add(key)
            kept.append(example)
    return kept


def check_token_ids(examples: Iterable[Example], tokenizer: ChatTokenizer, vocab_size: int) -> None:
    """Every id a batch of these examples holds, the padding's too, has a row in the model's embedding."""
    largest = max((max(example.input_ids) for example in examples), default=0)
    check_token_id(tokenizer, vocab_size, largest, "the largest token id in the data is")
    pad = f"the pad_token {tokenizer.pad_token!r} is token id"
    check_token_id(tokenizer, vocab_size, tokenizer.pad_token_id, pad)


def prepare_data(config: TrainConfig, tokenizer: ChatTokenizer) -> PreparedData:
    """Every dataset of the config as examples, split into training and evaluation ones.

    Evaluation examples come from test_datasets when there are any, else val_set_size holds them out.
    """
    loaded, datasets, files = _load_all(config.datasets, tokenizer, config, "datasets")
    examples = [example for _, dataset_examples in loaded for example in dataset_examples]
    duplicates = 0
    if config.dataset_exact_deduplication:
        kept = _deduplicated(examples)
        duplicates, examples = len(examples) - len(kept), kept
    if config.test_datasets:
        tested, test_datasets, test_files = _load_all(
            config.test_datasets, tokenizer, config, "test_datasets"
        )
        validation = [example for _, dataset_examples in tested for example in dataset_examples]
        files += [entry for entry in test_files if entry not in files]
        return PreparedData(examples, validation, loaded + tested, duplicates, datasets, test_datasets, files)
    train, validation = split_validation(examples, config.val_set_size, config.seed)
    return PreparedData(train, validation, loaded, duplicates, datasets, files=files)


# ----- batches -----


@dataclass
class Batch:
    """One micro-batch: rows of packed or padded documents with what attention and RoPE need to keep them apart.

    position_ids restart at 0 for every document; doc_ids number the documents of a row, and padding
    carries an id no document in its row has. n_tokens counts trained labels. row_tokens: each row's
    tokens before its padding, which always ends a row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    n_tokens: int
    row_tokens: tuple[int, ...]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            position_ids=self.position_ids.to(device, non_blocking=non_blocking),
            doc_ids=self.doc_ids.to(device, non_blocking=non_blocking),
            n_tokens=self.n_tokens,
            row_tokens=self.row_tokens,
        )

    def real_tokens(self) -> torch.Tensor:
        """[rows, width] bool on the batch's device, False at padding: what transformers' attention mask
        marks. Made on demand, since only a MoE's load-balancing loss reads it."""
        device = self.input_ids.device
        positions = torch.arange(self.input_ids.shape[1], device=device)
        return positions < torch.tensor(self.row_tokens, device=device)[:, None]

    def untrained(self) -> Batch:
        """This batch with no trained label: a rank with no micro-batch left in an epoch's last step runs
        it to join the gradient exchange, adding nothing to the update."""
        return dataclasses.replace(self, labels=torch.full_like(self.labels, IGNORE_INDEX), n_tokens=0)

    def padded_to(self, rows: int) -> Batch:
        """This batch with at least `rows` rows: each added row is one document of untrained tokens, and
        padding to the load-balancing loss (no real token).

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
            row_tokens=self.row_tokens + (0,) * missing,
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

    Optimizer steps never straddle epochs: an epoch's last step takes the micro-batches that are left
    (`steps_per_epoch`, `step_micro_batches`), so `num_epochs: N` shows every row N times.
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

    @classmethod
    def from_config(
        cls,
        examples: list[Example],
        config: TrainConfig,
        pad_token_id: int,
        *,
        sample_packing: bool | None = None,
    ) -> BatchPlan:
        """The plan `qlora train` and `qlora data` both make of the config's keys (`sample_packing`
        overrides the config's, as an evaluation plan's eval_sample_packing does)."""
        return cls(
            examples,
            micro_batch_size=config.micro_batch_size,
            sequence_len=config.sequence_len,
            sample_packing=config.sample_packing if sample_packing is None else sample_packing,
            seed=config.seed,
            pad_token_id=pad_token_id,
        )

    def steps_per_epoch(self, per_step: int) -> int:
        """Optimizer steps in an epoch when a step reads `per_step` micro-batches (accumulation × ranks)."""
        return math.ceil(self.num_batches / per_step)

    def step_micro_batches(self, step: int, per_step: int) -> tuple[int, range]:
        """(epoch, the epoch's micro-batch indices) that optimizer step `step` (0-based) reads."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch(per_step))
        return epoch, range(in_epoch * per_step, min(self.num_batches, (in_epoch + 1) * per_step))

    def epochs_done(self, steps: int, per_step: int) -> float:
        """How many epochs `steps` optimizer steps have read, counted in micro-batches."""
        epoch, indices = self.step_micro_batches(steps - 1, per_step) if steps else (0, range(0))
        return epoch + indices.stop / self.num_batches

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
        """Built from flat token arrays (each example's lists copied in C) and a few whole-batch torch
        ops: the host builds it while the GPU waits, and torch.tensor of an 8K-token list or a
        per-document slice assignment takes about a millisecond each."""
        rows = self.batch_rows(epoch, index)
        lengths = [[len(self.examples[i].input_ids) for i in row] for row in rows]
        if self.sample_packing:
            width = self.sequence_len
        else:
            width = min(self.sequence_len, math.ceil(max(sum(row) for row in lengths) / 8) * 8)
        input_ids, labels = array("q"), array("q")
        for row, row_lengths in zip(rows, lengths, strict=True):
            for example_index in row:
                input_ids.extend(self.examples[example_index].input_ids)
                labels.extend(self.examples[example_index].labels)
            padding = width - sum(row_lengths)
            input_ids.extend([self.pad_token_id] * padding)
            labels.extend([IGNORE_INDEX] * padding)
        shape = (len(rows), width)
        # Each row's segments: its documents, then its padding, which takes the next document id. A
        # token's segment counts the segment starts at or before it (empty segments start twice).
        segments = torch.tensor([n for row in lengths for n in (*row, width - sum(row))])
        starts = torch.cumsum(segments, 0) - segments
        tokens = len(rows) * width
        later = starts[1:][starts[1:] < tokens]
        segment = (
            torch.zeros(tokens, dtype=torch.int64).index_add_(0, later, torch.ones_like(later)).cumsum(0)
        )
        documents = torch.tensor([doc for row in lengths for doc in range(len(row) + 1)], dtype=torch.int32)
        labels_tensor = torch.frombuffer(labels, dtype=torch.int64).view(shape)
        return Batch(
            input_ids=torch.frombuffer(input_ids, dtype=torch.int64).view(shape),
            labels=labels_tensor,
            position_ids=(torch.arange(tokens) - starts.index_select(0, segment)).view(shape),
            doc_ids=documents.index_select(0, segment).view(shape),
            n_tokens=int((labels_tensor != IGNORE_INDEX).sum()),
            row_tokens=tuple(sum(row) for row in lengths),
        )


def check_sequence_len(config: TrainConfig, spec: ModelSpec) -> None:
    """Rows no longer than the model takes, for `qlora train` and `qlora data` alike.

    Within a window as long as the row, sliding-window attention is plain causal attention; a shorter
    window would take the torch path of qlora_kernels.attention, which generation uses past the window."""
    if config.sequence_len > spec.max_position_embeddings:
        raise QLoraError(
            f"config key 'sequence_len': {config.sequence_len} is above the model's maximum "
            f"of {number(spec.max_position_embeddings)} (max_position_embeddings)"
        )
    if spec.sliding_window is not None and spec.sliding_window < config.sequence_len:
        raise QLoraError(
            f"sliding_window {number(spec.sliding_window)} < sequence_len {number(config.sequence_len)}: "
            "qlora's training attention has no sliding window; "
            f"set sequence_len <= {number(spec.sliding_window)}"
        )
