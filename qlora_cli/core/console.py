"""The console every command prints through: on a terminal it wraps as rich does; into a file or a pipe
(a job log, `| tee`, `2> err.txt`) no line is broken and every table keeps its natural width, so each
message stays one line that grep finds whole."""

from __future__ import annotations

import os
import sys

from rich.console import Console, ConsoleDimensions
from rich.rule import Rule

# Wider than any line or table a command prints: off a terminal, nothing reaches the edge and wraps.
UNWRAPPED_WIDTH = 1_000_000


class OutputConsole(Console):
    """rich's Console, as wide as its output when its file is no terminal (whatever FORCE_COLOR says:
    colour is rich's choice, but a log file has no edge to wrap at)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        if self.is_jupyter or self.on_terminal:
            return size
        return ConsoleDimensions(UNWRAPPED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)

    @property
    def on_terminal(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed file
            return False

    def rule(self, title="", **options) -> None:
        """A rule has no natural width; off a terminal it spans the width rich would have wrapped at."""
        self.print(Rule(title, **options), width=Console.size.fget(self).width)


class _PipeSafeStream:
    """A standard stream whose reader may go away (`| head`, a closed terminal): from the first write that
    finds the pipe closed, its descriptor points at /dev/null, so the command goes on (a run trains,
    saves and logs to train.log) and exits as it would have, with no traceback at the write or at exit."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_null()

    def _to_null(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_pipes() -> None:
    """stdout and stderr keep working, writing nowhere, once their reader has closed the pipe."""
    if not isinstance(sys.stdout, _PipeSafeStream):
        sys.stdout = _PipeSafeStream(sys.stdout)
    if not isinstance(sys.stderr, _PipeSafeStream):
        sys.stderr = _PipeSafeStream(sys.stderr)
