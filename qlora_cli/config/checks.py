"""A raw config mapping checked into a TrainConfig: types, ranges, the closest known key for an unknown one,
and the rules among keys. Every problem of a config is collected and reported in one error; null means
the default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from qlora_cli.config.schema import InstructionFormat, TrainConfig, expert_parameter
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import (
    ALL_PROJECTIONS,
    CHAT_TEMPLATE_NAMES,
    COMMON_TYPES,
    DATASET_TYPES,
    EXPERT_PARAMETERS,
    FALLBACK_TEMPLATE,
    ROUTED_EXPERT_TARGETS,
    SHIPPED_TEMPLATES,
)
from qlora_cli.core.wording import number


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        element = typing.get_args(tp)[0]
        plural = {int: "integers", float: "numbers", str: "strings"}.get(element)
        return f"a list of {plural}" if plural else f"a list, each {_type_name(element)}"
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
        built = build_config(tp, value, problems, prefix=f"{where}.")
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
    left = "" if lo is None else f"{'>' if lo_open else '>='} {number(lo)}"
    right = "" if hi is None else f"{'<' if hi_open else '<='} {number(hi)}"
    expected = " and ".join(p for p in (left, right) if p)
    return f"config key '{name}': expected a value {expected}, got {value!r}"


def build_config(
    cls: type, raw: dict, problems: list[str], prefix: str = "", failed: set | None = None
) -> Any:
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


def _format_problem(form: InstructionFormat) -> str | None:
    for key in ("system_format", "format", "no_input_format"):
        text = getattr(form, key)
        try:
            if text is not None:
                text.format(system="s", instruction="i", input="n")
        except (KeyError, IndexError, ValueError, AttributeError) as error:
            return (
                f"type.{key} {text!r} is not a format string with {{system}}, {{instruction}} or {{input}} "
                f"({type(error).__name__}: {error}); double other braces: {{{{ }}}}"
            )
    return None


def type_problem(name: str | InstructionFormat) -> str | None:
    """Why a dataset `type` cannot be read, naming what to use instead; None when it can."""
    if not isinstance(name, str):
        return _format_problem(name)
    if name in DATASET_TYPES:
        return None
    return (
        f"type '{name}' is not a dataset format qlora reads; convert the data to one of {COMMON_TYPES} "
        "(chat_template reads messages or ShareGPT conversations)"
    )


def looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def template_problem(name: str | None, jinja: str | None) -> str | None:
    """Why `chat_template` / `chat_template_jinja` cannot be honoured, or None. Whether the tokenizer can
    write a shipped template's turns is for its vocabulary to say (sources.chat_templates)."""
    if name == "jinja" and not jinja:
        return "config key 'chat_template': 'jinja' needs the template in chat_template_jinja"
    if jinja is not None and name not in (None, "jinja"):
        return f"config key 'chat_template_jinja' is set, so chat_template must be 'jinja' or left out, not '{name}'"
    if name is None or name in CHAT_TEMPLATE_NAMES or looks_like_jinja(name):
        return None
    if name.startswith(FALLBACK_TEMPLATE) and name.removeprefix(FALLBACK_TEMPLATE) in SHIPPED_TEMPLATES:
        return None
    return (
        f"config key 'chat_template': '{name}' is not a chat template qlora ships; use one of "
        f"{', '.join(CHAT_TEMPLATE_NAMES)}, or put a template in chat_template_jinja"
    )


def _dataset_problems(config: TrainConfig) -> list[str]:
    """What in the dataset keys cannot be honoured: unknown types, chat templates, conflicting keys."""
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


def consistency_problems(config: TrainConfig) -> typing.Iterator[tuple[tuple[str, ...], str]]:
    """(the keys it concerns, the problem) for each rule among keys that holds no more."""
    if not config.datasets:
        yield ("datasets",), "config key 'datasets': expected at least one dataset"
    for problem in _dataset_problems(config):
        yield (), problem
    # The names given are checked with lora_target_linear too, which adds every projection to them.
    named = [*config.lora_target_modules, *config.target_modules]
    unknown = sorted(set(named) - set(ALL_PROJECTIONS))
    experts = [name for name in named if name in ROUTED_EXPERT_TARGETS]
    if experts:
        yield (
            ("lora_target_modules",),
            f"config key 'lora_target_modules': '{experts[0]}' names a MoE model's routed experts, which "
            "take LoRA through lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]",
        )
    elif unknown:
        yield (
            ("lora_target_modules",),
            f"config key 'lora_target_modules': unknown module '{unknown[0]}' "
            f"(expected some of {', '.join(ALL_PROJECTIONS)})",
        )
    if not config.target_modules:
        yield ("lora_target_modules",), "config key 'lora_target_modules': expected at least one module"
    for value in config.lora_target_parameters:
        if expert_parameter(value) is None:
            yield (
                ("lora_target_parameters",),
                f"config key 'lora_target_parameters': '{value}' is not a routed experts' parameter "
                f"(expected {' or '.join(f'mlp.experts.{name}' for name in EXPERT_PARAMETERS)})",
            )
            break
    if config.lora_target_parameters and config.lora_dropout:
        yield (
            ("lora_target_parameters", "lora_dropout"),
            "config keys 'lora_target_parameters' and 'lora_dropout': PEFT's LoRA on routed experts takes "
            "no dropout; set lora_dropout: 0",
        )
    if config.adapter == "qlora" and not config.load_in_4bit:
        yield (
            ("adapter", "load_in_4bit"),
            "config key 'adapter': 'qlora' needs load_in_4bit: true (use adapter: lora)",
        )
    if config.fp8 and not config.load_in_4bit:
        yield (
            ("fp8", "load_in_4bit"),
            "config key 'fp8': it multiplies the NF4 base in FP8, so it needs load_in_4bit: true",
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
    if config.warmup_steps is not None and config.warmup_ratio > 0:
        yield (
            ("warmup_steps", "warmup_ratio"),
            "config keys 'warmup_steps' and 'warmup_ratio' are both set (warmup_steps would win without a "
            "word, as Axolotl refuses): keep one of them",
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
