"""JSON Lines read with each row's location (file:line), so a bad row is named in one line."""

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


def json_lines(file: Path, text: str) -> Iterator[Row]:
    """Each non-blank line of a JSON Lines text as (where, object), where = 'file:line'."""
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise QLoraError(f"{where}: {json_error(error)}") from None
        if not isinstance(row, dict):
            raise QLoraError(f"{where}: expected a JSON object, got {json_type(row)}")
        yield where, row
