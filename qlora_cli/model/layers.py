"""The decoder layer: its sequence of ops, written once for training, generation's prefill and its decode step.

fused residual-add + RMSNorm → QKV projection (+bias, + LoRA) → QK-norm + RoPE → [cache update] →
causal GQA attention → O projection → fused residual-add + RMSNorm → gate/up projection → SwiGLU →
down projection. What differs by mode is which kernels run an op, never the order:

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
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.lora import GROUPS, LoRAConfig, ProjectionGroup
from qlora_cli.model.sliced_mlp import SlicedMLP, slice_tokens
from qlora_cli.sources.weights import ModelSpec
from qlora_kernels.attention import attention
from qlora_kernels.rmsnorm import add_rms_norm
from qlora_kernels.rope import apply_rope
from qlora_kernels.swiglu import lora_swiglu


class Projections(Protocol):
    """How one mode runs a layer's projections, in the layer's order. gate_up's result goes to swiglu
    and swiglu's to down as they are, so a mode may hand partial results along (the training kernels
    finish gate/up's LoRA inside SwiGLU). `token_offset` is the first token's index in the row, for
    LoRA dropout's masks when the MLP runs in slices."""

    def qkv(self, h: torch.Tensor) -> torch.Tensor: ...

    def o(self, attn: torch.Tensor) -> torch.Tensor: ...

    def gate_up(self, h: torch.Tensor, token_offset: int): ...

    def swiglu(self, gate_up): ...

    def down(self, activation, token_offset: int) -> torch.Tensor: ...


class LayerCache(Protocol):
    """One layer's share of generation's cache (qlora_cli/generate/decoding.py), handed to its forward.

    `update` stores the pass's post-RoPE keys and values and returns those to attend over. In a
    prefill (`decoding` False) they are the packed prompts' own; in a decode step, every cached key
    and value of each row, of which `visible` [rows, capacity] says which are the row's so far, and
    `projections` are the decode kernels' copies of this layer's projections.
    """

    decoding: bool
    visible: torch.Tensor
    projections: Projections

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


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


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, lora: LoRAConfig | None, attention_backend: str, index: int = 0):
        super().__init__()
        self.spec = spec
        self.attention_backend = attention_backend
        shapes = spec.projection_shapes()
        self.projections = nn.ModuleDict(
            {
                g: ProjectionGroup(names, shapes, lora, salt=index * len(GROUPS) + i)
                for i, (g, names) in enumerate(GROUPS.items())
            }
        )
        trainable = bool(lora and lora.train_norms)
        h = spec.hidden_size
        self.input_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        if spec.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable)
            self.k_norm = nn.Parameter(torch.ones(spec.head_dim), requires_grad=trainable)
        else:
            self.q_norm = self.k_norm = None
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
        it keeps this layer's keys and values, and a decode step's cache brings the decode kernels."""
        spec = self.spec
        b, s, _ = x.shape
        eps = spec.rms_norm_eps
        decoding = cache is not None and cache.decoding
        project = cache.projections if decoding else FusedProjections(self, dropout_seed)
        h, residual = timed(Op.RMSNORM_ATTN, add_rms_norm, x, residual, self.input_layernorm, eps)
        qkv = project.qkv(h).view(b, s, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim)
        q, k, v = qkv.split([spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], dim=2)
        q, k = timed(Op.ROPE, apply_rope, q, k, position_ids, inv_freq, self.q_norm, self.k_norm, eps)
        if cache is not None:
            k, v = cache.update(k, v)
        if decoding:
            attn = timed(Op.ATTENTION, decode_attention, q, k, v, cache.visible)
        else:
            backend = choose_attention_backend(self.attention_backend, doc_ids)
            attn = timed(Op.ATTENTION, attention, q, k, v, doc_ids, backend=backend)
        x = project.o(attn.reshape(b, s, spec.q_size))
        h, residual = timed(Op.RMSNORM_FFN, add_rms_norm, x, residual, self.post_attention_layernorm, eps)
        return self._mlp(h, project), residual

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
