"""`qlora generate`: complete prompts with a trained model; completions to stdout, one row per prompt to
--out, progress and speed to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

import torch
from rich.console import Console
from rich.markup import escape

from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import OutOfMemory, QLoraError, WriteFailed
from qlora_cli.core.files import check_writable, reason, temp_beside
from qlora_cli.core.wording import count, number
from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.generate.prompts import Prompt, check_fits, check_text, gather_prompts, render_prompt
from qlora_cli.generate.sampling import Sampling, Timing, generate_ids, sampling_problem, seeded_draws
from qlora_cli.generate.source import GenerationSource, load_source
from qlora_cli.sources.run_tokenizer import check_token_id


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
    base_model: str | None = None,
    stdout: TextIO | None = None,
    console: Console | None = None,
) -> list[dict]:
    """Complete every prompt; returns the rows written to `out` (prompt, completion, token counts)."""
    stdout = stdout or sys.stdout
    console = console or OutputConsole(stderr=True)
    if problem := sampling_problem(sampling):
        raise QLoraError(problem)
    if raw and system is not None:
        raise QLoraError("--system needs the chat template; drop --raw")
    if system is not None:
        check_text(system, "--system")
    if batch_size < 1:
        raise QLoraError(f"--batch-size must be at least 1, got {batch_size}")
    if out is not None and prompt_file is not None and Path(out).resolve() == Path(prompt_file).resolve():
        raise QLoraError(
            f"--out {out} is the --prompts file, which the answers would replace; write them elsewhere"
        )
    given = gather_prompts(list(prompts), prompt_file)
    with _RowWriter(out) as writer:
        loaded = load_source(source, base_only=base_only, device=device, base_model=base_model)
        ids = [_prompt_ids(loaded, prompt, raw, system, console) for prompt in given]
        for note in loaded.notes:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
        console.print(
            f"loaded {loaded.describe()} in {loaded.load_s:.1f}s",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
        engine = DecodingEngine(loaded.model)
        timing = Timing()
        draws = seeded_draws(sampling, engine.decoder.device)
        rows = []
        for start in range(0, len(given), batch_size):
            batch = ids[start : start + batch_size]
            try:
                completions = generate_ids(
                    engine, batch, sampling, loaded.stop_ids, timing=timing, draws=draws
                )
            except torch.OutOfMemoryError:
                raise OutOfMemory(
                    _out_of_memory(start, batch, len(given), batch_size, sampling, out, writer.rows)
                ) from None
            for prompt, prompt_ids, completion in zip(
                given[start : start + batch_size], batch, completions, strict=True
            ):
                text = loaded.tokenizer.decode(completion.ids)
                stdout.write(text + "\n")
                stdout.flush()
                row = {
                    **prompt.record(),
                    **({} if system is None else {"system": system}),
                    "completion": text,
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(completion.ids),
                    "finish_reason": completion.finish,
                }
                writer.write(row)
                rows.append(row)
    total = timing.prefill_s + timing.decode_s
    steps = timing.decode_steps / timing.decode_s if timing.decode_s else 0.0
    speed = timing.tokens / total if total else 0.0
    console.print(
        f"{count(len(rows), 'prompt')}, {count(timing.tokens, 'token')} in {total:.2f}s "
        f"({speed:.1f} tokens/s): first token after {timing.prefill_s:.2f}s, "
        f"then {steps:.1f} decode steps/s",
        highlight=False,
        soft_wrap=True,
    )
    return rows


def _out_of_memory(
    start: int, batch: list, prompts: int, batch_size: int, sampling: Sampling, out: Path | None, written: int
) -> str:
    """Which prompts ran out, how long they are, what to change, and what --out already holds."""
    longest = max(len(prompt_ids) for prompt_ids in batch)
    line = (
        f"out of GPU memory generating prompts {start + 1} to {start + len(batch)} of {prompts} "
        f"(the longest {count(longest, 'token')}, up to {sampling.max_new_tokens} new): lower "
        f"--batch-size (now {batch_size}) or --max-new-tokens"
    )
    return line + (
        f"; {out} holds the {count(written, 'row')} done before" if out is not None and written else ""
    )


def _prompt_ids(
    loaded: GenerationSource, prompt: Prompt, raw: bool, system: str | None, console
) -> list[int]:
    """The prompt's token ids, refused when they leave the model no room to answer or hold an id its
    embedding lacks, with a note when they are longer than the rows the run trained on."""
    ids = render_prompt(prompt, loaded.tokenizer, raw=raw, system=system, variables=loaded.template_variables)
    check_fits(prompt, ids, loaded.model.spec.max_position_embeddings)
    check_token_id(loaded.tokenizer, loaded.model.spec.vocab_size, max(ids), f"{prompt.where}: its token id")
    if len(ids) > loaded.sequence_len:
        console.print(
            f"note: {prompt.where} is {count(len(ids), 'token')}, longer than the rows the run trained on "
            f"(sequence_len {number(loaded.sequence_len)})",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    return ids


class _RowWriter:
    """--out, checked before the model loads (a path that cannot be written fails at once, not after the
    decoding). Rows go to a hidden file beside it as each batch finishes, renamed to --out when the
    command ends: a refusal before the first row leaves --out as it was, never empty; a failure later
    keeps the rows done."""

    def __init__(self, path: Path | None):
        self.path = None if path is None else Path(path)
        self.temp = None if path is None else temp_beside(self.path)
        self.file = None
        self.rows = 0

    def __enter__(self) -> _RowWriter:
        if self.path is not None:
            try:
                check_writable(self.path)
                self.file = self.temp.open("w", encoding="utf-8")
            except OSError as err:
                raise QLoraError(f"cannot write --out {self.path}: {reason(err, self.path)}") from None
        return self

    def write(self, row: dict) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.file.flush()
        except OSError as err:
            raise WriteFailed(f"could not write --out {self.path}: {reason(err, self.path)}") from None
        self.rows += 1

    def __exit__(self, kind, error, tb) -> None:
        if self.file is None:
            return
        try:
            self.file.close()
            if error is None or self.rows:
                self.temp.replace(self.path)
        except OSError as err:
            if error is None:
                raise WriteFailed(f"could not write --out {self.path}: {reason(err, self.path)}") from None
        finally:
            self.temp.unlink(missing_ok=True)
