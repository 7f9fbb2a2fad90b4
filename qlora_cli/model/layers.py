"""The decoder layer: its sequence of ops, written once for training, generation's prefill and its decode step.

fused residual-add + RMSNorm → the mixer → fused residual-add + RMSNorm → gate/up projection →
SwiGLU → down projection. The mixer is attention or, in three of four Qwen3.5 layers, Gated DeltaNet:

- attention: QKV projection (+bias, + LoRA) → QK-norm + RoPE → [cache update] → causal GQA attention
  (→ Qwen3.5's output gate, attn · sigmoid(gate), the gate taken per head from q_proj) → O projection;
- Gated DeltaNet: one grouped projection to qkv, z, b and a → causal depthwise conv1d + SiLU (reset at
  document starts) → the chunked gated delta rule (L2-normalised q and k, decay g and β from a and b,
  state reset at document starts) → gated RMSNorm with silu(z) → out_proj.

What differs by mode is which kernels run an op, never the order:

- training and the prefill run the layer's own projection groups through the fused NF4 + LoRA
  kernels (`FusedProjections`) and packed causal attention;
- a decode step (one token a row) runs generation's decode copies of the projections and attends
  to each row's cached keys (`decode_attention`); both come with its cache.

Every op goes through `kernels`, which picks Triton on CUDA and the torch reference on the CPU, so
this file reads the same on both. `timed` names each op for `qlora profile` and calls it straight
through when profiling is off.
"""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.lora import LAYER_GROUPS, LoRAConfig, ProjectionGroup
from qlora_cli.model.sliced_mlp import SlicedMLP, slice_tokens
from qlora_cli.sources.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from qlora_kernels.attention import MAX_HEAD_DIM, attention
from qlora_kernels.conv1d import causal_conv1d, causal_conv1d_step
from qlora_kernels.delta_rule import gated_delta_rule, gated_delta_rule_step
from qlora_kernels.rmsnorm import add_rms_norm, gated_rms_norm
from qlora_kernels.rope import apply_rope
from qlora_kernels.sigmoid_gate import sigmoid_gate
from qlora_kernels.swiglu import lora_swiglu

# Each layer's projection groups take salts index * SALTS_PER_LAYER + i for LoRA dropout's masks.
SALTS_PER_LAYER = 4


class Projections(Protocol):
    """How one mode runs a layer's projections, in the layer's order. gate_up's result goes to swiglu
    and swiglu's to down as they are, so a mode may hand partial results along (the training kernels
    finish gate/up's LoRA inside SwiGLU). `token_offset` is the first token's index in the row, for
    LoRA dropout's masks when the MLP runs in slices."""

    def qkv(self, h: torch.Tensor) -> torch.Tensor: ...

    def o(self, attn: torch.Tensor) -> torch.Tensor: ...

    def in_proj(self, h: torch.Tensor) -> torch.Tensor: ...

    def out_proj(self, o: torch.Tensor) -> torch.Tensor: ...

    def gate_up(self, h: torch.Tensor, token_offset: int): ...

    def swiglu(self, gate_up): ...

    def down(self, activation, token_offset: int) -> torch.Tensor: ...


class LayerCache(Protocol):
    """One layer's share of generation's cache (qlora_cli/generate/decoding.py), handed to its forward.

    An attention layer's: `update` stores the pass's post-RoPE keys and values and returns those to
    attend over. In a prefill (`decoding` False) they are the packed prompts' own; in a decode step,
    every cached key and value of each row, of which `visible` [rows, capacity] says which the row's
    query sees: its own so far, within the model's sliding window if it has one, as in the prefill.
    `projections` are the decode kernels' copies of this layer's projections.

    A Gated DeltaNet layer's keeps `conv_state` [rows, channels, K] (the last K inputs of the conv)
    and `recurrent_state` [rows, Hv, Dk, Dv] (fp32); a decode step updates both in place, and a
    prefill hands its conv inputs and final states to `keep_states`.
    """

    decoding: bool
    visible: torch.Tensor
    projections: Projections
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def keep_states(self, conv_input: torch.Tensor, recurrent_state: torch.Tensor) -> None: ...


def head_size_problem(spec: ModelSpec) -> str | None:
    """Why the attention kernels cannot take the model's heads, or None: said before anything loads,
    instead of a traceback from the first packed micro-batch."""
    if FULL_ATTENTION in spec.layer_types and spec.head_dim > MAX_HEAD_DIM:
        return f"config.json: head_dim {spec.head_dim} is above {MAX_HEAD_DIM}, the largest head qlora's attention takes"
    return None


def choose_attention_backend(setting: str, doc_ids: torch.Tensor | None) -> str:
    """`auto`: torch's fused attention for rows of one document, our kernel for packed rows.

    benchmarks/RESULTS.md has the numbers: sdpa is faster on plain causal rows, ours on packed rows,
    where sdpa needs a materialized mask.
    """
    if setting != "auto":
        return setting
    return "sdpa" if doc_ids is None else "triton"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """One query per row over its cached keys: q [B, 1, Hq, D], k/v [B, Hk, T, D], visible [B, T];
    returns [B, Hq * D].

    Query head h reads kv head h // (Hq / Hk), as in training; scores and softmax in fp32.
    """
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = (grouped @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    return out.reshape(batch, q_heads * head_dim)


class FusedProjections:
    """A layer's projection groups through the training kernels (qlora_kernels.linear and .swiglu):
    NF4 GEMMs with LoRA fused, LoRA dropout drawn from `dropout_seed`. Training and the prefill run these.

    The MLP's LoRA is split across ops: gate/up stops at t = x @ A^T, SwiGLU adds gate/up's B and
    takes down's A, and down starts from that. Down's LoRA input is SwiGLU's output itself unless
    LoRA dropout is on; then down runs its own LoRA. In a recompute (the layer's `recomputing`)
    down's GEMM is skipped: nothing reads the layer's output there.
    """

    def __init__(self, layer: DecoderLayer, dropout_seed: torch.Tensor | None):
        self.layer = layer
        self.groups = layer.projections
        self.dropout_seed = dropout_seed
        down = self.groups["down"]
        self.down_a = down.lora_A.get("down_proj")
        self.fuse_down = self.down_a is not None and not (down.dropout and layer.training)

    def qkv(self, h):
        return timed(Op.QKV_GEMM, self.groups["qkv"], h, dropout_seed=self.dropout_seed)

    def o(self, attn):
        return timed(Op.O_PROJ, self.groups["o"], attn, dropout_seed=self.dropout_seed)

    def in_proj(self, h):
        return timed(Op.QKV_GEMM, self.groups["in_proj"], h, dropout_seed=self.dropout_seed)

    def out_proj(self, o):
        return timed(Op.O_PROJ, self.groups["out_proj"], o, dropout_seed=self.dropout_seed)

    def gate_up(self, h, token_offset):
        group = self.groups["gate_up"]
        dropout = dict(dropout_seed=self.dropout_seed, token_offset=token_offset)
        return timed(Op.GATE_UP_GEMM, group, h, keep_lora_t=True, **dropout)

    def swiglu(self, gate_up):
        gate_up_out, gate_up_t = gate_up
        group = self.groups["gate_up"]
        return timed(
            Op.SILU,
            lora_swiglu,
            gate_up_out,
            gate_up_t,
            group.lora_B.get("gate_proj"),
            group.lora_B.get("up_proj"),
            group.scaling,
            self.down_a if self.fuse_down else None,
            need_output=not (self.layer.recomputing and self.fuse_down),
        )

    def down(self, activation, token_offset):
        activation, down_t = activation
        group, need_output = self.groups["down"], not self.layer.recomputing
        if self.fuse_down:
            return timed(Op.DOWN_GEMM, group, activation, need_output=need_output, lora_t=down_t)
        dropout = dict(dropout_seed=self.dropout_seed, token_offset=token_offset)
        return timed(Op.DOWN_GEMM, group, activation, need_output=need_output, **dropout)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """The delta rule's log-decay g = -exp(A_log) * softplus(a + dt_bias), in fp32, and its write
    strength beta = sigmoid(b) in b's dtype, as transformers' Qwen3_5GatedDeltaNet computes them."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, lora: LoRAConfig | None, attention_backend: str, index: int = 0):
        super().__init__()
        self.spec = spec
        self.kind = spec.layer_types[index]
        self.attention_backend = attention_backend
        self.attention_scaling = spec.rope_frequencies()[1]
        shapes = spec.projection_shapes(self.kind)
        groups = LAYER_GROUPS[self.kind]
        self.projections = nn.ModuleDict(
            {
                g: ProjectionGroup(names, shapes, lora, salt=index * SALTS_PER_LAYER + i)
                for i, (g, names) in enumerate(groups.items())
            }
        )
        trainable = bool(lora and lora.train_norms)
        h = spec.hidden_size
        self.input_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        self.q_norm = self.k_norm = None
        if self.kind == LINEAR_ATTENTION:
            linear = spec.linear_attention
            # The frozen parts of a Gated DeltaNet mixer; the checkpoint fills them (fp32).
            self.register_buffer("conv_weight", torch.zeros(linear.conv_dim, linear.conv_kernel))
            self.register_buffer("A_log", torch.zeros(linear.num_value_heads))
            self.register_buffer("dt_bias", torch.zeros(linear.num_value_heads))
            self.linear_norm = nn.Parameter(torch.ones(linear.value_head_dim), requires_grad=trainable)
        elif spec.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable)
            self.k_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable)
        self.recomputing = False

    def checkpoint_contexts(self):
        """torch.utils.checkpoint's context_fn: the forward runs as usual; the rerun in backward sets
        `recomputing`, since only the tensors backward saves are kept from it, so the layer's last GEMM
        (down_proj) need not produce y."""
        return contextlib.nullcontext(), self.recomputation()

    @contextlib.contextmanager
    def recomputation(self):
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False

    def forward(
        self,
        x,
        residual,
        position_ids,
        doc_ids,
        inv_freq,
        dropout_seed=None,
        cache: LayerCache | None = None,
    ):
        """(x, residual) [batch, seq, hidden] in and out. `cache` is None in training; in generation
        it keeps this layer's keys and values (or conv and recurrent states), and a decode step's
        cache brings the decode kernels."""
        eps, zero_centred = self.spec.rms_norm_eps, self.spec.zero_centred_norms
        decoding = cache is not None and cache.decoding
        project = cache.projections if decoding else FusedProjections(self, dropout_seed)
        norm = dict(zero_centred=zero_centred)
        h, residual = timed(Op.RMSNORM_ATTN, add_rms_norm, x, residual, self.input_layernorm, eps, **norm)
        if self.kind == LINEAR_ATTENTION:
            x = self._gated_deltanet(h, doc_ids, project, cache)
        else:
            x = self._attention(h, position_ids, doc_ids, inv_freq, project, cache)
        h, residual = timed(
            Op.RMSNORM_FFN, add_rms_norm, x, residual, self.post_attention_layernorm, eps, **norm
        )
        return self._mlp(h, project), residual

    def _attention(self, h, position_ids, doc_ids, inv_freq, project: Projections, cache):
        spec = self.spec
        b, s, _ = h.shape
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_heads = 2 * heads if spec.attention_output_gate else heads
        qkv = project.qkv(h).view(b, s, q_heads + 2 * kv_heads, head_dim)
        q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=2)
        gate = None
        if spec.attention_output_gate:
            # q_proj holds query and gate interleaved per head: [h·2d, h·2d + d) is head h's query.
            query_and_gate = q.view(b, s, heads, 2 * head_dim)
            q, gate = query_and_gate[..., :head_dim], query_and_gate[..., head_dim:]
        q, k = timed(
            Op.ROPE,
            apply_rope,
            q,
            k,
            position_ids,
            inv_freq,
            self.q_norm,
            self.k_norm,
            spec.rms_norm_eps,
            zero_centred_norm=spec.zero_centred_norms,
            attention_scaling=self.attention_scaling,
        )
        decoding = cache is not None and cache.decoding
        if cache is not None:
            k, v = cache.update(k, v)
        if decoding:
            attn = timed(Op.ATTENTION, decode_attention, q, k, v, cache.visible)
        else:
            backend = choose_attention_backend(self.attention_backend, doc_ids)
            window = spec.sliding_window
            attn = timed(Op.ATTENTION, attention, q, k, v, doc_ids, backend=backend, window=window)
        if gate is not None:
            attn = timed(Op.GATES, sigmoid_gate, attn.reshape(b, s, heads, head_dim), gate)
        return project.o(attn.reshape(b, s, spec.q_size))

    def _gated_deltanet(self, h, doc_ids, project: Projections, cache):
        linear, eps = self.spec.linear_attention, self.spec.rms_norm_eps
        b, s, _ = h.shape
        k_heads, v_heads = linear.num_key_heads, linear.num_value_heads
        k_dim, v_dim = linear.key_head_dim, linear.value_head_dim
        mixed = project.in_proj(h)
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
            )
            if cache is not None:
                cache.keep_states(conv_input, final_state)
        o = timed(Op.GATES, gated_rms_norm, o, z.reshape(b, s, v_heads, v_dim), self.linear_norm, eps)
        return project.out_proj(o.reshape(b, s, linear.value_dim))

    def _mlp(self, h, project: Projections):
        """The MLP, over slices of tokens when the row is long (qlora_cli/model/sliced_mlp.py)."""
        tokens = h.numel() // h.shape[-1]
        per_slice = slice_tokens(tokens, self.spec.intermediate_size, h.element_size())
        if per_slice == tokens:
            return self._mlp_whole(h, project)
        mlp = [self.projections["gate_up"], self.projections["down"]]
        trainables = [p for group in mlp for p in group.parameters() if p.requires_grad]

        def mlp_slice(part, token_offset):
            return self._mlp_whole(part, project, token_offset)

        return SlicedMLP.apply(mlp_slice, self.recomputation, self.recomputing, per_slice, h, *trainables)

    @staticmethod
    def _mlp_whole(h, project: Projections, token_offset=0):
        gate_up = project.gate_up(h, token_offset)
        return project.down(project.swiglu(gate_up), token_offset)
