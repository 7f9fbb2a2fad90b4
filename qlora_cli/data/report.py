"""`qlora data`: what a config's datasets become before any weight is loaded.

Validates the config, tokenizes every dataset with the model's tokenizer (downloading only the tokenizer
files of a hub model), and reports rows, tokens, trained tokens, dropped rows and why, and how full the
micro-batches are; rendered examples show the trained tokens highlighted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import count, number
from qlora_cli.data.examples import (
    IGNORE_INDEX,
    BatchPlan,
    Example,
    ExampleList,
    check_sequence_len,
    check_token_ids,
    dropped_text,
    prepare_data,
    unread_text,
)
from qlora_cli.sources.hf_files import MODEL_CONFIG
from qlora_cli.sources.hub import resolve_tokenizer
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.run_tokenizer import run_tokenizer
from qlora_cli.sources.tokenizer import ChatTokenizer

TRAINED_STYLE = "bold green on grey15"


@dataclass
class DatasetStats:
    path: str
    rows: int
    examples: int
    tokens: int
    trained_tokens: int
    truncated: int
    dropped: int
    dropped_why: str
    unread: list[str]


@dataclass
class DataReport:
    """Numbers of a config's data; `fill` is the share of micro-batch slots holding a token (not padding)."""

    datasets: list[DatasetStats]
    train: list[Example]
    validation: list[Example]
    duplicates: int
    sequence_len: int
    sample_packing: bool
    micro_batches: int
    steps_per_epoch: int
    fill: float
    tokenizer: ChatTokenizer
    # The config's own notes (Axolotl keys it translated or leaves to another command), as a run prints them.
    config_notes: list[str]


def _trained(example: Example) -> int:
    return sum(label != IGNORE_INDEX for label in example.labels)


def _stats(path: str, examples: ExampleList) -> DatasetStats:
    return DatasetStats(
        path=path,
        rows=examples.rows,
        examples=len(examples),
        tokens=sum(len(e.input_ids) for e in examples),
        trained_tokens=sum(_trained(e) for e in examples),
        truncated=examples.truncated,
        dropped=examples.dropped.total(),
        dropped_why=dropped_text(examples),
        unread=examples.unread,
    )


def _fill(plan: BatchPlan) -> float:
    """Tokens over the slots of every micro-batch of an epoch, padding included."""
    tokens = sum(len(e.input_ids) for e in plan.examples)
    slots = 0
    for index in range(plan.num_batches):
        rows = plan.batch_rows(0, index)
        if plan.sample_packing:
            width = plan.sequence_len
        else:
            longest = max(sum(len(plan.examples[i].input_ids) for i in row) for row in rows)
            width = min(plan.sequence_len, math.ceil(longest / 8) * 8)
        slots += width * len(rows)
    return tokens / slots


def data_report(config: TrainConfig) -> DataReport:
    """Tokenize the config's datasets as a training run would, with no weights loaded."""
    folder = resolve_tokenizer(config.base_model, config.revision)
    spec = read_spec(folder) if (folder / MODEL_CONFIG).is_file() else None
    if spec is not None:
        check_sequence_len(config, spec)
        # A starting adapter's targets replace the config's: qlora train reads them from it.
        targets = config.target_modules, config.lora_target_parameters
        if config.lora_model_dir is None and (problem := spec.lora_target_problem(*targets)):
            raise QLoraError(problem)
    tokenizer = run_tokenizer(folder, config)
    data = prepare_data(config, tokenizer)
    if spec is not None:
        check_token_ids([*data.train, *data.validation], tokenizer, spec.vocab_size)
    plan = BatchPlan.from_config(data.train, config, tokenizer.pad_token_id)
    return DataReport(
        datasets=[_stats(path, examples) for path, examples in data.loaded],
        train=data.train,
        validation=data.validation,
        duplicates=data.duplicates,
        sequence_len=config.sequence_len,
        sample_packing=config.sample_packing,
        micro_batches=plan.num_batches,
        steps_per_epoch=plan.steps_per_epoch(config.gradient_accumulation_steps),
        fill=_fill(plan),
        tokenizer=tokenizer,
        config_notes=list(config.notes),
    )


def highlighted(example: Example, tokenizer: ChatTokenizer, *, color: bool = True) -> Text:
    """The example's text, trained tokens in bold green on a dark background, the rest dimmed; without
    color, trained text is bracketed in ⟦ ⟧ instead.

    Token t is trained when the position before it predicts it (labels are stored shifted).
    """
    text = Text()
    flags = [False] + [label != IGNORE_INDEX for label in example.labels[:-1]]
    start = 0
    for end in range(1, len(flags) + 1):
        if end == len(flags) or flags[end] != flags[start]:
            piece = tokenizer.decode(example.input_ids[start:end])
            if flags[start]:
                text.append(piece if color else f"⟦{piece}⟧", style=TRAINED_STYLE)
            else:
                text.append(piece, style="dim")
            start = end
    return text


def print_data_report(report: DataReport, console: Console, show: int = 0) -> None:
    color = console.color_system is not None
    for note in report.config_notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    table = Table(title="datasets", title_justify="left")
    for column in ("dataset", "rows", "examples", "tokens", "trained tokens", "truncated", "dropped"):
        table.add_column(column, justify="left" if column == "dataset" else "right", overflow="fold")
    for stats in report.datasets:
        table.add_row(
            escape(stats.path),
            f"{stats.rows:,}",
            f"{stats.examples:,}",
            f"{stats.tokens:,}",
            f"{stats.trained_tokens:,} ({stats.trained_tokens / max(1, stats.tokens):.0%})",
            f"{stats.truncated:,}",
            f"{stats.dropped:,}",
        )
    console.print(table)
    for stats in report.datasets:
        if stats.dropped:
            console.print(f"{stats.path}: dropped {stats.dropped_why}", highlight=False, markup=False)
        if stats.unread:
            console.print(f"{stats.path}: {unread_text(stats.unread)}", highlight=False, markup=False)
    tokens = sum(len(e.input_ids) for e in report.train)
    trained = sum(_trained(e) for e in report.train)
    longest = max(len(e.input_ids) for e in report.train)
    lines = [
        f"training examples: {number(len(report.train))} ({count(tokens, 'token')}, {number(trained)} trained; "
        f"mean {tokens / len(report.train):.1f}, longest {number(longest)} of sequence_len {number(report.sequence_len)})",
        f"evaluation examples: {len(report.validation):,}",
    ]
    if report.duplicates:
        lines.append(f"duplicates removed: {report.duplicates:,}")
    if report.sample_packing:
        batches = (
            f"packed rows of {count(report.sequence_len, 'token')}; packing efficiency {report.fill:.1%}"
        )
    else:
        batches = f"padded rows; {report.fill:.1%} of their tokens are not padding"
    lines.append(
        f"micro-batches per epoch: {report.micro_batches:,} ({batches}); "
        f"optimizer steps per epoch: {report.steps_per_epoch:,}"
    )
    for line in lines:
        console.print(line, highlight=False)
    for index, example in enumerate(report.train[:show]):
        console.rule(
            f"example {index} ({count(len(example.input_ids), 'token')}, {number(_trained(example))} trained)"
        )
        console.print(highlighted(example, report.tokenizer, color=color), highlight=False)
    if show:
        legend = "trained tokens" if color else "⟦trained tokens⟧"
        console.print(Text(legend, style=TRAINED_STYLE), Text("not trained", style="dim"))
