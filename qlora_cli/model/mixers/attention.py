"""Softmax attention, the mixer of every family's layers (of one in four of Qwen3.5's): QKV projection
(+bias, + LoRA) → QK-norm + RoPE → [cache update] → causal GQA attention (→ Qwen3.5's output gate,
attn · sigmoid(gate), the gate taken per head from q_proj) → O projection.

Training and the prefill attend over the packed rows themselves (`attention`); a decode step attends
to each row's cached keys (`decode_attention`). The module also says what the rest of qlora needs of
this kind: its projection groups, its trained norms, its share of the memory plan and its cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.modes import DecodeRows, PrefillRows, Projections
from qlora_cli.sources.spec import FULL_ATTENTION, ModelSpec
from qlora_kernels.attention import MAX_HEAD_DIM, attention
from qlora_kernels.rope import apply_rope
from qlora_kernels.sigmoid_gate import sigmoid_gate


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


class Attention(nn.Module):
    """An attention layer's mixer, with its QK-norm weights where the family has them."""

    # Its projection groups in the order it runs them, named as the checkpoint names the projections
    # below `checkpoint_module`.
    groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)}
    checkpoint_module = "self_attn"
    # The norms an adapter may list in modules_to_save.
    norm_modules = ("q_norm", "k_norm")

    def __init__(
        self,
        spec: ModelSpec,
        trainable_norms: bool,
        attention_backend: str,
        mlp_backward_bytes: Callable[[ModelSpec, int], int],
    ):
        super().__init__()
        self.spec = spec
        self.attention_backend = attention_backend
        self.attention_scaling = spec.rope_frequencies()[1]
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable_norms)
            self.k_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable_norms)

    def forward(self, h, position_ids, doc_ids, inv_freq, project: Projections, cache):
        spec = self.spec
        b, s, _ = h.shape
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_heads = 2 * heads if spec.attention_output_gate else heads
        qkv = project.run(Op.QKV_GEMM, "qkv", h).view(b, s, q_heads + 2 * kv_heads, head_dim)
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
        return project.run(Op.O_PROJ, "o", attn.reshape(b, s, spec.q_size))

    def trained_norms(self) -> dict[str, nn.Parameter]:
        """The norms an adapter trains, by their module name below `checkpoint_module`."""
        return {} if self.q_norm is None else {"q_norm": self.q_norm, "k_norm": self.k_norm}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Take the checkpoint's tensor `name` (below `checkpoint_module`) that is no projection."""
        with torch.no_grad():
            getattr(self, name).copy_(tensor.float())

    @staticmethod
    def shape_problem(spec: ModelSpec) -> str | None:
        """Why the attention kernels cannot take the model's heads, or None."""
        if spec.head_dim > MAX_HEAD_DIM:
            return f"config.json: head_dim {spec.head_dim} is above {MAX_HEAD_DIM}, the largest head qlora's attention takes"
        return None

    @staticmethod
    def adapter_norms(spec: ModelSpec) -> list[str]:
        """The norm modules of this kind an adapter lists in modules_to_save when norms train."""
        return list(Attention.norm_modules) if spec.qk_norm else []

    @staticmethod
    def trained_norm_weights(spec: ModelSpec) -> int:
        return 2 * spec.head_dim if spec.qk_norm else 0

    @staticmethod
    def frozen_state_bytes(spec: ModelSpec) -> int:
        """What a layer of this kind holds beside its projections (none)."""
        return 0

    @staticmethod
    def kept_activations(spec: ModelSpec) -> int:
        """Values a token keeps between the layer's first norm and its second for backward (bf16 units)."""
        gate = spec.q_size if spec.attention_output_gate else 0
        qkv = spec.projection_shapes(FULL_ATTENTION)
        return (
            sum(qkv[name][0] for name in Attention.groups["qkv"])  # projected q (and its output gate), k, v
            + spec.q_size
            + spec.kv_size  # rotated q and k
            + spec.q_size  # attention output
            + gate  # the gated attention output, o_proj's input
        )

    @staticmethod
    def output_input_width(spec: ModelSpec) -> int:
        """The width of o_proj's input, which LoRA dropout keeps dropped out."""
        return spec.q_size

    @staticmethod
    def backward_working_bytes(
        spec: ModelSpec, tokens: int, mlp_backward_bytes: Callable[[ModelSpec, int], int]
    ) -> int:
        """What its backward holds beyond the activations the planner counts for every layer (none)."""
        return 0

    def new_cache(self, batch: int, capacity: int, device, dtype) -> KeyValueCache:
        return KeyValueCache(self.spec, batch, capacity, device, dtype)


class KeyValueCache:
    """An attention layer's keys and values for `batch` rows [batch, kv_heads, capacity, head_dim],
    position p of a row holding that row's token p: post-RoPE, as the layer attends over them."""

    # Rows may pack several prompts: attention keeps each document to itself.
    recurrent = False

    def __init__(self, spec: ModelSpec, batch: int, capacity: int, device, dtype):
        shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = torch.arange(batch, device=device)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """k, v [..., kv_heads, head_dim] into (row, position) pairs, rows and positions shaped as k's
        leading dims; no host synchronisation."""
        self.keys[rows, :, positions] = k
        self.values[rows, :, positions] = v

    def prefill(self, rows: PrefillRows) -> PrefillCache:
        return PrefillCache(self, rows)

    def decode(self, rows: DecodeRows, projections: Projections) -> DecodeCache:
        return DecodeCache(self, rows, projections)


class PrefillCache:
    """The layer's cache in the prefill: stores the prompts' keys and values at their (row, position);
    attention runs over the prompts themselves, as in training."""

    decoding = False

    def __init__(self, cache: KeyValueCache, rows: PrefillRows):
        self.cache, self.rows = cache, rows

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.rows.prompt_tokens
        self.cache.write(self.rows.rows, self.rows.positions, k[kept], v[kept])
        return k, v


class DecodeCache:
    """The layer's cache in a decode step: stores each row's new key and value at its position and
    hands back all of the layer's cached keys and values, `visible` marking each row's so far."""

    decoding = True

    def __init__(self, cache: KeyValueCache, rows: DecodeRows, projections: Projections):
        self.cache, self.positions, self.visible = cache, rows.positions, rows.visible
        self.projections = projections

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write(self.cache.rows[:, None], self.positions, k, v)
        return self.cache.keys, self.cache.values
