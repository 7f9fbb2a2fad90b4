"""A run's adapter as a PEFT adapter, a merged model or a GGUF file with an Ollama Modelfile.
Imports qlora_kernels and qlora_cli's core, config, sources, model and rundir."""

from qlora_cli.export.command import ExportResult, export

__all__ = ["ExportResult", "export"]
