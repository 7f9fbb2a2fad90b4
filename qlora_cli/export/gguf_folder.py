"""A GGUF export's folder: the merged weights as one GGUF file for llama.cpp, Ollama and LM Studio, with
an Ollama Modelfile beside it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from qlora_cli.config.schema import TrainConfig
from qlora_cli.export.gguf.ollama import modelfile
from qlora_cli.export.gguf.vocab import read_vocabulary
from qlora_cli.export.gguf.writer import write_gguf
from qlora_cli.export.merge import Merge, merged_tensors
from qlora_cli.export.tokenizer_files import write_tokenizer
from qlora_cli.sources.hf_files import MODEL_CONFIG
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.weights import locate_tensors


def _bos_token_id(base_folder: Path) -> int | None:
    value = json.loads((base_folder / MODEL_CONFIG).read_text(encoding="utf-8")).get("bos_token_id")
    return value if isinstance(value, int) else None


def write_gguf_folder(folder: Path, config: TrainConfig, merge: Merge, gguf_type: str) -> str:
    """The merged weights as one GGUF file, with an Ollama Modelfile beside it; returns the file's name.

    The tokenizer files the other exports carry go to a scratch folder first, so that the GGUF holds the
    run's chat template and special tokens exactly as they would; they are not left in the export.
    """
    base_folder, spec = merge.base_folder, merge.spec
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        write_tokenizer(config, base_folder, Path(scratch))
        tokenizer = ChatTokenizer.from_folder(scratch)
        vocabulary = read_vocabulary(Path(scratch), tokenizer, spec.vocab_size, _bos_token_id(base_folder))
    name = f"model-{gguf_type}.gguf"
    names = locate_tensors(base_folder, spec).names
    model_name = config.base_model.rstrip("/").rsplit("/", 1)[-1] + "-qlora"
    tensors = merged_tensors(merge)
    write_gguf(folder / name, spec, names, tensors, vocabulary, gguf_type, model_name)
    (folder / "Modelfile").write_text(
        modelfile(name, tokenizer, dict(config.chat_template_kwargs)), encoding="utf-8"
    )
    return name
