"""Gated DeltaNet, Qwen3.5's linear-attention mixer (three of its four layers): one grouped projection to
qkv, z, b and a → causal depthwise conv1d + SiLU (reset at document starts) → the chunked gated delta
rule (L2-normalised q and k, decay g and β from a and b, state reset at document starts) → gated
RMSNorm with silu(z) → out_proj.

Training and the prefill run the chunked kernels over whole rows; a decode step advances each row's
conv and delta-rule states by one token. The module also says what the rest of qlora needs of this
kind: its projection groups, its trained norm, its share of the memory plan and its cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.modes import DecodeRows, PrefillRows, Projections
from qlora_cli.model.sizes import BF16, FP32
from qlora_cli.sources.spec import LINEAR_ATTENTION, ModelSpec
from qlora_kernels.conv1d import causal_conv1d, causal_conv1d_step
from qlora_kernels.delta_rule import CHUNK, gated_delta_rule, gated_delta_rule_step
from qlora_kernels.rmsnorm import gated_rms_norm

# The frozen tensors below `linear_attn.` that are no projection -> the mixer's attribute; the conv's
# [C, 1, K] weight is kept as [C, K].
CHECKPOINT_STATE = {"conv1d": "conv_weight", "A_log": "A_log", "dt_bias": "dt_bias", "norm": "norm"}


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """The delta rule's log-decay g = -exp(A_log) * softplus(a + dt_bias), in fp32, and its write
    strength beta = sigmoid(b) in b's dtype, as transformers' Qwen3_5GatedDeltaNet computes them."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


def delta_rule_backward_bytes(spec: ModelSpec, tokens: int) -> int:
    """What the delta rule's backward holds at its peak for one pass over `tokens` of a Gated DeltaNet
    layer (kernels/delta_rule: _chunk_forward with store_states, then _chunk_backward's state pass),
    per value head and token: in the tables' dtype the q·k table and the two transposed squares of
    the per-chunk backward (3 CHUNK), w and its gradient (2 Dk), the corrections and their gradient
    (2 Dv), and the states entering and the gradients leaving each chunk (2 Dk·Dv / CHUNK); in fp32
    u (Dv), the state's dq and dk (2 Dk), db and the cumulative log-decay; and the normalised q and k
    per key head. The chunk solve's T is the forward's, kept with the layer's activations
    (GatedDeltaNet.kept_activations)."""
    linear = spec.linear_attention
    k_dim, v_dim = linear.key_head_dim, linear.value_head_dim
    tables = 3 * CHUNK + 2 * k_dim + 2 * v_dim + 2 * k_dim * v_dim / CHUNK
    per_value_head = tables * BF16 + (v_dim + 2 * k_dim + 2) * FP32
    per_token = linear.num_value_heads * per_value_head + 2 * linear.num_key_heads * k_dim * BF16
    return int(tokens * per_token)


def delta_rule_tokens_per_pass(
    spec: ModelSpec, tokens: int, mlp_backward_bytes: Callable[[ModelSpec, int], int]
) -> int:
    """The most tokens whose delta-rule tables the layer's backward builds at once: as many as fit in
    what the layer's MLP holds in its backward (`mlp_backward_bytes`, its kind's
    backward_working_bytes: a dense MLP's slice, a mixture of experts' routed copies), since the two
    run one after the other. Whole rows, or spans of a long row, pass one after another
    (kernels/delta_rule)."""
    per_token = delta_rule_backward_bytes(spec, CHUNK) / CHUNK
    return max(CHUNK, int(mlp_backward_bytes(spec, tokens) // per_token))


class GatedDeltaNet(nn.Module):
    """A linear-attention layer's mixer: its frozen conv weight, A_log and dt_bias (fp32, filled from
    the checkpoint) and the gated norm's weight."""

    # Its four input projections share one input and run as one grouped NF4 call, as q/k/v do.
    groups = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "out_proj": ("out_proj",)}
    checkpoint_module = "linear_attn"
    norm_modules = ("linear_attn.norm",)

    def __init__(
        self,
        spec: ModelSpec,
        trainable_norms: bool,
        attention_backend: str,
        mlp_backward_bytes: Callable[[ModelSpec, int], int],
    ):
        super().__init__()
        self.spec = spec
        self.mlp_backward_bytes = mlp_backward_bytes
        linear = spec.linear_attention
        self.register_buffer("conv_weight", torch.zeros(linear.conv_dim, linear.conv_kernel))
        self.register_buffer("A_log", torch.zeros(linear.num_value_heads))
        self.register_buffer("dt_bias", torch.zeros(linear.num_value_heads))
        self.norm = nn.Parameter(torch.ones(linear.value_head_dim), requires_grad=trainable_norms)

    def forward(self, h, position_ids, doc_ids, inv_freq, project: Projections, cache):
        linear, eps = self.spec.linear_attention, self.spec.rms_norm_eps
        b, s, _ = h.shape
        k_heads, v_heads = linear.num_key_heads, linear.num_value_heads
        k_dim, v_dim = linear.key_head_dim, linear.value_head_dim
        mixed = project.run(Op.IN_PROJ, "in_proj", h)
        conv_input, z, beta_input, a = mixed.split(
            [linear.conv_dim, linear.value_dim, v_heads, v_heads], dim=-1
        )
        decoding = cache is not None and cache.decoding
        if decoding:
            conv_output = timed(
                Op.CONV1D, causal_conv1d_step, conv_input.reshape(b, -1), cache.conv_state, self.conv_weight
            ).view(b, 1, -1)
        else:
            conv_output = timed(Op.CONV1D, causal_conv1d, conv_input, self.conv_weight, None, doc_ids)
        q, k, v = conv_output.split([linear.key_dim, linear.key_dim, linear.value_dim], dim=-1)
        q, k = q.reshape(b, s, k_heads, k_dim), k.reshape(b, s, k_heads, k_dim)
        v = v.reshape(b, s, v_heads, v_dim)
        g, beta = timed(Op.GATES, decay_and_beta, a, beta_input, self.A_log, self.dt_bias)
        if decoding:
            o = timed(
                Op.DELTA_RULE,
                gated_delta_rule_step,
                q[:, 0],
                k[:, 0],
                v[:, 0],
                g[:, 0],
                beta[:, 0],
                cache.recurrent_state,
            ).unsqueeze(1)
        else:
            o, final_state = timed(
                Op.DELTA_RULE,
                gated_delta_rule,
                q,
                k,
                v,
                g,
                beta,
                doc_ids,
                output_final_state=cache is not None,
                tokens_per_pass=delta_rule_tokens_per_pass(self.spec, b * s, self.mlp_backward_bytes),
            )
            if cache is not None:
                cache.keep_states(conv_input, final_state)
        o = timed(Op.GATES, gated_rms_norm, o, z.reshape(b, s, v_heads, v_dim), self.norm, eps)
        return project.run(Op.OUT_PROJ, "out_proj", o.reshape(b, s, linear.value_dim))

    def trained_norms(self) -> dict[str, nn.Parameter]:
        """The norms an adapter trains, by their module name below `checkpoint_module`."""
        return {"norm": self.norm}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Take the checkpoint's tensor `name` (below `checkpoint_module`) that is no projection."""
        with torch.no_grad():
            target = getattr(self, CHECKPOINT_STATE[name])
            target.copy_(tensor.float().reshape(target.shape))

    @staticmethod
    def shape_problem(spec: ModelSpec) -> str | None:
        return None

    @staticmethod
    def adapter_norms(spec: ModelSpec) -> list[str]:
        """The norm modules of this kind an adapter lists in modules_to_save when norms train."""
        return list(GatedDeltaNet.norm_modules) if spec.linear_attention is not None else []

    @staticmethod
    def trained_norm_weights(spec: ModelSpec) -> int:
        return spec.linear_attention.value_head_dim

    @staticmethod
    def frozen_state_bytes(spec: ModelSpec) -> int:
        """The fp32 conv weight, A_log, dt_bias and norm a layer of this kind holds beside its projections."""
        linear = spec.linear_attention
        return (
            linear.conv_dim * linear.conv_kernel + 2 * linear.num_value_heads + linear.value_head_dim
        ) * FP32

    @staticmethod
    def kept_activations(spec: ModelSpec) -> int:
        """Values a token keeps between the layer's first norm and its second for backward (bf16 units)."""
        linear = spec.linear_attention
        shapes = spec.projection_shapes(LINEAR_ATTENTION)
        return (
            # in_proj's output [qkv | z | b | a]: the conv keeps its qkv, the gated norm its z (in
            # place: kernels.rmsnorm reads a gate's rows of heads by their strides)
            sum(shapes[name][0] for name in GatedDeltaNet.groups["in_proj"])
            + linear.conv_dim  # the conv's output: the delta rule keeps its q, k and v
            + linear.num_value_heads * CHUNK  # and its chunks' T (kernels/delta_rule's solve)
            + 6 * linear.num_value_heads  # the decay g and the fp32 steps that made it, beta
            + linear.value_dim  # the delta rule's output, which the gated norm keeps
            + linear.value_dim  # the gated norm's output, out_proj's input
        )

    @staticmethod
    def output_input_width(spec: ModelSpec) -> int:
        """The width of out_proj's input, which LoRA dropout keeps dropped out."""
        return spec.linear_attention.value_dim

    @staticmethod
    def backward_working_bytes(
        spec: ModelSpec, tokens: int, mlp_backward_bytes: Callable[[ModelSpec, int], int]
    ) -> int:
        """The delta rule's tables for one pass, which its backward holds beside what every layer keeps."""
        per_pass = delta_rule_tokens_per_pass(spec, tokens, mlp_backward_bytes)
        return delta_rule_backward_bytes(spec, min(tokens, per_pass))

    def new_cache(self, batch: int, capacity: int, device, dtype) -> RecurrentStates:
        return RecurrentStates(self.spec, batch, device, dtype)


class RecurrentStates:
    """A Gated DeltaNet layer's states for `batch` rows: the conv's [batch, conv_dim, K] (the last K
    conv inputs, model dtype) and the delta rule's [batch, Hv, Dk, Dv] (fp32)."""

    # A delta rule's final state is one per row: each prompt needs a row of its own.
    recurrent = True

    def __init__(self, spec: ModelSpec, batch: int, device, dtype):
        linear = spec.linear_attention
        self.conv_states = torch.zeros(
            (batch, linear.conv_dim, linear.conv_kernel), dtype=dtype, device=device
        )
        state_shape = (batch, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim)
        self.recurrent_states = torch.zeros(state_shape, dtype=torch.float32, device=device)
        self.batch = batch

    def prefill(self, rows: PrefillRows) -> RecurrentCache:
        return RecurrentCache(self, rows.prompts, prompt_tokens=rows.prompt_tokens)

    def decode(self, rows: DecodeRows, projections: Projections) -> RecurrentCache:
        return RecurrentCache(self, self.batch, projections=projections)


class RecurrentCache:
    """The layer's cache in a pass: views of its rows' conv state `conv_state` [rows, channels, K] and
    delta-rule state `recurrent_state` [rows, Hv, Dk, Dv]. A decode step's kernels update them in place;
    a prefill of right-aligned rows (`prompt_tokens` [rows, seq] marking the tokens that are not
    padding) sets them to its own with `keep_states`, as transformers' cache holds them: the last K
    conv inputs with zeros before the prompt, and the state after the prompt's last token."""

    def __init__(self, states: RecurrentStates, rows: int, *, prompt_tokens=None, projections=None):
        self.conv_state = states.conv_states[:rows]
        self.recurrent_state = states.recurrent_states[:rows]
        self.prompt_tokens, self.projections = prompt_tokens, projections
        self.decoding = projections is not None

    def keep_states(self, conv_input: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        width = self.conv_state.shape[-1]
        last = conv_input[:, -width:] * self.prompt_tokens[:, -width:, None]
        self.conv_state.zero_()
        self.conv_state[:, :, width - last.shape[1] :] = last.transpose(1, 2)
        self.recurrent_state.copy_(recurrent_state)
