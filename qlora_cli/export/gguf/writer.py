"""One GGUF file of a merged model, the format llama.cpp, Ollama and LM Studio run.

GGUF declares every tensor (name, shape, type, offset) before the data, so the header is written from
the shapes config.json implies, and the data then tensor by tensor as the merged weights stream past:
host memory stays near one tensor, or one layer's routed experts, which llama.cpp holds as one tensor
per projection (parts.py). Names and metadata keys are llama.cpp's for the family's
architecture (qlora_cli/export/gguf/architectures.py), taken from the gguf package (TensorNameMap, the
writer's add_* keys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.gguf.architectures import Architecture, architecture
from qlora_cli.export.gguf.parts import assemble, whole_shapes
from qlora_cli.export.gguf.vocab import TOKENIZER_MODEL, Vocabulary
from qlora_cli.sources.spec import ModelSpec

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


def storage_type(gguf, shape: tuple[int, ...], gguf_type: str, keep_f32: bool = False):
    """How one tensor is stored: vectors (norms, biases) and what the architecture keeps so in f32, as
    llama.cpp's converter does; q8_0 where rows split into whole 32-value blocks, else f16."""
    kinds = gguf.GGMLQuantizationType
    if len(shape) == 1 or keep_f32:
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
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)


def _add_vocabulary(writer, vocabulary: Vocabulary) -> None:
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(vocabulary.pre_tokenizer)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_eos_token_id(vocabulary.eos_id)
    writer.add_pad_token_id(vocabulary.pad_id)
    if vocabulary.bos_id is not None:
        writer.add_bos_token_id(vocabulary.bos_id)
    if vocabulary.eot_id is not None:
        writer.add_eot_token_id(vocabulary.eot_id)
    writer.add_add_bos_token(vocabulary.add_bos)
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
    """Write `tensors` (Hugging Face names, arriving in the order of `names`) as one GGUF file, each
    part of a whole tensor in its whole."""
    gguf = import_gguf()
    family = architecture(spec)
    arch = getattr(gguf.MODEL_ARCH, family.arch, None)
    if arch is None:
        raise QLoraError(
            f"--gguf: the installed gguf package does not know llama.cpp's {family.arch.lower()} "
            "architecture; pip install 'gguf>=0.18'"
        )
    name_map = gguf.TensorNameMap(arch, spec.num_layers)
    wholes = whole_shapes(names, spec.expected_tensors(), family.part_of)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, gguf, spec, gguf_type, model_name)
    family.add_metadata(writer, gguf)
    _add_vocabulary(writer, vocabulary)
    extra = family.extra_tensors()
    declared = [(gguf_name, tuple(tensor.shape), True) for gguf_name, tensor in extra.items()]
    declared += [
        (_gguf_name(name_map, family, name), family.shape(name, shape), family.keeps_f32(name))
        for name, shape in wholes.items()
    ]
    kinds = []
    for gguf_name, shape, keep_f32 in declared:
        kinds.append(storage_type(gguf, shape, gguf_type, keep_f32))
        byte_shape = gguf.quant_shape_to_byte_shape(shape, kinds[-1])
        writer.add_tensor_info(
            gguf_name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=kinds[-1]
        )
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor, kind in zip(extra.values(), kinds, strict=False):
            writer.write_tensor_data(encode(gguf, tensor, kind))
        streamed = zip(wholes, kinds[len(extra) :], assemble(tensors, family.part_of), strict=True)
        for expected, kind, (name, tensor) in streamed:
            if name != expected:
                raise RuntimeError(f"GGUF data out of order: got {name}, declared {expected}")
            writer.write_tensor_data(encode(gguf, family.transform(name, tensor), kind))
    finally:
        writer.close()


def _gguf_name(name_map, family: Architecture, name: str) -> str:
    found = name_map.get_name(family.gguf_name(name), try_suffixes=(".weight", ".bias"))
    if found is None:
        raise QLoraError(f"--gguf: llama.cpp's {family.arch.lower()} has no tensor for {name}")
    return found
