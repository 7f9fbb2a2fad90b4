"""Write rows shaped like Alpaca's (instruction, input, output), for end-to-end runs without a download.

Usage: python -m benchmarks.alpaca_shaped OUT.jsonl [--rows 20000] [--seed 0]

What a benchmark needs from Alpaca is its shape, not its words: field lengths drawn from lognormal
distributions (median instruction 12 words, output 60 words with a long tail; 40 % of rows carry an
input of median 18 words), so packed rows hold documents of the many lengths a real instruction set
gives. Words come from a fixed list of common English words, so a tokenizer splits them as it would
prose. The same seed writes the same rows.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from benchmarks.rows import rows_command, write_jsonl

COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there one all we their been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go "
    "came right used take three explain write list describe summarize generate answer question "
    "example following sentence paragraph text data number function value result provide give "
    "create compare identify reason simple important different common small large water energy "
    "system process change health student"
)
WORDS = COMMON_WORDS.split()

# (median words, sigma of the log, cap): lognormal lengths as Alpaca's fields have them.
INSTRUCTION = (12, 0.5, 120)
INPUT = (18, 0.9, 400)
OUTPUT = (60, 1.0, 1200)
INPUT_SHARE = 0.4


def _length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def _text(rng: random.Random, shape: tuple[int, float, int]) -> str:
    words = rng.choices(WORDS, k=_length(rng, *shape))
    return " ".join(words).capitalize() + "."


def alpaca_rows(rows: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "instruction": _text(rng, INSTRUCTION),
            "input": _text(rng, INPUT) if rng.random() < INPUT_SHARE else "",
            "output": _text(rng, OUTPUT),
        }
        for _ in range(rows)
    ]


def write_rows(out: Path, rows: int, seed: int = 0) -> Path:
    return write_jsonl(out, alpaca_rows(rows, seed))


def main() -> None:
    rows_command(__doc__.splitlines()[0], write_rows)


if __name__ == "__main__":
    main()
