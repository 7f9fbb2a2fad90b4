"""Checkpoint reading: config.json into a ModelSpec, safetensors shards streamed tensor by tensor.

Readers hand tensors over and build nothing: the model decides what to do with each one, so host
memory stays near one tensor however large the checkpoint is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import LINEAR_ATTENTION_PROJECTIONS
from qlora_cli.core.wording import count
from qlora_cli.sources.hf_files import MODEL_CONFIG, SAFETENSORS_INDEX
from qlora_cli.sources.rope import RopeScaling, rope_config, rope_frequencies

# Each model_type qlora trains, with the families it covers (for the one-line refusal of the others).
FAMILIES = {
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3",
    "qwen3_5": "Qwen3.5, Qwen3.6",
    "qwen3_5_text": "Qwen3.5, Qwen3.6 (text-only)",
    "llama": "Llama 3.x, DeepSeek-R1-Distill-Llama",
    "mistral": "Mistral 7B, Mistral Small",
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_SUPPORTED = "Qwen2, Qwen2.5, Qwen3, Qwen3.5/3.6, Llama 3.x and Mistral"

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)

# Where the text decoder's tensors sit: at `model.` in a causal LM, under `model.language_model.` in a
# vision-language checkpoint. Streamed names always use the first.
TEXT_LAYOUT = "text"
VISION_LANGUAGE_LAYOUT = "vl"
DECODER_PREFIX = {TEXT_LAYOUT: "model.", VISION_LANGUAGE_LAYOUT: "model.language_model."}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_MODULE = {
    **dict.fromkeys(_ATTENTION, "self_attn"),
    **dict.fromkeys(_MLP, "mlp"),
    **dict.fromkeys(LINEAR_ATTENTION_PROJECTIONS, "linear_attn"),
}


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet dims of Qwen3.5's linear-attention layers: q and k have `num_key_heads`
    heads of `key_head_dim`; v, the gate z, a, b and the recurrent state have `num_value_heads`."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of in_proj_qkv and of the depthwise conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder qlora trains (Qwen2/2.5/3/3.5, Llama 3.x, Mistral), read from config.json.

    `layer_types[i]` says whether layer i is full (softmax) attention or Qwen3.5's linear attention;
    every layer of the other families is full attention.
    """

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
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling = RopeScaling()
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attention_output_gate: bool = False
    zero_centred_norms: bool = False
    linear_attention: LinearAttentionSpec | None = None
    layout: str = TEXT_LAYOUT

    def __post_init__(self):
        # A spec of attention layers only may be copied with another num_layers (dataclasses.replace);
        # its layer kinds follow. A hybrid's must be given whole.
        if set(self.layer_types) <= {FULL_ATTENTION} and len(self.layer_types) != self.num_layers:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head RoPE rotates (all of them unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_frequencies(self, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim / 2] fp32, attention_scaling) exactly as transformers computes them for
        this config's RoPE type; attention_scaling multiplies cos and sin (1 but for yarn)."""
        return rope_frequencies(self.rope_theta, self.rotary_dim, self.rope_scaling, device)

    @property
    def decoder_prefix(self) -> str:
        """Where the decoder's modules sit in the class config.json names, `model.` or, for a
        vision-language class, `model.language_model.`: a PEFT adapter for this base names its modules
        `base_model.model.` + this + `layers.N....`, or it loads as missing keys."""
        return DECODER_PREFIX[self.layout]

    def projection_shapes(self, kind: str = FULL_ATTENTION) -> dict[str, tuple[int, int]]:
        """[out, in] of each projection of a layer of `kind`, under transformers' module names; a gated
        attention's q_proj holds query and gate, interleaved per head ([h·2d, h·2d + d) is query)."""
        h, i = self.hidden_size, self.intermediate_size
        mlp = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        if kind == LINEAR_ATTENTION:
            linear = self.linear_attention
            return {
                "in_proj_qkv": (linear.conv_dim, h),
                "in_proj_z": (linear.value_dim, h),
                "in_proj_b": (linear.num_value_heads, h),
                "in_proj_a": (linear.num_value_heads, h),
                "out_proj": (h, linear.value_dim),
                **mlp,
            }
        q_out = 2 * self.q_size if self.attention_output_gate else self.q_size
        return {
            "q_proj": (q_out, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            **mlp,
        }

    def projection_names(self) -> tuple[str, ...]:
        """Every projection the model's layers have, in layer order: what LoRA can target in this model."""
        kinds = dict.fromkeys(self.layer_types)
        return tuple(dict.fromkeys(name for kind in kinds for name in self.projection_shapes(kind)))

    def layer_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one layer, named below `model.layers.N.`, with their shapes."""
        kind = self.layer_types[layer]
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (self.hidden_size,),
            "post_attention_layernorm.weight": (self.hidden_size,),
        }
        projections = self.projection_shapes(kind)
        for name, shape in projections.items():
            shapes[f"{_MODULE[name]}.{name}.weight"] = shape
        biased = [*_MLP] if self.mlp_bias else []
        if kind == FULL_ATTENTION:
            biased += ["q_proj", "k_proj", "v_proj"] if self.attention_bias else []
            biased += ["o_proj"] if self.o_proj_bias else []
            if self.qk_norm:
                shapes["self_attn.q_norm.weight"] = (self.head_dim,)
                shapes["self_attn.k_norm.weight"] = (self.head_dim,)
        else:
            linear = self.linear_attention
            shapes["linear_attn.conv1d.weight"] = (linear.conv_dim, 1, linear.conv_kernel)
            shapes["linear_attn.A_log"] = (linear.num_value_heads,)
            shapes["linear_attn.dt_bias"] = (linear.num_value_heads,)
            shapes["linear_attn.norm.weight"] = (linear.value_head_dim,)
        for name in biased:
            shapes[f"{_MODULE[name]}.{name}.bias"] = (projections[name][0],)
        return shapes

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name the checkpoint must hold, with its shape, as stream_tensors names them."""
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        for layer in range(self.num_layers):
            for name, shape in self.layer_tensors(layer).items():
                shapes[f"model.layers.{layer}.{name}"] = shape
        return shapes


def _unsupported(model_type: object, where: str) -> QLoraError:
    return QLoraError(
        f"{where}: model_type '{model_type}' is not supported "
        f"(qlora trains {', '.join(SUPPORTED_MODEL_TYPES)}: {_SUPPORTED})"
    )


def _layer_types(cfg: dict, num_layers: int, where: str) -> tuple[str, ...]:
    """Qwen3.5's layer pattern: `layer_types`, else every `full_attention_interval`-th layer full."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or set(types) - set(LAYER_TYPES):
        raise QLoraError(
            f"{where}: layer_types must list {count(num_layers, 'entry', 'entries')} (num_hidden_layers) of "
            f"{' or '.join(LAYER_TYPES)}, got {types!r}"
        )
    return tuple(types)


def _linear_attention(cfg: dict) -> LinearAttentionSpec:
    linear = LinearAttentionSpec(
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return linear


def _decoder_config(cfg: dict, where: str) -> tuple[dict, str]:
    """The text decoder's keys and the checkpoint layout: a vision-language config keeps them under
    text_config."""
    if cfg.get("model_type") != "qwen3_5":
        return cfg, TEXT_LAYOUT
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise QLoraError(f"{where}: model_type 'qwen3_5' needs a text_config mapping")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise _unsupported(text.get("model_type"), f"{where} text_config")
    # The vision-language class ties by the top-level flag, whatever text_config says.
    tie = cfg.get("tie_word_embeddings", False)
    dtype = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return {**text, "tie_word_embeddings": tie, "dtype": dtype}, VISION_LANGUAGE_LAYOUT


def spec_from_config(cfg: dict, where: str = MODEL_CONFIG) -> ModelSpec:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(model_type, where)
    cfg, layout = _decoder_config(cfg, where)
    qwen3_5 = layout == VISION_LANGUAGE_LAYOUT or model_type == "qwen3_5_text"
    if model_type == "qwen2" and cfg.get("use_sliding_window"):
        raise QLoraError(f"{where}: sliding-window attention is not supported for qwen2")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim_default = {"qwen3": 128}.get(model_type, 256 if qwen3_5 else hidden // heads)
        num_layers = int(cfg["num_hidden_layers"])
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise QLoraError(f"{where}: dtype '{dtype_name}' is not one of {', '.join(_DTYPES)}")
        rope = rope_config(cfg, where, default_partial_rotary_factor=0.25 if qwen3_5 else 1.0)
        # Qwen2 biases q/k/v; Qwen3, Qwen3.5 and Llama bias q/k/v/o when attention_bias is set; Mistral never.
        qkv_bias = bool(cfg.get("attention_bias", model_type == "qwen2")) and model_type != "mistral"
        window = cfg.get("sliding_window") if model_type == "mistral" else None
        spec = ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or head_dim_default),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=model_type == "qwen3" or qwen3_5,
            dtype=_DTYPES[dtype_name],
            o_proj_bias=qkv_bias and model_type != "qwen2",
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope.scaling,
            partial_rotary_factor=rope.partial_rotary_factor,
            mrope_section=rope.mrope_section if qwen3_5 else (),
            sliding_window=None if window is None else int(window),
            layer_types=_layer_types(cfg, num_layers, where) if qwen3_5 else (),
            attention_output_gate=qwen3_5,
            zero_centred_norms=qwen3_5,
            linear_attention=_linear_attention(cfg) if qwen3_5 else None,
            layout=layout,
        )
    except KeyError as err:
        raise QLoraError(f"{where}: missing the key {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise QLoraError(f"{where}: {err}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise QLoraError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    if spec.rotary_dim % 2:
        raise QLoraError(f"{where}: RoPE rotates {spec.rotary_dim} dims of each head; it must be even")
    if spec.mrope_section and sum(spec.mrope_section) != spec.rotary_dim // 2:
        raise QLoraError(
            f"{where}: mrope_section {list(spec.mrope_section)} must sum to {spec.rotary_dim // 2} "
            "(half the rotary dims)"
        )
    return spec


def read_spec(folder: Path) -> ModelSpec:
    path = Path(folder) / MODEL_CONFIG
    if not path.is_file():
        raise QLoraError(f"model folder {folder} has no config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QLoraError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise QLoraError(f"{path} is not a JSON object")
    return spec_from_config(cfg, str(path))


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model.safetensors."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
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


# Tensors of a checkpoint that qlora does not train and never reads: a vision-language checkpoint's vision
# tower, and Qwen3.5's multi-token-prediction head, by the prefix of their names.
SKIPPED_PARTS = {"model.visual.": "vision-tower", "mtp.": "MTP", "model.mtp.": "MTP"}


def canonical_name(stored: str) -> str:
    """The name a tensor streams under: a vision-language checkpoint's text decoder moves from
    `model.language_model.` to `model.`, where a causal LM keeps it."""
    prefix = DECODER_PREFIX[VISION_LANGUAGE_LAYOUT]
    return DECODER_PREFIX[TEXT_LAYOUT] + stored.removeprefix(prefix) if stored.startswith(prefix) else stored


def _skipped_part(stored: str) -> str | None:
    return next((part for prefix, part in SKIPPED_PARTS.items() if stored.startswith(prefix)), None)


@dataclass(frozen=True)
class TensorLocations:
    """Where each tensor the spec needs is stored: file → {streamed name: name in the file}, in
    stream order; how many tensors of each skipped part (vision tower, MTP) were left unread, and
    their stored names file by file (a merged export carries them over)."""

    by_file: dict[Path, dict[str, str]]
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_by_file: dict[Path, list[str]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for names in self.by_file.values() for name in names]

    def note(self) -> str | None:
        """One line for the user when parts of the checkpoint are not trained, else None."""
        if not self.skipped:
            return None
        parts = " and ".join(count(tensors, f"{part} tensor") for part, tensors in self.skipped.items())
        return f"skipped {parts} of the checkpoint (not trained; qlora trains the text decoder)"


def check_tensors(files: list[Path], spec: ModelSpec) -> TensorLocations:
    """Read only the headers: every expected tensor present once with its shape, under either layout."""
    expected = spec.expected_tensors()
    by_file: dict[Path, dict[str, str]] = {}
    stored_as: dict[str, str] = {}
    skipped: dict[str, int] = {}
    skipped_by_file: dict[Path, list[str]] = {}
    for file in files:
        with _open(file) as f:
            for stored in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = _skipped_part(stored)
                if part is not None:
                    skipped[part] = skipped.get(part, 0) + 1
                    skipped_by_file.setdefault(file, []).append(stored)
                    continue
                name = canonical_name(stored)
                if name not in expected:
                    continue
                if name in stored_as:
                    raise QLoraError(f"checkpoint holds {name} twice, as {stored_as[name]} and {stored}")
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != expected[name]:
                    raise QLoraError(
                        f"{file.name}: tensor {stored} has shape {list(shape)}, "
                        f"expected {list(expected[name])} from config.json"
                    )
                stored_as[name] = stored
                by_file.setdefault(file, {})[name] = stored
    missing = [name for name in expected if name not in stored_as]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise QLoraError(f"checkpoint is missing tensor {missing[0]}{more}")
    return TensorLocations(by_file, skipped, skipped_by_file)


def locate_tensors(folder: Path, spec: ModelSpec) -> TensorLocations:
    """The tensors the spec needs, file by file, in the order `stream_tensors` yields them; reads headers
    only, so a writer that must declare every tensor before the data (GGUF) can do so, and a caller can
    print the note on skipped parts before any weights load."""
    return check_tensors(shard_files(folder), spec)


def _read(f, file: Path, stored: str) -> torch.Tensor:
    try:
        return f.get_tensor(stored)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise QLoraError(f"{file}: cannot read tensor {stored} (truncated or corrupt?): {err}") from None


def stream_tensors(folder: Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor the spec needs, one at a time, shard by shard, named as a
    causal LM names them (`model.layers.N....`) whatever the checkpoint's layout."""
    for file, names in locate_tensors(folder, spec).by_file.items():
        with _open(file) as f:
            for name, stored in names.items():
                yield name, _read(f, file, stored)


def stream_checkpoint(folder: Path, spec: ModelSpec) -> Iterator[tuple[str, str | None, torch.Tensor]]:
    """Yield (name in the checkpoint, name as stream_tensors gives it, tensor) for the tensors the spec
    needs and those of the skipped parts (whose second name is None), one at a time, shard by shard: the
    checkpoint in its own layout, for a writer that keeps it."""
    locations = locate_tensors(folder, spec)
    for file in dict.fromkeys([*locations.by_file, *locations.skipped_by_file]):
        with _open(file) as f:
            for name, stored in locations.by_file.get(file, {}).items():
                yield stored, name, _read(f, file, stored)
            for stored in locations.skipped_by_file.get(file, []):
                yield stored, None, _read(f, file, stored)
