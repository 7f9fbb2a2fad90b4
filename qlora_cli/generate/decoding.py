"""The forward passes of generation: a prefill of the prompts, then one-token steps over a KV cache.

Prefill packs every prompt of the batch into one row, each with positions from 0 and a document of
its own, and runs the training layers on it (the same kernels, the same numbers), capturing each
layer's post-RoPE keys and values into the cache. A decode step then feeds one token per row: the
projections go through kernels.nf4_matvec, which at one row reads the 4-bit codes directly (a Triton
kernel launch per weight, plus one adding split-K partial sums) and at several rows dequantizes each
weight and takes cuBLAS (faster on an H200, see that module); LoRA is two skinny products, and
attention reads the row's cached keys up to its own length. Rows keep their own lengths, so
prompts of different lengths decode together without padding. On CUDA the step is captured once per
batch size as a CUDA graph (fixed shapes, the cache preallocated, tokens and positions passed in
tensors) and replayed; on the CPU it runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from qlora_cli.model.decoder import GROUPS, ProjectionGroup, QLoRAModel
from qlora_kernels._dispatch import use_triton
from qlora_kernels.nf4 import NF4Weight, dequantize_nf4
from qlora_kernels.nf4_matvec import nf4_matvec
from qlora_kernels.rmsnorm import add_rms_norm
from qlora_kernels.rope import apply_rope

# The cache grows in steps of this many positions, so later calls of similar size reuse a captured graph.
CAPACITY_STEP = 256

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """Every layer's keys and values, [layers, batch, kv_heads, capacity, head_dim]; position p of a
    row holds that row's token p."""

    def __init__(self, model: QLoRAModel, batch: int, capacity: int):
        spec = model.spec
        device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
        shape = (spec.num_layers, batch, spec.num_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = torch.arange(batch, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.batch, self.capacity = batch, capacity

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """k, v [tokens, kv_heads, head_dim] into (row, position) pairs, no host synchronisation."""
        self.k[layer, rows, :, positions] = k
        self.v[layer, rows, :, positions] = v


class DecodeProjection:
    """A projection group for a few rows: the frozen weights read as they are stored, LoRA as
    (x @ A^T) @ B^T with every adapter of the group in one A and one block-diagonal B, scaling folded in.

    Where the kernels run on their torch references (the CPU, outside Triton's interpreter) the NF4
    weights are dequantized once here: the reference mat-vec would dequantize them at every step, and
    the product is the same either way. Where Triton runs they stay NF4 for nf4_matvec.
    """

    def __init__(self, group: ProjectionGroup, dtype: torch.dtype):
        self.weights = [
            dequantize_nf4(w) if isinstance(w, NF4Weight) and not use_triton(w.packed) else w
            for w in group.weights
        ]
        self.biases = list(group.biases)
        pieces = [
            (index, group.lora_A[name].detach(), group.lora_B[name].detach())
            for index, name in enumerate(group.names)
            if name in group.lora_A
        ]
        self.lora_a = self.lora_b = None
        if not pieces:
            return
        rank = sum(a.shape[0] for _, a, _ in pieces)
        offsets = [0, *torch.tensor(group.out_features).cumsum(0).tolist()]
        lora_b = torch.zeros(offsets[-1], rank, device=pieces[0][1].device)
        column = 0
        for index, a, b in pieces:
            lora_b[offsets[index] : offsets[index + 1], column : column + a.shape[0]] = (
                group.scaling * b.float()
            )
            column += a.shape[0]
        self.lora_a = torch.cat([a for _, a, _ in pieces]).to(dtype)
        self.lora_b = lora_b.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = nf4_matvec(x, self.weights, self.biases)
        if self.lora_a is None:
            return y
        return torch.addmm(y, x @ self.lora_a.T, self.lora_b.T)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor):
    """One query per row over its cached keys: q [B, Hq, D], keys/values [B, Hk, T, D], visible [B, T].

    Query head h reads kv head h // (Hq / Hk), as in training; scores and softmax in fp32.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = (grouped @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1).to(values.dtype) @ values
    return out.reshape(batch, q_heads * head_dim)


class Decoder:
    """The model's prefill and one-token step; holds the decode-ready copies of the LoRA weights."""

    def __init__(self, model: QLoRAModel):
        self.model = model
        self.spec = model.spec
        self.device = model.embed_tokens.device
        dtype = model.embed_tokens.dtype
        self.projections = [
            {group: DecodeProjection(layer.projections[group], dtype) for group in GROUPS}
            for layer in model.layers
        ]

    @torch.inference_mode()
    def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts (one per cache row) through the training layers, packed into one row;
        fills rows [0, len) of the cache and returns each prompt's next-token logits [B, vocab] (fp32)."""
        device = self.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        ids = torch.tensor([token for p in prompts for token in p], device=device)
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(len(ids), device=device) - starts[rows]
        doc_ids = rows[None] if len(prompts) > 1 else None
        layers = self.model.layers
        for index, layer in enumerate(layers):
            layer.kv_capture = self._capture(cache, index, rows, positions)
        try:
            hidden = self.model.hidden_states(ids[None], positions[None], doc_ids)[0]
        finally:
            for layer in layers:
                layer.kv_capture = None
        last = hidden[starts + lengths - 1]
        return (last @ self.model.lm_head.to(last.dtype).T).float()

    @staticmethod
    def _capture(cache: KVCache, index: int, rows: torch.Tensor, positions: torch.Tensor):
        def capture(k: torch.Tensor, v: torch.Tensor) -> None:
            cache.write(index, rows, positions, k[0], v[0])

        return capture

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B] at positions [B] (each row's length so far); returns next-token logits [B, vocab]
        (fp32). Only tensor ops with fixed shapes, so that a CUDA graph can capture it."""
        spec, model = self.spec, self.model
        eps = spec.rms_norm_eps
        batch = tokens.shape[0]
        visible = cache.slots[None, :] <= positions[:, None]
        x = F.embedding(tokens, model.embed_tokens)
        residual = None
        for index, (layer, projections) in enumerate(zip(model.layers, self.projections, strict=True)):
            h, residual = add_rms_norm(x, residual, layer.input_layernorm, eps)
            qkv = projections["qkv"](h).view(batch, 1, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim)
            q, k, v = qkv.split([spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], dim=2)
            q, k = apply_rope(q, k, positions[:, None], model.inv_freq, layer.q_norm, layer.k_norm, eps)
            cache.write(index, cache.rows, positions, k[:, 0], v[:, 0])
            attn = decode_attention(q[:, 0], cache.k[index], cache.v[index], visible)
            x = projections["o"](attn)
            h, residual = add_rms_norm(x, residual, layer.post_attention_layernorm, eps)
            gate, up = projections["gate_up"](h).chunk(2, dim=-1)
            x = projections["down"](F.silu(gate) * up)
        h, _ = add_rms_norm(x, residual, model.norm, eps)
        return (h @ model.lm_head.to(h.dtype).T).float()


class GraphedStep:
    """Decoder.step on one cache, captured as a CUDA graph: tokens and positions are copied into
    static inputs, the replay writes the cache and the static logits."""

    def __init__(self, decoder: Decoder, cache: KVCache):
        device = decoder.device
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(cache.batch, dtype=torch.long, device=device)
        # Warm-up calls compile and tune the Triton kernels before capture; they write position 0 of
        # each row, which the prefill overwrites.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decoder.step(cache, self.tokens, self.positions)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.step(cache, self.tokens, self.positions)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits


class DecodingEngine:
    """Caches and steps for a model: one cache per batch size, grown as calls need, and on CUDA its
    captured step, kept for the next call of that size (a chat's turns, the next batch of prompts)."""

    def __init__(self, model: QLoRAModel, *, cuda_graphs: bool | None = None):
        self.decoder = Decoder(model)
        self.max_positions = model.spec.max_position_embeddings
        device = self.decoder.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._prepared: dict[int, tuple[KVCache, StepFn]] = {}

    def prepare(self, batch: int, tokens: int) -> tuple[KVCache, StepFn]:
        """A cache of `batch` rows holding at least `tokens` positions, and the step that feeds it."""
        found = self._prepared.get(batch)
        if found is not None and found[0].capacity >= tokens:
            return found
        self._prepared.pop(batch, None)
        capacity = min(self.max_positions, math.ceil(tokens / CAPACITY_STEP) * CAPACITY_STEP)
        cache = KVCache(self.decoder.model, batch, capacity)
        if self.cuda_graphs:
            step: StepFn = GraphedStep(self.decoder, cache)
        else:

            def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                return self.decoder.step(cache, tokens, positions)

        self._prepared[batch] = (cache, step)
        return cache, step

    def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.decoder.prefill(cache, prompts)
