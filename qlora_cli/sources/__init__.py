"""Where a run's inputs come from: hub snapshots or local folders, config.json as a ModelSpec, streamed
safetensors, the tokenizer and the chat templates. Imports qlora_cli.core and qlora_cli.config."""

from qlora_cli.sources.hub import resolve_dataset, resolve_model, resolve_tokenizer
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.weights import stream_tensors

__all__ = [
    "ChatTokenizer",
    "ModelSpec",
    "read_spec",
    "resolve_dataset",
    "resolve_model",
    "resolve_tokenizer",
    "stream_tensors",
]
