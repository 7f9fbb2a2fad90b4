"""The exceptions the CLI turns into a single line and a non-zero exit code."""


class QLoraError(Exception):
    """Bad input from the user: a config, a file, a model or a dataset we cannot use.

    The message is the whole story (what is wrong, where, and what was expected), so the
    CLI prints it alone, without a traceback.
    """

    exit_code = 2
    label = "error"  # how the CLI's line starts


class TrainingStopped(QLoraError):
    """The run stopped on its own data (a non-finite loss); the last good checkpoint is kept."""

    exit_code = 1


class RunInterrupted(QLoraError):
    """SIGINT or SIGTERM: the step finished and a checkpoint was written before exiting. The user asked
    for it, so the line reads `stopped:`, not `error:`; the exit code is still 128 + signal, as for
    any program that a signal ends."""

    label = "stopped"

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_code = 128 + signal_number


class WriteFailed(QLoraError):
    """The disk refused a write (full, read-only, gone): the message names the file and the reason.

    Nothing the user typed was wrong, so the exit code is 1, as for any other failed run; what was
    written before stays as it was.
    """

    exit_code = 1


class OutOfMemory(QLoraError):
    """A training step, an evaluation or a generation needed more GPU memory than there is: the message
    says where, at what shape and what to change. Nothing already written is lost, and the exit code is
    1, as for any other failed run."""

    exit_code = 1


class RunAborted(BaseException):
    """A signal that ends a command at once: before a run's first step, the third Ctrl-C, or any
    signal outside training. The message says what was kept.

    It is no Exception, so no `except Exception` on its way out swallows it, and no KeyboardInterrupt,
    which the CLI framework would turn into a silent exit.
    """

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_code = 128 + signal_number
