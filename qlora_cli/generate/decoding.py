"""The forward passes of generation: a prefill of the prompts, then one-token steps over a cache.

Both run the model's own layers (qlora_cli/model/layers.py), each handed its share of the cache; the
cache's mode picks the kernels. An attention layer's cache holds the post-RoPE keys and values of
each row; a Gated DeltaNet layer's (Qwen3.5) its conv and delta-rule states, one of each per row.

The prefill runs the training kernels (the same numbers). Without Gated DeltaNet layers it packs
every prompt of the batch into one row, each with positions from 0 and a document of its own. A
delta rule's final state is one per row, so with them each prompt gets a row of its own, right-
aligned: the padding before it is a document of its own, which resets the conv and the state at
the prompt's first token, so each row's states are exactly its prompt's.

A decode step then feeds one token per row: the projections go through kernels.nf4_matvec, which at
one row reads the 4-bit codes directly (a Triton kernel launch per weight, plus one adding split-K
partial sums) and at several rows dequantizes each weight and takes cuBLAS (faster on an H200, see
that module); LoRA is two skinny products, attention reads the row's cached keys up to its own
length (within a sliding window, where the model has one), and a Gated DeltaNet layer advances its
states in place. Rows keep their own lengths, so prompts of different lengths decode together without
padding. On CUDA the step is captured once per
batch size as a CUDA graph (fixed shapes, the cache preallocated, tokens and positions passed in
tensors) and replayed; on the CPU it runs eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.layers import DecoderLayer
from qlora_cli.model.lora import LAYER_GROUPS, ProjectionGroup
from qlora_cli.sources.spec import LINEAR_ATTENTION
from qlora_kernels._dispatch import use_triton
from qlora_kernels.nf4 import NF4Weight, dequantize_nf4
from qlora_kernels.nf4_matvec import nf4_matvec

# The cache grows in steps of this many positions, so later calls of similar size reuse a captured graph.
CAPACITY_STEP = 256

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """Generation's cache for `batch` rows, allocated once (a CUDA graph's replays reuse it): each
    attention layer's keys and values [batch, kv_heads, capacity, head_dim], position p of a row
    holding that row's token p, and each Gated DeltaNet layer's conv states [batch, conv_dim, K] (the
    last K conv inputs, model dtype) and delta-rule states [batch, Hv, Dk, Dv] (fp32). A layer's
    entries of the other kind are None."""

    def __init__(self, model: QLoRAModel, batch: int, capacity: int):
        spec = model.spec
        device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
        zeros = dict(dtype=dtype, device=device)
        kv_shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        attention = [kind != LINEAR_ATTENTION for kind in spec.layer_types]
        self.keys = [torch.zeros(kv_shape, **zeros) if a else None for a in attention]
        self.values = [torch.zeros(kv_shape, **zeros) if a else None for a in attention]
        self.conv_states = self.recurrent_states = [None] * len(attention)
        if (linear := spec.linear_attention) is not None:
            conv_shape = (batch, linear.conv_dim, linear.conv_kernel)
            state_shape = (batch, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim)
            self.conv_states = [None if a else torch.zeros(conv_shape, **zeros) for a in attention]
            self.recurrent_states = [
                None if a else torch.zeros(state_shape, dtype=torch.float32, device=device) for a in attention
            ]
        self.recurrent = not all(attention)
        self.rows = torch.arange(batch, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.batch, self.capacity = batch, capacity

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """k, v [..., kv_heads, head_dim] into (row, position) pairs, rows and positions shaped as k's
        leading dims; no host synchronisation."""
        self.keys[layer][rows, :, positions] = k
        self.values[layer][rows, :, positions] = v


class PrefillCache:
    """An attention layer's cache in the prefill: stores the prompts' keys and values at their (row,
    position); attention runs over the prompts themselves, as in training. `prompt_tokens` [rows, seq]
    marks the pass's tokens that are the prompts' (not padding), in the order `rows` and `positions`
    list them."""

    decoding = False

    def __init__(self, cache: KVCache, layer: int, prompt_tokens, rows, positions):
        self.cache, self.layer, self.prompt_tokens = cache, layer, prompt_tokens
        self.rows, self.positions = rows, positions

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self.prompt_tokens
        self.cache.write(self.layer, self.rows, self.positions, k[kept], v[kept])
        return k, v


class DecodeCache:
    """An attention layer's cache in a decode step: stores each row's new key and value at its
    position and hands back all of the layer's cached keys and values, `visible` marking each row's
    so far."""

    decoding = True

    def __init__(self, cache: KVCache, layer: int, positions, visible, projections: DecodeProjections):
        self.cache, self.layer, self.positions = cache, layer, positions
        self.visible, self.projections = visible, projections

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write(self.layer, self.cache.rows[:, None], self.positions, k, v)
        return self.cache.keys[self.layer], self.cache.values[self.layer]


class RecurrentCache:
    """A Gated DeltaNet layer's cache (the linear half of qlora_cli.model.layers.LayerCache): views
    of its rows' conv and delta-rule states. A decode step's kernels update them in place; a prefill
    of right-aligned rows (`prompt_tokens` [rows, seq] marking the tokens that are not padding) sets
    them to its own, as transformers' cache holds them: the last K conv inputs with zeros before the
    prompt, and the state after the prompt's last token."""

    def __init__(self, cache: KVCache, layer: int, rows: int, *, prompt_tokens=None, projections=None):
        self.conv_state = cache.conv_states[layer][:rows]
        self.recurrent_state = cache.recurrent_states[layer][:rows]
        self.prompt_tokens, self.projections = prompt_tokens, projections
        self.decoding = projections is not None

    def keep_states(self, conv_input: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        width = self.conv_state.shape[-1]
        last = conv_input[:, -width:] * self.prompt_tokens[:, -width:, None]
        self.conv_state.zero_()
        self.conv_state[:, :, width - last.shape[1] :] = last.transpose(1, 2)
        self.recurrent_state.copy_(recurrent_state)


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
        self.groups = {
            group: DecodeProjection(layer.projections[group], dtype) for group in LAYER_GROUPS[layer.kind]
        }

    def qkv(self, h):
        return self.groups["qkv"](h)

    def o(self, attn):
        return self.groups["o"](attn)

    def in_proj(self, h):
        return self.groups["in_proj"](h)

    def out_proj(self, o):
        return self.groups["out_proj"](o)

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
        """Run the prompts (one per cache row) through the layers, packed into one row or, with Gated
        DeltaNet layers, right-aligned in rows of their own; fills rows [0, len) of the cache and
        returns each prompt's next-token logits [B, vocab] (fp32)."""
        layout = right_aligned if cache.recurrent else packed
        ids, positions, doc_ids, prompt_tokens, last = layout(prompts, self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=self.device), lengths)
        caches = [
            RecurrentCache(cache, index, len(prompts), prompt_tokens=prompt_tokens)
            if layer.kind == LINEAR_ATTENTION
            else PrefillCache(cache, index, prompt_tokens, rows, positions[prompt_tokens])
            for index, layer in enumerate(self.model.layers)
        ]
        hidden = self.model.hidden_states(ids, positions, doc_ids, caches)
        last = hidden.reshape(-1, hidden.shape[-1])[last]
        return (last @ self.model.lm_head.to(last.dtype).T).float()

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B] at positions [B] (each row's length so far); returns next-token logits [B, vocab]
        (fp32). Only tensor ops with fixed shapes, so that a CUDA graph can capture it."""
        visible = cache.slots[None, :] <= positions[:, None]
        if (window := self.model.spec.sliding_window) is not None:
            # The `window` latest keys, the new one included, as the prefill's attention sees them.
            visible &= cache.slots[None, :] > positions[:, None] - window
        positions = positions[:, None]
        caches = [
            RecurrentCache(cache, index, cache.batch, projections=projections)
            if layer.kind == LINEAR_ATTENTION
            else DecodeCache(cache, index, positions, visible, projections)
            for index, (layer, projections) in enumerate(
                zip(self.model.layers, self.projections, strict=True)
            )
        ]
        h = self.model.hidden_states(tokens[:, None], positions, None, caches)[:, 0]
        return (h @ self.model.lm_head.to(h.dtype).T).float()


# A prefill's layout: ids, positions and doc_ids [rows, seq] (doc_ids None for rows of one document),
# which tokens are the prompts' [rows, seq], and where each prompt's last token is in the flattened rows.
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


def packed(prompts: Sequence[Sequence[int]], device: torch.device) -> Layout:
    """Every prompt in one row, one after another, each a document with positions from 0."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([token for p in prompts for token in p], device=device)
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(len(ids), device=device) - starts[rows]
    doc_ids = rows[None] if len(prompts) > 1 else None
    return (
        ids[None],
        positions[None],
        doc_ids,
        torch.ones_like(ids[None], dtype=torch.bool),
        starts + lengths - 1,
    )


def right_aligned(prompts: Sequence[Sequence[int]], device: torch.device) -> Layout:
    """A row per prompt, ending at the last column; the padding before a shorter prompt is a document
    of its own (doc 0, the prompt doc 1), so the prompt's conv, delta rule and attention start afresh."""
    longest = max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    positions = torch.arange(longest, device=device)[None] - (longest - lengths)[:, None]
    prompt_tokens = positions >= 0
    doc_ids = prompt_tokens.long() if len(set(lengths.tolist())) > 1 else None
    last = torch.arange(1, len(prompts) + 1, device=device) * longest - 1
    return ids, positions.clamp(min=0), doc_ids, prompt_tokens, last


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
