"""Checkpoint reading: config.json into a ModelSpec, safetensors shards streamed tensor by tensor.

Readers hand tensors over and build nothing: the model decides what to do with each one, so host
memory stays near one tensor however large the checkpoint is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qlora_cli.core.errors import QLoraError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Qwen2 / Qwen2.5 / Qwen3 decoder, read from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: torch.dtype

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each of the seven projections of a layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name the checkpoint must hold, with its shape (HF Qwen naming)."""
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (self.hidden_size,)
            shapes[p + "post_attention_layernorm.weight"] = (self.hidden_size,)
            for name, shape in self.projection_shapes().items():
                group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                shapes[f"{p}{group}.{name}.weight"] = shape
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (self.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (self.kv_size,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
        return shapes


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise QLoraError(f"rope scaling '{kind}' is not supported; qlora supports the default RoPE only")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise QLoraError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def spec_from_config(cfg: dict, where: str = "config.json") -> ModelSpec:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QLoraError(
            f"{where}: model_type '{model_type}' is not supported "
            f"(qlora trains {', '.join(SUPPORTED_MODEL_TYPES)}: Qwen2, Qwen2.5 and Qwen3)"
        )
    if cfg.get("use_sliding_window"):
        raise QLoraError(f"{where}: sliding-window attention is not supported")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise QLoraError(f"{where}: dtype '{dtype_name}' is not one of {', '.join(_DTYPES)}")
        return ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            dtype=_DTYPES[dtype_name],
        )
    except KeyError as err:
        raise QLoraError(f"{where}: missing the key {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise QLoraError(f"{where}: {err}") from None


def read_spec(folder: Path) -> ModelSpec:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise QLoraError(f"model folder {folder} has no config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QLoraError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise QLoraError(f"{path} is not a JSON object")
    spec = spec_from_config(cfg, str(path))
    if spec.num_heads % spec.num_kv_heads:
        raise QLoraError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    return spec


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise QLoraError(f"{index} is not a valid safetensors index: {err}") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise QLoraError(f"model folder {folder} has no safetensors weights")
    for file in files:
        if not file.is_file():
            raise QLoraError(f"safetensors shard {file} named by the index is missing")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise QLoraError(f"{file} is not a valid safetensors file (truncated or corrupt?): {err}") from None


def check_tensors(files: list[Path], spec: ModelSpec) -> dict[str, Path]:
    """Read only the headers: every expected tensor present with its shape. Returns name → file."""
    expected = spec.expected_tensors()
    found: dict[str, Path] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in expected:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise QLoraError(
                        f"{file.name}: tensor {name} has shape {list(shape)}, "
                        f"expected {list(expected[name])} from config.json"
                    )
                found[name] = file
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise QLoraError(f"checkpoint is missing tensor {missing[0]}{more}")
    return found


def locate_tensors(folder: Path, spec: ModelSpec) -> dict[Path, list[str]]:
    """The tensors the spec needs, file by file, in the order `stream_tensors` yields them; reads headers
    only, so a writer that must declare every tensor before the data (GGUF) can do so."""
    by_file: dict[Path, list[str]] = {}
    for name, file in check_tensors(shard_files(folder), spec).items():
        by_file.setdefault(file, []).append(name)
    return by_file


def stream_tensors(folder: Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor the spec needs, one at a time, shard by shard."""
    for file, names in locate_tensors(folder, spec).items():
        with _open(file) as f:
            for name in names:
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as err:
                    raise QLoraError(
                        f"{file}: cannot read tensor {name} (truncated or corrupt?): {err}"
                    ) from None
                yield name, tensor
