"""How every command answers Ctrl-C and SIGTERM outside a training loop: a line, never a traceback.

It sits at the bottom, importing nothing heavy, so that the CLI installs it before torch loads: a Ctrl-C
in the second a command spends importing is answered too (qlora_cli/train/signals.py takes over for a
run's steps).
"""

from __future__ import annotations

import signal

from qlora_cli.core.errors import RunAborted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_at_once(signum: int, frame) -> None:
    """The handler outside a training loop: there is nothing to finish, so stop, with a line."""
    raise RunAborted(f"{signal.Signals(signum).name} received; stopped", signum)


def answer_signals() -> None:
    """Every command answers SIGINT and SIGTERM with a line (qlora_cli/cli.py installs this first)."""
    for sig in SIGNALS:
        signal.signal(sig, stop_at_once)


def ignore_signals() -> None:
    """Once a command has its last line to print, a late Ctrl-C must not cut it off or kill the exit."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
