"""What the dataset writers (benchmarks.synthetic_data, benchmarks.alpaca_shaped) share: a JSONL file
of rows, and the command line `OUT.jsonl [--rows N] [--seed S]` that writes one."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path


def write_jsonl(out: Path, rows: Iterable[dict]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return out


def rows_command(description: str, write_rows: Callable[[Path, int, int], Path]) -> None:
    """Parse the command line and print the file `write_rows(out, rows, seed)` wrote."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_rows(args.out, args.rows, args.seed))
