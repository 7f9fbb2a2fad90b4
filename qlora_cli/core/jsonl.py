"""JSON Lines read with each row's location (file:line), so a bad row is named in one line, and the rule
every JSON row is read under: a key at most once in each object."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qlora_cli.core.errors import QLoraError

Row = tuple[str, dict]


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def json_error(error: json.JSONDecodeError) -> str:
    """Python's reason with the column: "Unterminated string starting at: column 7", as json says it."""
    return f"not valid JSON ({error.msg}: column {error.colno})"


class RepeatedKey(Exception):
    """A key set twice in one JSON object; `key` names it."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def first_repeated(names: list[str]) -> str | None:
    """The first name that comes twice in `names`, or None."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: json keeps the last of two equal keys without a word, so a row with a key
    set twice (an edit that missed the first) would train on one of its values silently."""
    row = dict(pairs)
    if len(row) < len(pairs):
        raise RepeatedKey(first_repeated([key for key, _ in pairs]))
    return row


def repeated_key(where: str, error: RepeatedKey) -> QLoraError:
    return QLoraError(f"{where}: key {error.key!r} is set twice in one object; keep one")


def json_lines(file: Path, text: str) -> Iterator[Row]:
    """Each non-blank line of a JSON Lines text as (where, object), where = 'file:line'."""
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{line_number}"
        try:
            row = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as error:
            raise QLoraError(f"{where}: {json_error(error)}") from None
        except RepeatedKey as error:
            raise repeated_key(where, error) from None
        if not isinstance(row, dict):
            raise QLoraError(f"{where}: expected a JSON object, got {json_type(row)}")
        yield where, row
