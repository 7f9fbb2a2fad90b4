"""The bottom layer: errors, the signal handlers every command starts with, files written so crashes lose
nothing, the names every layer shares, and the profiling hooks the model calls. Imports nothing of ours."""

from qlora_cli.core.errors import QLoraError, RunAborted, RunInterrupted, TrainingStopped, WriteFailed

__all__ = ["QLoraError", "RunAborted", "RunInterrupted", "TrainingStopped", "WriteFailed"]
