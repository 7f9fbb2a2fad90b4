"""Write a learnable synthetic dataset (reverse a list of words) for long GPU runs on random weights.

Usage: python -m benchmarks.synthetic_data OUT.jsonl [--rows 20000] [--seed 0]

Each row is a `completion` example: the prompt lists 8 to 40 words drawn from 64, the completion
is the same words reversed. A model that learns nothing scores ln(vocab) per token; one that
learns the 64-word vocabulary about ln(64) = 4.2; one that learns to reverse, far less. The rows
pack into full 2048-token sequences, so every micro-batch has the same shape.
"""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.rows import rows_command, write_jsonl

WORDS = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ro", "sa", "tu")
    for b in ("b", "d", "f", "g", "k", "m", "p", "t")
]


def write_rows(out: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)

    def row() -> dict:
        words = rng.choices(WORDS, k=rng.randint(8, 40))
        return {"prompt": "reverse: " + " ".join(words) + "\n", "completion": " ".join(reversed(words))}

    return write_jsonl(out, (row() for _ in range(rows)))


def main() -> None:
    rows_command(__doc__.splitlines()[0], write_rows)


if __name__ == "__main__":
    main()
