"""`qlora generate`: complete prompts with a trained model; completions to stdout, one row per prompt to
--out, progress and speed to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from rich.console import Console

from qlora_cli.decoding import DecodingEngine
from qlora_cli.errors import QLoraError, WriteFailed
from qlora_cli.files import describe
from qlora_cli.generation import Sampling, Timing, generate_ids, sampling_problem
from qlora_cli.generation_source import load_source
from qlora_cli.prompt_inputs import check_fits, gather_prompts, render_prompt


def generate(
    source: Path,
    *,
    prompts: list[str] = (),
    prompt_file: Path | None = None,
    out: Path | None = None,
    sampling: Sampling = Sampling(),
    base_only: bool = False,
    raw: bool = False,
    system: str | None = None,
    batch_size: int = 16,
    device: str = "auto",
    stdout: TextIO | None = None,
    console: Console | None = None,
) -> list[dict]:
    """Complete every prompt; returns the rows written to `out` (prompt, completion, token counts)."""
    stdout = stdout or sys.stdout
    console = console or Console(stderr=True)
    if problem := sampling_problem(sampling):
        raise QLoraError(problem)
    if raw and system is not None:
        raise QLoraError("--system needs the chat template; drop --raw")
    if batch_size < 1:
        raise QLoraError(f"--batch-size must be at least 1, got {batch_size}")
    given = gather_prompts(list(prompts), prompt_file)
    loaded = load_source(source, base_only=base_only, device=device)
    tokenizer, context = loaded.tokenizer, loaded.model.spec.max_position_embeddings
    ids = []
    for prompt in given:
        prompt_ids = render_prompt(
            prompt, tokenizer, raw=raw, system=system, variables=loaded.template_variables
        )
        check_fits(prompt, prompt_ids, context)
        if len(prompt_ids) > loaded.config.sequence_len:
            console.print(
                f"note: {prompt.where} is {len(prompt_ids)} tokens, longer than the rows the run trained on "
                f"(sequence_len {loaded.config.sequence_len})",
                highlight=False,
                soft_wrap=True,
            )
        ids.append(prompt_ids)
    console.print(f"loaded {loaded.describe()} in {loaded.load_s:.1f}s", highlight=False, soft_wrap=True)
    engine = DecodingEngine(loaded.model)
    timing = Timing()
    rows = []
    for start in range(0, len(given), batch_size):
        batch = ids[start : start + batch_size]
        for prompt, prompt_ids, completion in zip(
            given[start : start + batch_size],
            batch,
            generate_ids(engine, batch, sampling, loaded.stop_ids, timing=timing),
            strict=True,
        ):
            text = tokenizer.decode(completion.ids)
            stdout.write(text + "\n")
            stdout.flush()
            rows.append(
                {
                    **prompt.record(),
                    "completion": text,
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(completion.ids),
                    "finish_reason": completion.finish,
                }
            )
    total = timing.prefill_s + timing.decode_s
    steps = timing.decode_steps / timing.decode_s if timing.decode_s else 0.0
    console.print(
        f"{len(rows)} prompts, {timing.tokens} tokens in {total:.2f}s ({timing.tokens / total:.1f} tokens/s): "
        f"first token after {timing.prefill_s:.2f}s, then {steps:.1f} decode steps/s",
        highlight=False,
        soft_wrap=True,
    )
    if out is not None:
        _write_rows(Path(out), rows)
    return rows


def _write_rows(path: Path, rows: list[dict]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row, ensure_ascii=False) + "\n")
    except OSError as err:
        raise WriteFailed(f"could not write --out {path}: {describe(err, path)}") from None
