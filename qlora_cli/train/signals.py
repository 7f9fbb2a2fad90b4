"""Ctrl-C and SIGTERM during a run: counted, answered, and never silent.

Before the first step there is nothing new worth saving, so the first signal stops the run at once,
saying which checkpoints a resumed run keeps. From the first step on, the first signal lets the step
finish and a checkpoint be saved, and the run stops right after that save (one that comes during a save
stops the run after it, with no further step); the second says the save is being finished and asks for
patience; the third abandons the run and names the last complete checkpoint. Every one of these ends
with a line, and no signal ever interrupts a checkpoint halfway into a state that resume would pick
(qlora_cli/rundir/checkpoint.py).

Python runs a handler once for any number of signals that arrive while the main thread is busy in C
(a tensor write, an fsync), so the signals are counted from the wakeup pipe instead, which the
interpreter writes one byte a signal.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_cli.core.errors import RunAborted
from qlora_cli.core.signals import SIGNALS
from qlora_cli.rundir.folder import latest_checkpoint

if TYPE_CHECKING:
    from rich.console import Console


class StopSignals:
    """Installs the handlers for the length of a run; the loop reads `received` after each step and
    after each save."""

    def __init__(self, console: Console, output_dir: Path, resume_option: str = ""):
        self.console = console
        self.output_dir = Path(output_dir)
        self.resume_option = resume_option
        self.received: int | None = None
        self.count = 0
        self.step: int | None = None  # the optimizer step in progress (1-based); None before training
        self.phase = "step"  # "step": training `step`; "saving": its checkpoint; "closing": stopping after it
        self._calls = 0
        self._delivered = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._pipe = os.pipe()
        for end in self._pipe:
            os.set_blocking(end, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        for end in self._pipe:
            os.close(end)

    def training(self, step: int) -> None:
        """Optimizer step `step` (1-based) is under way: a first signal now waits for it and its save."""
        self.step, self.phase = step, "step"

    def saving_checkpoint(self) -> None:
        """The checkpoint of the current step is being written: a first signal now stops the run after it."""
        self.phase = "saving"

    def closing(self) -> None:
        """The run stops after the checkpoint of the current step, which is saved; trackers and files close."""
        self.phase = "closing"

    def _handle(self, signum: int, frame) -> None:
        """One call may stand for several signals: the wakeup pipe holds a byte for each delivered one
        (written just after the call is scheduled, so a call can also come before its byte)."""
        self._calls += 1
        delivered = [sig for sig in self._drain() if sig in SIGNALS]
        self._delivered += len(delivered)
        names = delivered or [signum]
        for index in range(max(self._calls, self._delivered) - self.count):
            self._answer(names[min(index, len(names) - 1)])

    def _drain(self) -> bytes:
        try:
            return os.read(self._pipe[0], 4096)
        except BlockingIOError:
            return b""

    def _answer(self, signum: int) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.step is None:
            raise RunAborted(f"{name} received before the first step; {self._unsaved()}", signum)
        doing, unsaved = {
            "step": (f"finishing step {self.step} and saving a checkpoint", " without saving"),
            "saving": (f"finishing the checkpoint of step {self.step}", " without saving"),
            "closing": (f"the checkpoint of step {self.step} is saved; closing the run", ""),
        }[self.phase]
        if self.count == 1:
            self.received = signum
            self.console.print(
                f"[yellow]{name} received:[/] {doing}, then stopping (two more {name} abort{unsaved})",
                highlight=False,
            )
        elif self.count == 2:
            self.console.print(
                f"[yellow]{name} received again:[/] {doing}; please wait, this takes a moment "
                f"(one more {name} aborts{unsaved})",
                highlight=False,
            )
        elif self.count == 3:
            raise RunAborted(self._abandoned(name), signum)

    def _last_kept(self) -> str | None:
        """The run's last complete checkpoint and how to continue from it; None when it has none."""
        last = latest_checkpoint(self.output_dir)
        if last is None:
            return None
        return (
            f"the last complete checkpoint is {last}; continue with "
            f"`qlora resume {self.output_dir}{self.resume_option}`"
        )

    def _unsaved(self) -> str:
        """What a stop before the first step leaves: a resumed run's folder still holds its checkpoints."""
        kept = self._last_kept()
        if kept is None:
            return "nothing was saved"
        return f"no new checkpoint was written, and the earlier ones are kept: {kept}"

    def _abandoned(self, name: str) -> str:
        kept = self._last_kept() or "no checkpoint was saved"
        during = {
            "step": f"during step {self.step} without saving it",
            "saving": f"while saving the checkpoint of step {self.step} without saving it",
            "closing": f"while closing the run, after saving the checkpoint of step {self.step}",
        }[self.phase]
        return f"{name} received three times: aborted {during}; {kept}"
