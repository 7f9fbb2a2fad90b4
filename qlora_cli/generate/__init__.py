"""qlora generate and qlora chat: a run's model and tokenizer, the KV cache and decode step, sampling.
Imports qlora_kernels and qlora_cli's core, config, sources, model and rundir."""

from qlora_cli.generate.chat import chat
from qlora_cli.generate.command import generate

__all__ = ["chat", "generate"]
