"""The training config: flat YAML with Axolotl's key names, checked into a typed TrainConfig.

Every key has a type, a default and a range, declared once on the dataclass field; the checker
reads those declarations, so an error always names the key and what was expected, and an unknown
key names the closest known one. Axolotl's keys that are not qlora's own go through axolotl.py
first. Every problem of a config is collected and reported in one error; null means the default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from qlora_cli.axolotl import translate
from qlora_cli.errors import QLoraError

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """Field metadata: the allowed numeric interval, shown in errors."""
    return {"range": (lo, hi, lo_open, hi_open)}


@dataclass
class InstructionFormat:
    """`type:` as a mapping: the prompt is `system_format` (when there is a system text) followed by
    `format` ({instruction}, {input}) or, for rows without input, `no_input_format`; without `format`,
    Alpaca's layout with these field names."""

    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = "system"
    system_prompt: str = ""
    system_format: str = "{system}"
    format: str | None = None
    no_input_format: str | None = None


@dataclass
class DatasetConfig:
    """One entry of `datasets` (or `test_datasets`), with Axolotl's keys; qlora_cli/prompts.py renders rows.

    field_messages, message_field_role and message_field_content left unset read `messages` with
    role/content, or ShareGPT's `conversations` with from/value, whichever the rows have.
    """

    path: str
    type: str | InstructionFormat = "alpaca"
    split: str = "train"
    revision: str | None = None
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    ds_type: Literal["json", "jsonl", "parquet", "arrow", "csv"] | None = None
    field_messages: str | None = None
    message_property_mappings: dict[str, str] = field(default_factory=dict)
    message_field_role: str | None = None
    message_field_content: str | None = None
    message_field_training: str = "training"
    roles: dict[str, list[str]] = field(default_factory=dict)
    roles_to_train: list[str] = field(default_factory=lambda: ["assistant"])
    train_on_eos: Literal["turn", "all", "last", "none"] | bool = "turn"
    drop_system_message: bool = False
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = "system"
    field_prompt: str = "prompt"
    field_completion: str = "completion"
    field_text: str = "text"
    chat_template: str | None = None
    chat_template_jinja: str | None = None
    shards: int | None = field(default=None, metadata=_range(1, None))
    shards_idx: int = field(default=0, metadata=_range(0, None))
    trust_remote_code: bool = False
    field: str | None = None  # last: the name `field` hides dataclasses.field in the class body below it

    def __post_init__(self):
        # Axolotl's train_on_eos is a word; a boolean (qlora's older form) means turn or none.
        if isinstance(self.train_on_eos, bool):
            self.train_on_eos = "turn" if self.train_on_eos else "none"
        if self.ds_type == "jsonl":
            self.ds_type = "json"


@dataclass
class SpecialTokens:
    """Tokens of the vocabulary to use as pad, end-of-sequence or begin-of-sequence token."""

    pad_token: str | None = None
    eos_token: str | None = None
    bos_token: str | None = None


@dataclass
class TrainConfig:
    base_model: str
    datasets: list[DatasetConfig]
    revision: str | None = None
    load_in_4bit: bool = True
    adapter: Literal["qlora", "lora"] = "qlora"
    lora_r: int = field(default=16, metadata=_range(1, 4096))
    lora_alpha: float = field(default=32.0, metadata=_range(0, None, lo_open=True))
    lora_dropout: float = field(default=0.0, metadata=_range(0, 1, hi_open=True))
    lora_target_modules: list[str] = field(default_factory=lambda: list(ALL_PROJECTIONS))
    lora_target_linear: bool = False
    peft_use_rslora: bool = False
    train_norms: bool = False
    sequence_len: int = field(default=2048, metadata=_range(8, 1 << 20))
    sample_packing: bool = False
    micro_batch_size: int = field(default=1, metadata=_range(1, 65536))
    gradient_accumulation_steps: int = field(default=1, metadata=_range(1, 65536))
    num_epochs: float = field(default=1.0, metadata=_range(0, None, lo_open=True))
    max_steps: int | None = field(default=None, metadata=_range(1, None))
    optimizer: Literal["adamw_torch_fused", "adamw_torch"] = "adamw_torch_fused"
    learning_rate: float = field(default=2e-4, metadata=_range(0, None, lo_open=True))
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int | None = field(default=None, metadata=_range(0, None))
    warmup_ratio: float = field(default=0.0, metadata=_range(0, 1))
    weight_decay: float = field(default=0.0, metadata=_range(0, None))
    adam_beta1: float = field(default=0.9, metadata=_range(0, 1, hi_open=True))
    adam_beta2: float = field(default=0.999, metadata=_range(0, 1, hi_open=True))
    adam_epsilon: float = field(default=1e-8, metadata=_range(0, None, lo_open=True))
    max_grad_norm: float = field(default=1.0, metadata=_range(0, None))
    val_set_size: int | float = field(default=0.0, metadata=_range(0, None))
    eval_steps: int | None = field(default=None, metadata=_range(1, None))
    evals_per_epoch: int | None = field(default=None, metadata=_range(1, None))
    eval_sample_packing: bool | None = None
    output_dir: str = "./outputs/qlora"
    overwrite_output_dir: bool = False
    save_steps: int | None = field(default=None, metadata=_range(1, None))
    saves_per_epoch: int | None = field(default=None, metadata=_range(1, None))
    save_first_step: bool = False
    save_total_limit: int | None = field(default=None, metadata=_range(1, None))
    resume_from_checkpoint: str | None = None
    auto_resume_from_checkpoints: bool = False
    lora_model_dir: str | None = None
    special_tokens: SpecialTokens = field(default_factory=SpecialTokens)
    loss_watchdog_threshold: float | None = field(default=None, metadata=_range(0, None, lo_open=True))
    loss_watchdog_patience: int | None = field(default=None, metadata=_range(1, None))
    logging_steps: int = field(default=1, metadata=_range(1, None))
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_run_id: str | None = None
    wandb_watch: bool | Literal["false", "gradients", "parameters", "all"] | None = None
    wandb_log_model: bool | Literal["false", "checkpoint", "end"] | None = None
    use_tensorboard: bool = False
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    seed: int = 42
    bf16: bool | Literal["auto"] = "auto"
    gradient_checkpointing: bool | Literal["auto"] = True
    activation_offloading: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = field(default=None, metadata=_range(0, None, lo_open=True))
    attention: Literal["auto", "triton", "sdpa", "flex"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cuda_graphs: bool | Literal["auto"] = "auto"
    test_datasets: list[DatasetConfig] = field(default_factory=list)
    train_on_inputs: bool = False
    chat_template: str | None = None
    chat_template_jinja: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset_exact_deduplication: bool = False
    excess_length_strategy: Literal["truncate", "drop"] = "truncate"
    # What translating Axolotl's keys had to say; printed once when the run starts, never saved.
    notes: list[str] = field(default_factory=list, compare=False, repr=False, metadata={"derived": True})

    @property
    def target_modules(self) -> list[str]:
        return list(ALL_PROJECTIONS) if self.lora_target_linear else list(self.lora_target_modules)

    @property
    def quantize(self) -> bool:
        return self.load_in_4bit


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping to {_type_name(typing.get_args(tp)[1])}"
    if tp is Any:
        return "any value"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}[
        tp
    ]


def _float_from_text(text: str) -> Any:
    """PyYAML reads `1e-4` (no dot) as a string; Axolotl users write it that way, so take it."""
    try:
        return float(text)
    except ValueError:
        return text


class _Problems(QLoraError):
    """Every problem found inside one mapping (a dataset entry), carried up to the top-level list."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check one value against a field type; returns the value in that type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, where)
            except _Problems:
                raise
            except QLoraError:
                continue
        raise QLoraError(f"config key '{where}': expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise QLoraError(f"config key '{where}': expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise QLoraError(f"config key '{where}': expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        problems: list[str] = []
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_convert(v, item, f"{where}[{i}]"))
            except _Problems as err:
                problems.extend(err.problems)
            except QLoraError as err:
                problems.append(str(err))
        if problems:
            raise _Problems(problems)
        return items
    if origin is dict:
        if not isinstance(value, dict):
            raise QLoraError(f"config key '{where}': expected {_type_name(tp)}, got {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {
            _convert(k, key_type, where): _convert(v, value_type, f"{where}.{k}") for k, v in value.items()
        }
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise QLoraError(f"config key '{where}': expected a mapping, got {value!r}")
        problems = []
        built = _build(tp, value, problems, prefix=f"{where}.")
        if problems:
            raise _Problems(problems)
        return built
    if tp is float and isinstance(value, str):
        value = _float_from_text(value)
    ok = {
        type(None): value is None,
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        raise QLoraError(f"config key '{where}': expected {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _range_problem(name: str, value: Any, bounds: tuple) -> str | None:
    lo, hi, lo_open, hi_open = bounds
    if value is None:
        return None
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if not (too_low or too_high):
        return None
    left = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
    right = "" if hi is None else f"{'<' if hi_open else '<='} {hi:g}"
    expected = " and ".join(p for p in (left, right) if p)
    return f"config key '{name}': expected a value {expected}, got {value!r}"


def _build(cls: type, raw: dict, problems: list[str], prefix: str = "", failed: set | None = None) -> Any:
    """The dataclass `cls` from `raw`, each problem added to `problems` and its key to `failed`.

    Keys that failed take their defaults (required ones an empty value), so the rules among keys can
    still be checked; the caller drops the rules that concern a failed key.
    """
    failed = set() if failed is None else failed
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
    values = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            problems.append(f"unknown config key '{name}'{hint}")
            failed.add(key)
            continue
        if value is None:
            continue
        try:
            value = _convert(value, hints[key], name)
        except _Problems as err:
            problems.extend(err.problems)
            failed.add(key)
            continue
        except QLoraError as err:
            problems.append(str(err))
            failed.add(key)
            continue
        out_of_range = _range_problem(name, value, fields[key].metadata.get("range", (None,) * 4))
        if out_of_range:
            problems.append(out_of_range)
            failed.add(key)
            continue
        values[key] = value
    missing = [
        f.name
        for f in fields.values()
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    for name in missing:
        if name not in failed:
            problems.append(f"config is missing the required key '{prefix}{name}'")
        failed.add(name)
        values[name] = [] if typing.get_origin(hints[name]) is list else ""
    return cls(**values)


def _dataset_problems(config: TrainConfig) -> list[str]:
    """What in the dataset keys cannot be honoured: unknown types, chat templates, conflicting keys."""
    from qlora_cli.chat_templates import template_problem
    from qlora_cli.prompts import type_problem

    problems = []
    for key, datasets in (("datasets", config.datasets), ("test_datasets", config.test_datasets)):
        for index, dataset in enumerate(datasets):
            where = f"config key '{key}[{index}]"
            problem = type_problem(dataset.type)
            if problem:
                problems.append(f"{where}.type': {problem.removeprefix('type.')}")
            problem = template_problem(dataset.chat_template, dataset.chat_template_jinja)
            if problem:
                problems.append(f"{key}[{index}]: {problem}")
            if dataset.shards is not None and dataset.shards_idx >= dataset.shards:
                problems.append(
                    f"{where}.shards_idx': {dataset.shards_idx} is not below shards {dataset.shards}"
                )
            if dataset.trust_remote_code:
                problems.append(
                    f"{where}.trust_remote_code': qlora never runs a dataset's loading script; "
                    "point path at its data files (parquet, json, csv, arrow) instead"
                )
    problem = template_problem(config.chat_template, config.chat_template_jinja)
    if problem:
        problems.append(problem)
    if config.test_datasets and config.val_set_size:
        problems.append(
            "config keys 'test_datasets' and 'val_set_size' both choose evaluation rows; keep one of them"
        )
    return problems


def _consistency_problems(config: TrainConfig) -> typing.Iterator[tuple[tuple[str, ...], str]]:
    """(the keys it concerns, the problem) for each rule among keys that holds no more."""
    if not config.datasets:
        yield ("datasets",), "config key 'datasets': expected at least one dataset"
    for problem in _dataset_problems(config):
        yield (), problem
    unknown = sorted(set(config.target_modules) - set(ALL_PROJECTIONS))
    if unknown:
        yield (
            ("lora_target_modules",),
            f"config key 'lora_target_modules': unknown module '{unknown[0]}' "
            f"(expected some of {', '.join(ALL_PROJECTIONS)})",
        )
    if not config.target_modules:
        yield ("lora_target_modules",), "config key 'lora_target_modules': expected at least one module"
    if config.adapter == "qlora" and not config.load_in_4bit:
        yield (
            ("adapter", "load_in_4bit"),
            "config key 'adapter': 'qlora' needs load_in_4bit: true (use adapter: lora)",
        )
    if config.gradient_checkpointing == "auto" and config.memory_budget_gb is None:
        yield (
            ("gradient_checkpointing", "memory_budget_gb"),
            "config key 'gradient_checkpointing': 'auto' needs memory_budget_gb",
        )
    for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        if getattr(config, per_epoch) is not None and getattr(config, steps) is not None:
            yield (
                (per_epoch, steps),
                f"config keys '{per_epoch}' and '{steps}' are both set: keep one of them",
            )
    if config.loss_watchdog_patience is not None and config.loss_watchdog_threshold is None:
        yield (
            ("loss_watchdog_patience", "loss_watchdog_threshold"),
            "config key 'loss_watchdog_patience' needs loss_watchdog_threshold (the loss that counts as too high)",
        )
    if config.resume_from_checkpoint is not None and config.auto_resume_from_checkpoints:
        yield (
            ("resume_from_checkpoint", "auto_resume_from_checkpoints"),
            "config keys 'resume_from_checkpoint' and 'auto_resume_from_checkpoints' are both set: keep one",
        )


def config_problems(problems: list[str]) -> QLoraError:
    """One error for all of a config's problems: one line each."""
    if len(problems) == 1:
        return QLoraError(problems[0])
    return QLoraError(f"the config has {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`key=value` from the command line; the value is read as YAML, so `lora_r=8` is an int."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise QLoraError(f"--set expects key=value, got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def apply_override(raw: dict, path: list[str], value: Any) -> None:
    """Set a (possibly dotted, e.g. datasets.0.path) key in the raw config mapping."""
    node: Any = raw
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise QLoraError(f"--set {'.'.join(path)}: no item {part} in '{'.'.join(path[:i])}'")
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise QLoraError(f"--set {'.'.join(path)}: '{'.'.join(path[: i + 1])}' is not a mapping")
    last = path[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise QLoraError(f"--set {'.'.join(path)}: no item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise QLoraError(f"config file {path} does not exist")
    if not path.is_file():
        raise QLoraError(f"config file {path} is not a file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise QLoraError(f"config file {path}: YAML syntax error{where}: {problem}") from None
    except UnicodeDecodeError:
        raise QLoraError(f"config file {path} is not UTF-8 text") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise QLoraError(f"config file {path}: expected a mapping of keys to values at the top level")
    return raw


def config_from_dict(raw: dict) -> TrainConfig:
    """A checked TrainConfig, or one QLoraError that lists every problem of `raw`."""
    translated = translate(raw)
    problems = list(translated.problems)
    failed: set[str] = set()
    config = _build(TrainConfig, translated.raw, problems, failed=failed)
    problems += [p for keys, p in _consistency_problems(config) if not failed.intersection(keys)]
    if problems:
        raise config_problems(problems)
    config.notes = translated.notes
    return config


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    raw = read_yaml(Path(path))
    for text in overrides:
        key_path, value = parse_override(text)
        apply_override(raw, key_path, value)
    return config_from_dict(raw)


def config_to_dict(config: TrainConfig) -> dict:
    """The config's keys and values, as saved beside a checkpoint (the notes are not a key)."""
    derived = {f.name for f in dataclasses.fields(config) if f.metadata.get("derived")}
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in derived}


def save_config(config: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False), encoding="utf-8")
