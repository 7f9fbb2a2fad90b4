"""The shape of a decoder qlora trains, as config.json gives it: the ModelSpec, the Gated DeltaNet dims,
the layer kinds and where a checkpoint keeps the text decoder's tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qlora_cli.sources.rope import RopeScaling, rope_frequencies

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# Where the text decoder's tensors sit: at `model.` in a causal LM, under `model.language_model.` in a
# vision-language checkpoint. Streamed names always use the first.
TEXT_LAYOUT = "text"
VISION_LANGUAGE_LAYOUT = "vl"
DECODER_PREFIX = {TEXT_LAYOUT: "model.", VISION_LANGUAGE_LAYOUT: "model.language_model."}

_MLP = ("gate_proj", "up_proj", "down_proj")


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
        """[out, in] of each projection of a layer of `kind`, under transformers' module names: its
        mixer's (LAYER_KIND_TENSORS), then the MLP's."""
        h, i = self.hidden_size, self.intermediate_size
        mlp = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        return {**layer_kind_tensors(kind).projections(self), **mlp}

    def projection_names(self) -> tuple[str, ...]:
        """Every projection the model's layers have, in layer order: what LoRA can target in this model."""
        kinds = dict.fromkeys(self.layer_types)
        return tuple(dict.fromkeys(name for kind in kinds for name in self.projection_shapes(kind)))

    def layer_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one layer, named below `model.layers.N.`, with their shapes."""
        kind = layer_kind_tensors(self.layer_types[layer])
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (self.hidden_size,),
            "post_attention_layernorm.weight": (self.hidden_size,),
        }
        projections = self.projection_shapes(self.layer_types[layer])
        module = {name: "mlp" if name in _MLP else kind.module for name in projections}
        for name, shape in projections.items():
            shapes[f"{module[name]}.{name}.weight"] = shape
        shapes.update({f"{kind.module}.{name}": shape for name, shape in kind.tensors(self).items()})
        biased = [*kind.biased(self), *(_MLP if self.mlp_bias else ())]
        for name in biased:
            shapes[f"{module[name]}.{name}.bias"] = (projections[name][0],)
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


@dataclass(frozen=True)
class LayerKindTensors:
    """What a layer kind's token mixer keeps in a checkpoint, under `module` in each layer of the kind:
    its projections' [out, in], its other tensors' shapes and its biased projections, from the spec."""

    module: str
    projections: Callable[[ModelSpec], dict[str, tuple[int, int]]]
    tensors: Callable[[ModelSpec], dict[str, tuple[int, ...]]]
    biased: Callable[[ModelSpec], tuple[str, ...]]


def _attention_projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """A gated attention's q_proj holds query and gate, interleaved per head ([h·2d, h·2d + d) is query)."""
    h = spec.hidden_size
    q_out = 2 * spec.q_size if spec.attention_output_gate else spec.q_size
    return {
        "q_proj": (q_out, h),
        "k_proj": (spec.kv_size, h),
        "v_proj": (spec.kv_size, h),
        "o_proj": (h, spec.q_size),
    }


def _attention_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {"q_norm.weight": (spec.head_dim,), "k_norm.weight": (spec.head_dim,)} if spec.qk_norm else {}


def _attention_biased(spec: ModelSpec) -> tuple[str, ...]:
    qkv = ("q_proj", "k_proj", "v_proj") if spec.attention_bias else ()
    return qkv + (("o_proj",) if spec.o_proj_bias else ())


def _gated_deltanet_projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    h, linear = spec.hidden_size, spec.linear_attention
    return {
        "in_proj_qkv": (linear.conv_dim, h),
        "in_proj_z": (linear.value_dim, h),
        "in_proj_b": (linear.num_value_heads, h),
        "in_proj_a": (linear.num_value_heads, h),
        "out_proj": (h, linear.value_dim),
    }


def _gated_deltanet_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    linear = spec.linear_attention
    return {
        "conv1d.weight": (linear.conv_dim, 1, linear.conv_kernel),
        "A_log": (linear.num_value_heads,),
        "dt_bias": (linear.num_value_heads,),
        "norm.weight": (linear.value_head_dim,),
    }


# Layer kind (ModelSpec.layer_types) -> its mixer's tensors; a new kind is a row here and its mixer
# in qlora_cli.model.mixers.
LAYER_KIND_TENSORS: dict[str, LayerKindTensors] = {
    FULL_ATTENTION: LayerKindTensors(
        "self_attn", _attention_projections, _attention_tensors, _attention_biased
    ),
    LINEAR_ATTENTION: LayerKindTensors(
        "linear_attn", _gated_deltanet_projections, _gated_deltanet_tensors, lambda spec: ()
    ),
}


def layer_kind_tensors(kind: str) -> LayerKindTensors:
    if kind not in LAYER_KIND_TENSORS:
        raise ValueError(f"no layer kind '{kind}' (known: {', '.join(LAYER_KIND_TENSORS)})")
    return LAYER_KIND_TENSORS[kind]
