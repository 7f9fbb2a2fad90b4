"""The shape of a decoder qlora trains, as config.json gives it: the ModelSpec, the Gated DeltaNet dims,
the mixture-of-experts dims, the layer kinds and where a checkpoint keeps the text decoder's tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qlora_cli.core.names import ALL_PROJECTIONS, EXPERT_PARAMETERS
from qlora_cli.sources.rope import RopeScaling, rope_frequencies

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# What a layer's MLP is: the dense SwiGLU one, or routed experts (with a shared expert where the family
# has one, which runs as the dense one does).
DENSE_MLP = "dense"
MOE_MLP = "moe"

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
class MoESpec:
    """The routed experts of a mixture-of-experts layer: `num_experts` SwiGLU experts of
    `expert_intermediate_size`, `top_k` of them a token, picked by a softmax router; their weights
    renormalised to sum to 1 when `norm_topk_prob`. A shared expert of `shared_expert_intermediate_size`
    (0: none) runs on every token beside them, scaled by sigmoid(shared_expert_gate . x).
    `router_aux_loss_coef` weighs the load-balancing loss training adds (qlora_cli/model/mlps/balance.py),
    None where config.json does not ask for it (output_router_logits)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float | None = None

    def expert_tensors(self, hidden: int) -> dict[str, tuple[int, int]]:
        """One expert's projections below `mlp.experts.E.`, with their [out, in] shapes."""
        i = self.expert_intermediate_size
        return {"gate_proj": (i, hidden), "up_proj": (i, hidden), "down_proj": (hidden, i)}

    def fused_expert_shapes(self, hidden: int) -> dict[str, tuple[int, int]]:
        """One expert's share of transformers 5's fused parameters below `mlp.experts.`, [out, in]:
        gate_up_proj holds its gate rows, then its up rows."""
        i = self.expert_intermediate_size
        return dict(zip(EXPERT_PARAMETERS, ((2 * i, hidden), (hidden, i)), strict=True))


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
    # Each layer's MLP, DENSE_MLP or MOE_MLP (empty: every layer dense); `moe` sizes the MoE ones.
    mlp_types: tuple[str, ...] = ()
    moe: MoESpec | None = None

    def __post_init__(self):
        if not self.mlp_types or (
            set(self.mlp_types) == {DENSE_MLP} and len(self.mlp_types) != self.num_layers
        ):
            object.__setattr__(self, "mlp_types", (DENSE_MLP,) * self.num_layers)
        if len(self.mlp_types) != self.num_layers:
            raise ValueError(f"{len(self.mlp_types)} MLP types for {self.num_layers} layers")
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

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """(mixer kind, MLP kind) of each layer."""
        return tuple(zip(self.layer_types, self.mlp_types, strict=True))

    def dense_mlp_width(self, mlp: str = DENSE_MLP) -> int:
        """The width of the dense SwiGLU path of an MLP of kind `mlp`: intermediate_size, or a MoE
        layer's shared expert (0 where it has none)."""
        if mlp == DENSE_MLP:
            return self.intermediate_size
        return self.moe.shared_expert_intermediate_size

    def routed_expert_weights(self) -> int:
        """The routed experts' weights in all layers, and their routers': what the projections leave out."""
        if self.moe is None:
            return 0
        per_expert = sum(o * i for o, i in self.moe.expert_tensors(self.hidden_size).values())
        per_layer = self.moe.num_experts * (per_expert + self.hidden_size)
        return per_layer * self.mlp_types.count(MOE_MLP)

    def projection_shapes(
        self, kind: str = FULL_ATTENTION, mlp: str = DENSE_MLP
    ) -> dict[str, tuple[int, int]]:
        """[out, in] of each projection of a layer of `kind` with an MLP of kind `mlp`, under transformers'
        module names: its mixer's (LAYER_KIND_TENSORS), then its MLP's. A MoE layer's MLP projections are
        its shared expert's; its routed experts are no projection (qlora_cli/model/mlps/moe.py)."""
        h, i = self.hidden_size, self.dense_mlp_width(mlp)
        mlp_shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)} if i else {}
        return {**layer_kind_tensors(kind).projections(self), **mlp_shapes}

    def projection_names(self) -> tuple[str, ...]:
        """Every projection the model's layers have, in layer order: what LoRA can target in this model."""
        kinds = dict.fromkeys(self.layer_kinds)
        return tuple(dict.fromkeys(name for kind in kinds for name in self.projection_shapes(*kind)))

    def lora_target_problem(self, target_modules: list[str], target_parameters: list[str]) -> str | None:
        """Why LoRA's targets miss this model, or None: a list of another family's names (Qwen3.5's
        in_proj_qkv on a Llama) would leave LoRA nothing to train, and only MoE layers have routed experts."""
        projections = self.projection_names()
        if not set(target_modules) & set(projections):
            return (
                f"config key 'lora_target_modules': {', '.join(target_modules)} names no projection of "
                f"this {self.model_type} model; its layers have {', '.join(projections)}"
            )
        if target_parameters and MOE_MLP not in self.mlp_types:
            return (
                f"config key 'lora_target_parameters': this {self.model_type} model has no routed experts "
                "(a mixture-of-experts model's); remove it"
            )
        return None

    def lora_target_note(self, target_modules: list[str]) -> str | None:
        """The listed targets this model lacks, where others match (none matching is a problem): they
        train nothing, where PEFT would read gate/up/down on a MoE model as its routed experts."""
        if set(target_modules) >= set(ALL_PROJECTIONS):
            return None
        projections = self.projection_names()
        missing = [name for name in target_modules if name not in projections]
        if not missing:
            return None
        experts = ""
        if MOE_MLP in self.mlp_types and set(missing) & set(_MLP):
            experts = (
                "; its MLPs are routed experts, frozen unless lora_target_parameters names them "
                "(mlp.experts.gate_up_proj, mlp.experts.down_proj)"
            )
        verb = "names" if len(missing) == 1 else "name"
        return f"lora_target_modules: {', '.join(missing)} {verb} no projection of this {self.model_type} model{experts}"

    def layer_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The tensors of one layer, named below `model.layers.N.`, with their shapes."""
        kind_name, mlp = self.layer_kinds[layer]
        kind = layer_kind_tensors(kind_name)
        shapes: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (self.hidden_size,),
            "post_attention_layernorm.weight": (self.hidden_size,),
        }
        projections = self.projection_shapes(kind_name, mlp)
        mlp_module = "mlp.shared_expert" if mlp == MOE_MLP else "mlp"
        module = {name: mlp_module if name in _MLP else kind.module for name in projections}
        for name, shape in projections.items():
            shapes[f"{module[name]}.{name}.weight"] = shape
        shapes.update({f"{kind.module}.{name}": shape for name, shape in kind.tensors(self).items()})
        if mlp == MOE_MLP:
            shapes.update(self.moe_tensors())
        biased = [*kind.biased(self), *(_MLP if self.mlp_bias else ())]
        for name in biased:
            if name in projections:
                shapes[f"{module[name]}.{name}.bias"] = (projections[name][0],)
        return shapes

    def moe_tensors(self) -> dict[str, tuple[int, ...]]:
        """A MoE layer's tensors below `model.layers.N.` that are no projection: the router, the shared
        expert's gate, and each routed expert's projections as a checkpoint stores them one by one
        (qlora_cli/sources/weights.py reads the fused 3-D form as the same names)."""
        moe, h = self.moe, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (moe.num_experts, h)}
        if moe.shared_expert_intermediate_size:
            shapes["mlp.shared_expert_gate.weight"] = (1, h)
        for expert in range(moe.num_experts):
            for name, shape in moe.expert_tensors(h).items():
                shapes[f"mlp.experts.{expert}.{name}.weight"] = shape
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
