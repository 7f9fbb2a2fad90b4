"""Loading a config: YAML files, `--set key=value` overrides, Axolotl's keys translated first, and the
config saved beside each checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from qlora_cli.config.axolotl import translate
from qlora_cli.config.checks import build_config, config_problems, consistency_problems
from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError


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
            if node.get(part) is None:
                if path[i + 1].isdigit():
                    where = ".".join(path[: i + 1])
                    raise QLoraError(
                        f"--set {'.'.join(path)}: '{where}' is not set, so it has no item {path[i + 1]}"
                    )
                node[part] = {}
            node = node[part]
        else:
            raise QLoraError(f"--set {'.'.join(path)}: '{'.'.join(path[:i])}' is not a mapping")
    last = path[-1]
    if not isinstance(node, list | dict):
        raise QLoraError(f"--set {'.'.join(path)}: '{'.'.join(path[:-1])}' is not a mapping")
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise QLoraError(f"--set {'.'.join(path)}: no item {last} in '{'.'.join(path[:-1])}'")
        node[int(last)] = value
    else:
        node[last] = value


class _OnceLoader(yaml.SafeLoader):
    """YAML loaders keep the last of two equal keys without a word, so a key set twice (an edit that
    missed the first) would train on one value silently; here it is an error naming both lines."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` keys are meant to be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):  # the base class refuses keys that cannot be compared
                continue
            line = key_node.start_mark.line + 1
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    problem=f"{key!r} is set twice (lines {lines[key]} and {line}); keep one",
                    problem_mark=key_node.start_mark,
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict:
    if not path.exists():
        raise QLoraError(f"config file {path} does not exist")
    if not path.is_file():
        raise QLoraError(f"config file {path} is not a file")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_OnceLoader)
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
    config = build_config(TrainConfig, translated.raw, problems, failed=failed)
    problems += [p for keys, p in consistency_problems(config) if not failed.intersection(keys)]
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
