"""config.json into a ModelSpec: the family's row (qlora_cli/sources/families.py) fills what the config
leaves unsaid, and the shape is checked before anything loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import count
from qlora_cli.sources.families import Family, family, unsupported
from qlora_cli.sources.hf_files import MODEL_CONFIG
from qlora_cli.sources.rope import rope_config
from qlora_cli.sources.spec import (
    DENSE_MLP,
    FULL_ATTENTION,
    LAYER_KIND_TENSORS,
    LINEAR_ATTENTION,
    MOE_MLP,
    TEXT_LAYOUT,
    VISION_LANGUAGE_LAYOUT,
    LinearAttentionSpec,
    ModelSpec,
    MoESpec,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _layer_types(cfg: dict, num_layers: int, where: str) -> tuple[str, ...]:
    """A hybrid's layer pattern: `layer_types`, else every `full_attention_interval`-th layer full."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or set(types) - set(LAYER_KIND_TENSORS):
        raise QLoraError(
            f"{where}: layer_types must list {count(num_layers, 'entry', 'entries')} (num_hidden_layers) of "
            f"{' or '.join(LAYER_KIND_TENSORS)}, got {types!r}"
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


# Routing and placement settings of other MoE families, which qlora's router does not compute: the key
# and the values it may hold (a softmax over every expert, top-k, no scale, one device).
_ROUTING_KEYS = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "router_type": ("softmax",),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
    "ep_size": (None, 1),
    "expert_parallel_size": (None, 1),
    "moe_expert_parallel": (None, False),
}


def _router_aux_loss_coef(cfg: dict, row: Family, where: str) -> float | None:
    """The load-balancing loss's weight where output_router_logits asks training for the loss, else None:
    router_aux_loss_coef, or the family's default as transformers' config class has it."""
    asked = cfg.get("output_router_logits")
    if asked is None or asked is False:
        return None
    if asked is not True:
        raise QLoraError(f"{where}: output_router_logits must be true or false, got {json.dumps(asked)}")
    coef = cfg.get("router_aux_loss_coef", row.router_aux_loss_coef)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef):
        raise QLoraError(f"{where}: router_aux_loss_coef must be a number, got {json.dumps(coef)}")
    return float(coef)


def _moe(cfg: dict, row: Family, num_layers: int, where: str) -> tuple[tuple[str, ...], MoESpec | None]:
    """Each layer's MLP kind and the routed experts' dims: a sparse layer is every decoder_sparse_step-th
    one not in mlp_only_layers (every layer where the family reads neither)."""
    if not row.moe:
        return (DENSE_MLP,) * num_layers, None
    for key, allowed in _ROUTING_KEYS.items():
        if key in cfg and cfg[key] not in allowed:
            shown = " or ".join("absent" if a is None else json.dumps(a) for a in allowed)
            raise QLoraError(
                f"{where}: {key} {json.dumps(cfg[key])} is not supported for {cfg.get('model_type')} "
                f"(qlora's router takes a softmax top-k on one device; {key} must be {shown})"
            )
    # transformers' Qwen3 MoE config saves num_experts as num_local_experts.
    experts = cfg.get("num_experts")
    experts = cfg.get("num_local_experts") if experts is None else experts
    if experts is None:
        raise QLoraError(f"{where}: missing the key 'num_experts'")
    moe = MoESpec(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if row.reads_norm_topk_prob else True,
        shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"])
        if row.shared_expert
        else 0,
        router_aux_loss_coef=_router_aux_loss_coef(cfg, row, where),
    )
    if not 1 <= moe.top_k <= moe.num_experts:
        raise QLoraError(
            f"{where}: num_experts_per_tok {moe.top_k} must be between 1 and num_experts {moe.num_experts}"
        )
    if not row.reads_sparse_layers:
        return (MOE_MLP,) * num_layers, moe
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = cfg.get("mlp_only_layers") or []
    if step < 1:
        raise QLoraError(f"{where}: decoder_sparse_step must be at least 1, got {step}")
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
        raise QLoraError(
            f"{where}: mlp_only_layers must list layer indices below {num_layers}, got {dense!r}"
        )
    return tuple(
        MOE_MLP if i not in dense and moe.num_experts > 0 and (i + 1) % step == 0 else DENSE_MLP
        for i in range(num_layers)
    ), moe


def _decoder_config(cfg: dict, row: Family, where: str) -> tuple[dict, str]:
    """The text decoder's keys and the checkpoint layout: a vision-language config keeps them under
    text_config."""
    model_type = cfg.get("model_type")
    if model_type != row.vision_language_type:
        return cfg, TEXT_LAYOUT
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise QLoraError(f"{where}: model_type '{model_type}' needs a text_config mapping")
    if text.get("model_type", row.text_types[0]) not in row.text_types:
        raise unsupported(text.get("model_type"), f"{where} text_config")
    # The vision-language class ties by the top-level flag, whatever text_config says.
    tie = cfg.get("tie_word_embeddings", row.tie_word_embeddings)
    dtype = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return {**text, "tie_word_embeddings": tie, "dtype": dtype}, VISION_LANGUAGE_LAYOUT


def spec_from_config(cfg: dict, where: str = MODEL_CONFIG) -> ModelSpec:
    """The spec config.json describes; its family's row fills what the config leaves unsaid."""
    model_type = cfg.get("model_type")
    row = family(model_type, where)
    cfg, layout = _decoder_config(cfg, row, where)
    if row.refuses_use_sliding_window and cfg.get("use_sliding_window"):
        raise QLoraError(f"{where}: sliding-window attention is not supported for {model_type}")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim_default = row.head_dim if row.head_dim is not None else hidden // heads
        num_layers = int(cfg["num_hidden_layers"])
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPES:
            raise QLoraError(f"{where}: dtype '{dtype_name}' is not one of {', '.join(_DTYPES)}")
        rope = rope_config(cfg, where, default_partial_rotary_factor=row.partial_rotary_factor)
        qkv_bias = row.reads_attention_bias and bool(cfg.get("attention_bias", row.attention_bias))
        window = cfg.get("sliding_window") if row.sliding_window else None
        mlp_types, moe = _moe(cfg, row, num_layers, where)
        # A family whose every layer is sparse may have no intermediate_size: its dense path is the
        # shared expert.
        intermediate = cfg.get("intermediate_size") or (moe and moe.shared_expert_intermediate_size)
        spec = ModelSpec(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(intermediate if intermediate is not None else cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or head_dim_default),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", row.tie_word_embeddings)),
            attention_bias=qkv_bias,
            qk_norm=row.qk_norm,
            dtype=_DTYPES[dtype_name],
            o_proj_bias=qkv_bias and row.o_proj_bias,
            mlp_bias=row.reads_mlp_bias and bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope.scaling,
            partial_rotary_factor=rope.partial_rotary_factor,
            mrope_section=rope.mrope_section if row.multimodal_rope else (),
            sliding_window=None if window is None else int(window),
            layer_types=_layer_types(cfg, num_layers, where) if row.hybrid else (),
            attention_output_gate=row.attention_output_gate,
            zero_centred_norms=row.zero_centred_norms,
            linear_attention=_linear_attention(cfg) if row.hybrid else None,
            layout=layout,
            mlp_types=mlp_types,
            moe=moe,
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
