"""How many layers recompute their activations in backward, from a memory budget.

Recomputing a layer costs about a third more of its forward time; keeping its activations costs
memory. With `gradient_checkpointing: auto` we keep as many layers as the budget holds.
"""

from __future__ import annotations

from qlora_cli.weights import ModelSpec

BF16 = 2


def frozen_weight_bytes(spec: ModelSpec) -> int:
    """NF4 projections (half a byte a weight plus about 1/64 byte of absmax) and bf16 embeddings."""
    projections = sum(out * inp for out, inp in spec.projection_shapes().values()) * spec.num_layers
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return int(projections * (0.5 + 1 / 64)) + embeddings * BF16


def lora_weights_per_layer(spec: ModelSpec, lora_r: int) -> int:
    return sum(lora_r * (out + inp) for out, inp in spec.projection_shapes().values())


def trainable_state_bytes(spec: ModelSpec, lora_r: int) -> int:
    """fp32 LoRA weights, their gradients and two AdamW moments."""
    return lora_weights_per_layer(spec, lora_r) * spec.num_layers * 4 * 4


def kept_activation_bytes(spec: ModelSpec, tokens: int, lora_dropout: float = 0.0) -> int:
    """What one layer saves for backward when it is not recomputed (bf16).

    Without LoRA dropout the SwiGLU output is not kept: the down projection keeps only its
    rank-r LoRA input (kernels.swiglu). With dropout, every projection also keeps its dropped-out
    LoRA input, and down keeps the SwiGLU output.
    """
    qkv = spec.q_size + 2 * spec.kv_size
    per_token = (
        3 * spec.hidden_size  # layer input, residual, normed input
        + qkv  # projected q, k, v
        + spec.q_size
        + spec.kv_size  # rotated q and k
        + spec.q_size  # attention output
        + 2 * spec.hidden_size  # residual after attention, normed
        + 2 * spec.intermediate_size  # gate/up
    )
    if lora_dropout:
        per_token += 2 * spec.hidden_size + spec.q_size + 2 * spec.intermediate_size
    return tokens * per_token * BF16


def checkpointed_activation_bytes(spec: ModelSpec, tokens: int) -> int:
    """A recomputed layer keeps only its input, the residual stream."""
    return tokens * spec.hidden_size * BF16


def layers_to_checkpoint(
    setting: bool | str,
    spec: ModelSpec,
    tokens: int,
    budget_gb: float | None,
    lora_r: int,
    lora_dropout: float = 0.0,
) -> int:
    """Layers (counted from the first) that recompute in backward."""
    if setting is True:
        return spec.num_layers
    if setting is False or budget_gb is None:
        return 0
    budget = budget_gb * 2**30
    loss_chunk = 2**30  # the fused loss's logits chunk and its working set
    fixed = frozen_weight_bytes(spec) + trainable_state_bytes(spec, lora_r) + loss_chunk
    fixed += spec.num_layers * checkpointed_activation_bytes(spec, tokens)
    # A kept layer's LoRA ops also hold their A and B in bf16 for backward (kernels.linear, .swiglu).
    extra_per_kept = (
        kept_activation_bytes(spec, tokens, lora_dropout)
        + lora_weights_per_layer(spec, lora_r) * BF16
        - checkpointed_activation_bytes(spec, tokens)
    )
    kept = int(max(0, budget - fixed) // max(1, extra_per_kept))
    return spec.num_layers - min(spec.num_layers, kept)
