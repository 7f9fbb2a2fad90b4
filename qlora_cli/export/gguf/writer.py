"""One GGUF file of a merged model, the format llama.cpp, Ollama and LM Studio run.

GGUF declares every tensor (name, shape, type, offset) before the data, so the header is written from
the shapes config.json implies, and the data then tensor by tensor as the merged weights stream past:
host memory stays near one tensor. Names and metadata keys are llama.cpp's for its 'qwen2' and 'qwen3'
architectures, taken from the gguf package (TensorNameMap, the writer's add_* keys). Qwen's Q and K
projections keep Hugging Face's row order: llama.cpp applies NeoX-style RoPE to these architectures, as
transformers does, so unlike Llama's there is nothing to permute.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.gguf.vocab import PRE_TOKENIZER, TOKENIZER_MODEL, Vocabulary
from qlora_cli.sources.weights import ModelSpec

GGUF_TYPES = ("bf16", "f16", "q8_0")
DEFAULT_GGUF_TYPE = "bf16"


def import_gguf():
    """The gguf package, or one line naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise QLoraError("--gguf needs the gguf package: pip install 'qlora-cli[gguf]'") from None
    return gguf


def check_gguf_type(gguf_type: str) -> str:
    if gguf_type not in GGUF_TYPES:
        raise QLoraError(f"--gguf-type: expected one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    return gguf_type


def storage_type(gguf, shape: tuple[int, ...], gguf_type: str):
    """How one tensor is stored: vectors (norms, biases) in f32 as llama.cpp's converter keeps them; q8_0
    where rows split into whole 32-value blocks, else f16."""
    kinds = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return kinds.F32
    if gguf_type == "q8_0":
        block, _ = gguf.GGML_QUANT_SIZES[kinds.Q8_0]
        return kinds.Q8_0 if shape[-1] % block == 0 else kinds.F16
    return kinds.BF16 if gguf_type == "bf16" else kinds.F16


def encode(gguf, tensor: torch.Tensor, kind) -> np.ndarray:
    """The tensor's bytes as GGUF stores them (bf16 rounds as torch does, so a bf16 GGUF holds exactly
    the --merged bf16 export's weights)."""
    kinds = gguf.GGMLQuantizationType
    if kind == kinds.Q8_0:
        return gguf.quants.quantize(tensor.float().numpy(), kinds.Q8_0)
    dtype = {kinds.F32: torch.float32, kinds.F16: torch.float16, kinds.BF16: torch.bfloat16}[kind]
    return tensor.to(dtype).contiguous().view(torch.uint8).numpy()


def _file_type(gguf, gguf_type: str) -> int:
    types = gguf.LlamaFileType
    return {"bf16": types.MOSTLY_BF16, "f16": types.MOSTLY_F16, "q8_0": types.MOSTLY_Q8_0}[gguf_type]


def _add_metadata(writer, gguf, spec: ModelSpec, gguf_type: str, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(_file_type(gguf, gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)


def _add_vocabulary(writer, vocabulary: Vocabulary) -> None:
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_eos_token_id(vocabulary.eos_id)
    writer.add_pad_token_id(vocabulary.pad_id)
    if vocabulary.bos_id is not None:
        writer.add_bos_token_id(vocabulary.bos_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)


def write_gguf(
    path: Path,
    spec: ModelSpec,
    names: list[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    vocabulary: Vocabulary,
    gguf_type: str,
    model_name: str,
) -> None:
    """Write `tensors` (Hugging Face names, arriving in the order of `names`) as one GGUF file."""
    gguf = import_gguf()
    arch = gguf.MODEL_ARCH.QWEN2 if spec.model_type == "qwen2" else gguf.MODEL_ARCH.QWEN3
    name_map = gguf.TensorNameMap(arch, spec.num_layers)
    shapes = spec.expected_tensors()
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, gguf, spec, gguf_type, model_name)
    _add_vocabulary(writer, vocabulary)
    kinds = {}
    for name in names:
        kinds[name] = storage_type(gguf, shapes[name], gguf_type)
        byte_shape = gguf.quant_shape_to_byte_shape(shapes[name], kinds[name])
        writer.add_tensor_info(
            name_map.get_name(name, try_suffixes=(".weight", ".bias")),
            byte_shape,
            np.dtype(np.uint8),
            math.prod(byte_shape),
            raw_dtype=kinds[name],
        )
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for expected, (name, tensor) in zip(names, tensors, strict=True):
            if name != expected:
                raise RuntimeError(f"GGUF data out of order: got {name}, declared {expected}")
            writer.write_tensor_data(encode(gguf, tensor, kinds[name]))
    finally:
        writer.close()
