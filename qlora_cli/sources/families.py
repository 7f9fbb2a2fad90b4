"""The families qlora trains, one row each: what config.json leaves unsaid for the family, and what the
family becomes in llama.cpp.

A family that reuses the layer kinds qlora has is one row here; spec_from_config reads the row, and the
GGUF export takes its architecture from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qlora_cli.core.errors import QLoraError


@dataclass(frozen=True)
class Family:
    """One family: its model_types, its defaults and which of config.json's keys it reads."""

    model_types: tuple[str, ...]
    # The checkpoints it covers, for the line that refuses the others.
    covers: str
    # The gguf package's MODEL_ARCH member llama.cpp runs the family as.
    gguf_architecture: str
    # head_dim when config.json has none; None: hidden_size / num_attention_heads.
    head_dim: int | None = None
    # attention_bias when config.json has none; whether the family reads the key at all (Mistral never
    # biases); whether the bias covers o_proj as well as q/k/v.
    attention_bias: bool = False
    reads_attention_bias: bool = True
    o_proj_bias: bool = True
    # Whether config.json's mlp_bias biases the MLP's projections.
    reads_mlp_bias: bool = False
    # Whether config.json's sliding_window limits attention, and whether its use_sliding_window is refused
    # (Qwen2's window, which qlora does not run).
    sliding_window: bool = False
    refuses_use_sliding_window: bool = False
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    # RoPE: the share of each head it rotates when config.json does not say, and whether positions
    # rotate in mrope_section's sections (Qwen3.5's multimodal RoPE).
    partial_rotary_factor: float = 1.0
    multimodal_rope: bool = False
    # Norms that scale by 1 + w instead of w.
    zero_centred_norms: bool = False
    # q_proj also holds a per-head gate of attention's output.
    attention_output_gate: bool = False
    # Layers of both kinds (layer_types), the linear ones Gated DeltaNet.
    hybrid: bool = False
    # The model_type of the family's vision-language class, whose decoder's keys sit under text_config.
    vision_language_type: str | None = None
    # Routed experts (num_experts, num_experts_per_tok, moe_intermediate_size): whether the family reads
    # norm_topk_prob (else it always renormalises the top-k weights), which layers are sparse
    # (decoder_sparse_step, mlp_only_layers; else every layer), and whether a gated shared expert
    # (shared_expert_intermediate_size) runs beside them.
    moe: bool = False
    reads_norm_topk_prob: bool = True
    reads_sparse_layers: bool = True
    shared_expert: bool = False
    # The load-balancing loss's weight when config.json asks for the loss (output_router_logits) without
    # giving router_aux_loss_coef: transformers' default for the family.
    router_aux_loss_coef: float = 0.001

    @property
    def text_types(self) -> tuple[str, ...]:
        """The model_types of the text decoder alone: what a vision-language config's text_config names."""
        return tuple(t for t in self.model_types if t != self.vision_language_type)


_QWEN35 = Family(
    ("qwen3_5", "qwen3_5_text"),
    "Qwen3.5/3.6",
    "QWEN35",
    head_dim=256,
    qk_norm=True,
    partial_rotary_factor=0.25,
    multimodal_rope=True,
    zero_centred_norms=True,
    attention_output_gate=True,
    hybrid=True,
    vision_language_type="qwen3_5",
)

FAMILIES: tuple[Family, ...] = (
    Family(
        ("qwen2",),
        "Qwen2, Qwen2.5",
        "QWEN2",
        attention_bias=True,
        o_proj_bias=False,
        refuses_use_sliding_window=True,
    ),
    Family(("qwen3",), "Qwen3", "QWEN3", head_dim=128, qk_norm=True),
    _QWEN35,
    Family(("qwen3_moe",), "Qwen3 MoE", "QWEN3MOE", head_dim=128, qk_norm=True, moe=True),
    # Qwen3.5's layers with a routed MoE MLP and a gated shared expert in every layer.
    dataclasses.replace(
        _QWEN35,
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        covers="Qwen3.5/3.6 MoE",
        gguf_architecture="QWEN35MOE",
        vision_language_type="qwen3_5_moe",
        moe=True,
        reads_norm_topk_prob=False,
        reads_sparse_layers=False,
        shared_expert=True,
    ),
    Family(("llama",), "Llama 3.x", "LLAMA", reads_mlp_bias=True),
    Family(("mistral",), "Mistral", "LLAMA", reads_attention_bias=False, sliding_window=True),
)


def supported_model_types() -> tuple[str, ...]:
    return tuple(model_type for row in FAMILIES for model_type in row.model_types)


def unsupported(model_type: object, where: str) -> QLoraError:
    """One line refusing `model_type`, naming every one qlora trains."""
    covers = [row.covers for row in FAMILIES]
    named = f"{', '.join(covers[:-1])} and {covers[-1]}" if len(covers) > 1 else covers[0]
    return QLoraError(
        f"{where}: model_type '{model_type}' is not supported "
        f"(qlora trains {', '.join(supported_model_types())}: {named})"
    )


def family(model_type: object, where: str) -> Family:
    """The row of `model_type`, or the line refusing it."""
    for row in FAMILIES:
        if model_type in row.model_types:
            return row
    raise unsupported(model_type, where)
