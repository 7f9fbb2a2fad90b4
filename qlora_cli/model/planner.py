"""GPU memory of a training step: how many layers recompute, whether their inputs go to host
memory, and the peak that follows.

Recomputing a layer costs about a third more of its forward time; keeping its activations costs
memory. With `gradient_checkpointing: auto` we keep as many layers as the budget holds. A
recomputed layer keeps only its input, and with `activation_offloading` not even that: it waits in
pinned host memory (qlora_cli/model/offload.py), copied while the GPU computes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qlora_cli.model.lora import LoRAConfig
from qlora_cli.model.mixers import MIXERS
from qlora_cli.model.mlps import MLPS
from qlora_cli.model.sizes import BF16
from qlora_cli.sources.spec import DENSE_MLP, FULL_ATTENTION, ModelSpec
from qlora_kernels.formats import NF4

LOSS_WORKING = 400 << 20  # the fused loss's logits chunk and its working set, measured
RERUN_ROWS = 6  # rows of hidden_size a layer's rerun holds beside its mixer's activations, fitted
HOST_SHARE = 0.5  # at most this share of the host's available memory is pinned for offloading


@dataclass(frozen=True)
class RunShape:
    """What the planner needs of a run besides the model: one micro-batch's tokens, the adapter's shape
    (rank, targets, dropout, trained norms) and the memory budget (None: no budget)."""

    tokens: int  # micro_batch_size × sequence_len
    lora: LoRAConfig
    budget_gb: float | None = None


def frozen_weight_bytes(spec: ModelSpec) -> int:
    """NF4 projections (at the format's bytes a weight, absmax included) of each layer's kind, bf16
    embeddings, and what each layer's mixer holds beside (a Gated DeltaNet layer's fp32 conv weight,
    A_log, dt_bias and norm)."""
    weights = sum(
        out * inp for kind in spec.layer_kinds for out, inp in spec.projection_shapes(*kind).values()
    )
    # A MoE layer's routed experts are NF4 as the projections are; its router stays in the compute
    # dtype, counted at NF4's rate here (E x hidden, small beside the experts).
    weights += spec.routed_expert_weights()
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    mixer_state = sum(MIXERS[kind].frozen_state_bytes(spec) for kind in spec.layer_types)
    return int(weights * NF4.bytes_per_weight) + embeddings * BF16 + mixer_state


def trainable_state_bytes(spec: ModelSpec, lora: LoRAConfig) -> int:
    """The trained weights in fp32, their gradients and two AdamW moments."""
    return lora.trained_weights(spec) * 4 * 4


def kept_activation_bytes(
    spec: ModelSpec, tokens: int, lora_dropout: float = 0.0, kind: str = FULL_ATTENTION, mlp: str = DENSE_MLP
) -> int:
    """What one layer of `kind` and `mlp` saves for backward when it is not recomputed (bf16).

    Without LoRA dropout the SwiGLU output is not kept: the down projection keeps only its
    rank-r LoRA input (kernels.swiglu). With dropout, every projection also keeps its dropped-out
    LoRA input, and down keeps the SwiGLU output (a MoE layer's shared expert's, whose width is its
    spec's intermediate_size). A Gated DeltaNet layer's delta rule keeps its inputs and its chunks'
    T (kernels/delta_rule recomputes its other chunk tables in backward).
    """
    per_token = (
        3 * spec.hidden_size  # layer input, residual, normed input
        + MIXERS[kind].kept_activations(spec)
        + 2 * spec.hidden_size  # residual after the mixer, normed
        + MLPS[mlp].kept_activations(spec)
    )
    if lora_dropout:
        mixer_output_input = MIXERS[kind].output_input_width(spec)
        per_token += 2 * spec.hidden_size + mixer_output_input + 2 * spec.intermediate_size
    return tokens * per_token * BF16


def checkpointed_activation_bytes(spec: ModelSpec, tokens: int) -> int:
    """A recomputed layer keeps only its input, the residual stream."""
    return tokens * spec.hidden_size * BF16


def recomputed_layer_bytes(spec: ModelSpec, tokens: int, offload: bool) -> int:
    """What a recomputed layer holds on the GPU between its forward and its backward."""
    return 0 if offload else checkpointed_activation_bytes(spec, tokens)


def kept_layer_bytes(
    spec: ModelSpec, shape: RunShape, kind: str = FULL_ATTENTION, mlp: str = DENSE_MLP
) -> int:
    """A kept layer's activations, and the bf16 copies of its LoRA A and B that its ops hold for
    backward (kernels.linear, kernels.swiglu)."""
    activations = kept_activation_bytes(spec, shape.tokens, shape.lora.dropout, kind, mlp)
    activations += shape.tokens * MLPS[mlp].lora_kept_activations(spec, shape.lora) * BF16
    return activations + shape.lora.lora_weights_per_layer(spec, kind, mlp) * BF16


def working_bytes(spec: ModelSpec, tokens: int, offload: bool) -> int:
    """The most one layer's backward holds at once beside what every layer keeps.

    Fitted to peaks measured on an H200 at Qwen2.5-7B (8K, 16K and 32K tokens) and checked at
    1.5B and at 7B 128K, 8 % under (benchmarks/RESULTS.md; at 256K it is 15 % under): the rerun's
    activations and their gradients come to its mixer's kept activations and 6 rows of hidden_size a
    token (9.5 rows at Qwen2.5-7B, whose attention keeps 3.4; a Gated DeltaNet mixer keeps 8 at
    Qwen3.5-9B); the MLP holds what its kind's backward_working_bytes says (a dense one gate/up's
    output and its gradient, 4 × intermediate_size, for one slice of tokens: qlora_cli/model/sliced_mlp.py); offloaded inputs land in two buffers; the
    shared scratch holds the largest dequantized weight; the fused loss works in fixed chunks. A
    Gated DeltaNet layer's backward holds the delta rule's tables instead of the MLP's (the two run
    one after the other), built in passes that fit in the MLP's bytes (the mixer's
    backward_working_bytes): within 5 % of the peaks measured at Qwen3.5-9B's shape
    (tests/test_memory.py).
    """
    kinds = set(spec.layer_types)
    rerun = RERUN_ROWS * spec.hidden_size + max(MIXERS[kind].kept_activations(spec) for kind in kinds)
    per_token = rerun + (2 * spec.hidden_size if offload else 0)
    mlp = max(MLPS[kind].backward_working_bytes(spec, tokens) for kind in set(spec.mlp_types))
    scratch = max(
        out * inp for kind in spec.layer_kinds for out, inp in spec.projection_shapes(*kind).values()
    )
    mixer = max(
        MIXERS[kind].backward_working_bytes(spec, tokens, MLPS[mlp_kind].backward_working_bytes)
        for kind, mlp_kind in set(spec.layer_kinds)
    )
    return int((tokens * per_token + scratch) * BF16) + max(mlp, mixer) + LOSS_WORKING


def fixed_bytes(spec: ModelSpec, lora: LoRAConfig) -> int:
    return frozen_weight_bytes(spec) + trainable_state_bytes(spec, lora)


def estimated_peak_bytes(spec: ModelSpec, shape: RunShape, recomputed: int, *, offload: bool = False) -> int:
    """The planner's estimate of a step's peak GPU memory (allocated, not reserved); the first `recomputed`
    layers recompute, the rest keep what their kind saves."""
    kept = sum(kept_layer_bytes(spec, shape, *kind) for kind in spec.layer_kinds[recomputed:])
    return (
        fixed_bytes(spec, shape.lora)
        + kept
        + recomputed * recomputed_layer_bytes(spec, shape.tokens, offload)
        + working_bytes(spec, shape.tokens, offload and recomputed > 0)
    )


def longest_micro_batch(spec: ModelSpec, shape: RunShape, limit_bytes: float, *, offload: bool) -> int:
    """The most tokens a micro-batch (micro_batch_size × sequence_len) may hold, up to `shape`'s, for the
    planner's peak with every layer recomputed to stay within `limit_bytes`; 0 where even one token is
    over (the weights, the adapter's state and the fixed working buffers)."""

    def fits(tokens: int) -> bool:
        return (
            estimated_peak_bytes(spec, replace(shape, tokens=tokens), spec.num_layers, offload=offload)
            <= limit_bytes
        )

    fitting, over = 0, shape.tokens + 1
    while over - fitting > 1:
        middle = (fitting + over) // 2
        fitting, over = (middle, over) if fits(middle) else (fitting, middle)
    return fitting


def layers_to_checkpoint(
    setting: bool | str, spec: ModelSpec, shape: RunShape, *, offload: bool = False
) -> int:
    """Layers (counted from the first) that recompute in backward."""
    if setting is True:
        return spec.num_layers
    if setting is False or shape.budget_gb is None:
        return 0
    for recomputed in range(spec.num_layers + 1):
        if estimated_peak_bytes(spec, shape, recomputed, offload=offload) <= shape.budget_gb * 2**30:
            return recomputed
    return spec.num_layers


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def offloads_activations(
    setting: bool | str, checkpointing: bool | str, spec: ModelSpec, shape: RunShape, device_type: str
) -> bool:
    """`auto`: offload on a GPU whenever layers recompute, if the host has room to pin their inputs.

    The copies run beside the compute, so they cost no time; what they free lets a budget keep more
    layers. `true` offloads on any device (on the CPU it only exercises the bookkeeping).
    """
    if setting != "auto":
        return bool(setting)
    if device_type != "cuda":
        return False
    if layers_to_checkpoint(checkpointing, spec, shape) == 0:
        return False
    host = host_available_bytes()
    pinned = spec.num_layers * checkpointed_activation_bytes(spec, shape.tokens)
    return host is None or pinned <= HOST_SHARE * host
