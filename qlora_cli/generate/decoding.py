"""The forward passes of generation: a prefill of the prompts, then one-token steps over a KV cache.

Both run the model's own layers (qlora_cli/model/layers.py), each handed its share of the cache; the
cache's mode picks the kernels. Prefill packs every prompt of the batch into one row, each with
positions from 0 and a document of its own, and runs the training kernels on it (the same numbers);
each layer's cache stores the post-RoPE keys and values. A decode step then feeds one token per row:
the projections go through kernels.nf4_matvec, which at one row reads the 4-bit codes directly (a
Triton kernel launch per weight, plus one adding split-K partial sums) and at several rows
dequantizes each weight and takes cuBLAS (faster on an H200, see that module); LoRA is two skinny
products, and attention reads the row's cached keys up to its own length. Rows keep their own
lengths, so prompts of different lengths decode together without padding. On CUDA the step is
captured once per batch size as a CUDA graph (fixed shapes, the cache preallocated, tokens and
positions passed in tensors) and replayed; on the CPU it runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.layers import DecoderLayer
from qlora_cli.model.lora import GROUPS, ProjectionGroup
from qlora_kernels._dispatch import use_triton
from qlora_kernels.nf4 import NF4Weight, dequantize_nf4
from qlora_kernels.nf4_matvec import nf4_matvec

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
        """k, v [..., kv_heads, head_dim] into (row, position) pairs, rows and positions shaped as k's
        leading dims; no host synchronisation."""
        self.k[layer, rows, :, positions] = k
        self.v[layer, rows, :, positions] = v


class PrefillCache:
    """A layer's cache in the prefill: stores the packed prompts' keys and values at their (row,
    position); attention runs over the prompts themselves, packed, as in training."""

    decoding = False

    def __init__(self, cache: KVCache, layer: int, rows: torch.Tensor, positions: torch.Tensor):
        self.cache, self.layer, self.rows, self.positions = cache, layer, rows, positions

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write(self.layer, self.rows, self.positions, k, v)
        return k, v


class DecodeCache:
    """A layer's cache in a decode step: stores each row's new key and value at its position and
    hands back all of the layer's cached keys and values, `visible` marking each row's so far."""

    decoding = True

    def __init__(self, cache: KVCache, layer: int, positions, visible, projections: DecodeProjections):
        self.cache, self.layer, self.positions = cache, layer, positions
        self.visible, self.projections = visible, projections

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write(self.layer, self.cache.rows[:, None], self.positions, k, v)
        return self.cache.k[self.layer], self.cache.v[self.layer]


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
        """x [rows, 1, in] -> [rows, 1, out]."""
        rows = x.view(-1, x.shape[-1])
        y = nf4_matvec(rows, self.weights, self.biases)
        if self.lora_a is not None:
            y = torch.addmm(y, rows @ self.lora_a.T, self.lora_b.T)
        return y.view(*x.shape[:-1], y.shape[-1])


class DecodeProjections:
    """A layer's projections in a decode step (the methods of qlora_cli.model.layers.Projections):
    each group a DecodeProjection, SwiGLU as torch's silu(gate) * up. LoRA dropout is off at
    inference, so the token offset places no mask."""

    def __init__(self, layer: DecoderLayer, dtype: torch.dtype):
        self.groups = {group: DecodeProjection(layer.projections[group], dtype) for group in GROUPS}

    def qkv(self, h):
        return self.groups["qkv"](h)

    def o(self, attn):
        return self.groups["o"](attn)

    def gate_up(self, h, token_offset):
        return self.groups["gate_up"](h)

    def swiglu(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def down(self, activation, token_offset):
        return self.groups["down"](activation)


class Decoder:
    """The model's prefill and one-token step; holds the decode-ready copies of the LoRA weights."""

    def __init__(self, model: QLoRAModel):
        self.model = model
        self.device = model.embed_tokens.device
        dtype = model.embed_tokens.dtype
        self.projections = [DecodeProjections(layer, dtype) for layer in model.layers]

    @torch.inference_mode()
    def prefill(self, cache: KVCache, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts (one per cache row) through the layers, packed into one row; fills rows
        [0, len) of the cache and returns each prompt's next-token logits [B, vocab] (fp32)."""
        device = self.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        ids = torch.tensor([token for p in prompts for token in p], device=device)
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(len(ids), device=device) - starts[rows]
        doc_ids = rows[None] if len(prompts) > 1 else None
        caches = [
            PrefillCache(cache, index, rows[None], positions[None]) for index in range(cache.k.shape[0])
        ]
        hidden = self.model.hidden_states(ids[None], positions[None], doc_ids, caches)[0]
        last = hidden[starts + lengths - 1]
        return (last @ self.model.lm_head.to(last.dtype).T).float()

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B] at positions [B] (each row's length so far); returns next-token logits [B, vocab]
        (fp32). Only tensor ops with fixed shapes, so that a CUDA graph can capture it."""
        visible = cache.slots[None, :] <= positions[:, None]
        positions = positions[:, None]
        caches = [
            DecodeCache(cache, index, positions, visible, projections)
            for index, projections in enumerate(self.projections)
        ]
        h = self.model.hidden_states(tokens[:, None], positions, None, caches)[:, 0]
        return (h @ self.model.lm_head.to(h.dtype).T).float()


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
