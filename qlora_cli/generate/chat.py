"""`qlora chat`: a multi-turn conversation with a trained model, its answer streamed as it is generated.

Each turn renders the whole conversation with the run's chat template and generates from it; the
conversation is kept within the run's sequence_len by dropping its oldest turns first, with a notice.
Lines starting with / are commands: /reset, /system TEXT, /exit (Ctrl-D too). Ctrl-C while an answer
streams stops that answer and returns to the prompt; Ctrl-C at the prompt ends the session.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
from typing import TextIO

from rich.console import Console
from rich.markup import escape

from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.text import text_problem
from qlora_cli.core.wording import number
from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.generate.prompts import check_text, with_system
from qlora_cli.generate.sampling import Sampling, generate_ids, sampling_problem, seeded_draws
from qlora_cli.generate.source import GenerationSource, load_source
from qlora_cli.sources.tokenizer import ChatTokenizer

HELP = (
    "/reset starts over (keeping the system message), /system TEXT sets the system message, "
    "/exit (or Ctrl-D) ends; Ctrl-C stops an answer"
)


class AnswerStopped(Exception):
    """Ctrl-C stopped the answer being streamed."""


class StopAnswer:
    """Ctrl-C while an answer streams: the first stops it before its next token, where the caches are
    whole (never inside a prefill or a CUDA graph capture); a second before then ends the session, as
    Ctrl-C at the prompt does."""

    def __enter__(self) -> StopAnswer:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame) -> None:
        if not self.requested:
            self.requested = True
        elif callable(self._previous):
            self._previous(signum, frame)
        else:
            signal.default_int_handler(signum, frame)

    def check(self) -> None:
        if self.requested:
            raise AnswerStopped


class TextStream:
    """Writes a turn's text as its tokens arrive; a token that ends inside a multi-byte character
    waits for the next one."""

    def __init__(self, tokenizer: ChatTokenizer, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.written = 0

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        self._write(text)
        self.out.write("\n")
        self.out.flush()
        return text

    def _write(self, text: str) -> None:
        self.out.write(text[self.written :])
        self.out.flush()
        self.written = len(text)


@dataclasses.dataclass
class Conversation:
    """The turns so far and the system message; renders itself into the prompt of the next answer."""

    source: GenerationSource
    system: str | None = None
    turns: list[dict] = dataclasses.field(default_factory=list)

    def prompt_ids(self, turns: list[dict] | None = None) -> list[int]:
        text = self.source.tokenizer.render_chat(
            with_system(self.turns if turns is None else turns, self.system),
            add_generation_prompt=True,
            **self.source.template_variables,
        )
        return self.source.tokenizer.encode(text)

    def fit(self, message: str, budget: int, reserve: int) -> tuple[list[int] | None, int]:
        """The prompt ids with `message` as the next user turn, after dropping the oldest turns until
        `reserve` answer tokens fit in `budget`; also how many turns were dropped. None when the message
        does not fit even alone, and then the conversation stays as it was."""
        turns = [*self.turns, {"role": "user", "content": message}]
        dropped = 0
        ids = self.prompt_ids(turns)
        while len(ids) + reserve > budget and len(turns) > 1:
            del turns[0]
            while turns[0]["role"] != "user":
                del turns[0]
            dropped += 1
            ids = self.prompt_ids(turns)
        if len(ids) >= budget:
            return None, 0
        self.turns = turns
        return ids, dropped


def chat(
    source,
    *,
    sampling: Sampling = Sampling(),
    base_only: bool = False,
    system: str | None = None,
    device: str = "auto",
    base_model: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    console: Console | None = None,
) -> None:
    """Read messages from stdin, one a line, and stream each answer to stdout."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    console = console or OutputConsole(stderr=True)
    if problem := sampling_problem(sampling):
        raise QLoraError(problem)
    if system is not None:
        check_text(system, "--system")
    if hasattr(stdin, "reconfigure"):
        # Bytes that are not UTF-8 come through as surrogates, for a line saying so, not a traceback.
        stdin.reconfigure(errors="surrogateescape")
    loaded = load_source(source, base_only=base_only, device=device, base_model=base_model)
    engine = DecodingEngine(loaded.model)
    draws = seeded_draws(sampling, engine.decoder.device)
    conversation = Conversation(loaded, system)
    budget = loaded.sequence_len
    reserve = min(sampling.max_new_tokens, budget // 2)
    for note in loaded.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    console.print(
        f"loaded {loaded.describe()} in {loaded.load_s:.1f}s", highlight=False, soft_wrap=True, markup=False
    )
    console.print(HELP, highlight=False)
    while True:
        console.print("[bold]>[/] ", end="")
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if problem := text_problem(text):
            console.print(f"(that line {problem}; send it again)", highlight=False, markup=False)
            continue
        command, _, argument = text.strip().partition(" ")
        if command == "/exit":
            break
        if command == "/reset":
            conversation.turns.clear()
            console.print("(conversation cleared)")
            continue
        if command == "/system":
            conversation.system = argument.strip() or None
            console.print("(system message set)" if conversation.system else "(system message removed)")
            continue
        if command.startswith("/"):
            console.print(f"(unknown command {command}; {HELP})", highlight=False, markup=False)
            continue
        if not text.strip():
            continue
        ids, dropped = conversation.fit(text, budget, reserve)
        if ids is None:
            console.print(f"(that message does not fit in sequence_len {number(budget)}; send a shorter one)")
            continue
        if dropped:
            turns = "the oldest turn" if dropped == 1 else f"the {number(dropped)} oldest turns"
            console.print(f"(dropped {turns} to stay within sequence_len {number(budget)})")
        stream = TextStream(loaded.tokenizer, stdout)
        answer = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget - len(ids)))
        try:
            with StopAnswer() as stop:
                on_token = functools.partial(_next, stop, stream)
                generate_ids(engine, [ids], answer, loaded.stop_ids, on_token=on_token, draws=draws)
        except AnswerStopped:
            _keep_stopped(conversation, stream.finish(), console)
            continue
        conversation.turns.append({"role": "assistant", "content": stream.finish()})


def _next(stop: StopAnswer, stream: TextStream, row: int, token: int) -> None:
    stop.check()
    stream(row, token)


def _keep_stopped(conversation: Conversation, text: str, console: Console) -> None:
    """A stopped answer stays in the conversation as far as it was shown, as chat apps keep one, so the
    next message can say what to do instead; one stopped before its first token takes its message
    with it."""
    if text.strip():
        conversation.turns.append({"role": "assistant", "content": text})
        console.print("(answer stopped; the part shown stays in the conversation)")
    else:
        conversation.turns.pop()
        console.print("(answer stopped before it began; your message is dropped)")
