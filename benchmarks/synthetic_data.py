"""Write a learnable synthetic dataset (reverse a list of words) for long GPU runs on random weights.

Usage: python -m benchmarks.synthetic_data OUT.jsonl [--rows 20000] [--seed 0]

Each row is a `completion` example: the prompt lists 8 to 40 words drawn from 64, the completion
is the same words reversed. A model that learns nothing scores ln(vocab) per token; one that
learns the 64-word vocabulary about ln(64) = 4.2; one that learns to reverse, far less. The rows
pack into full 2048-token sequences, so every micro-batch has the same shape.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ro", "sa", "tu")
    for b in ("b", "d", "f", "g", "k", "m", "p", "t")
]


def write_rows(out: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for _ in range(rows):
            words = rng.choices(WORDS, k=rng.randint(8, 40))
            row = {"prompt": "reverse: " + " ".join(words) + "\n", "completion": " ".join(reversed(words))}
            f.write(json.dumps(row) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_rows(args.out, args.rows, args.seed))


if __name__ == "__main__":
    main()
