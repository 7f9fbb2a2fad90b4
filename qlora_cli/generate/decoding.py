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
from qlora_cli.model.lora import ProjectionGroup
from qlora_cli.model.modes import DecodeRows, PrefillRows
from qlora_kernels.formats import frozen_format
from qlora_kernels.nf4_matvec import nf4_matvec

# The cache grows in steps of this many positions, so later calls of similar size reuse a captured graph.
CAPACITY_STEP = 256

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """Generation's cache for `batch` rows, allocated once (a CUDA graph's replays reuse it): each layer's
    own, as its mixer keeps it (an attention layer's keys and values, a Gated DeltaNet layer's conv and
    delta-rule states; qlora_cli/model/mixers/)."""

    def __init__(self, model: QLoRAModel, batch: int, capacity: int):
        device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
        self.layers = [layer.mixer.new_cache(batch, capacity, device, dtype) for layer in model.layers]
        self.recurrent = any(layer.recurrent for layer in self.layers)
        self.slots = torch.arange(capacity, device=device)
        self.batch, self.capacity = batch, capacity


class DecodeProjection:
    """A projection group for a few rows: the frozen weights read as they are stored, LoRA as
    (x @ A^T) @ B^T with every adapter of the group in one A and one block-diagonal B, scaling folded in.

    A weight the GEMV kernel cannot read as stored (its format says: NF4 where the kernels run on their
    torch references, the CPU outside Triton's interpreter) is dequantized once here: the reference
    mat-vec would dequantize it at every step, and the product is the same either way. Where Triton
    runs NF4 weights stay NF4 for nf4_matvec.
    """

    def __init__(self, group: ProjectionGroup, dtype: torch.dtype):
        self.weights = [
            w if frozen_format(w).reads_in_gemv(w) else frozen_format(w).dequantize(w) for w in group.weights
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
    """A layer's projections in a decode step (the methods of qlora_cli.model.modes.Projections):
    each group a DecodeProjection, SwiGLU as torch's silu(gate) * up. LoRA dropout is off at
    inference, so the token offset places no mask."""

    # Generation runs with the adapter on: the routed experts' LoRA, which runs live, takes all of it.
    adapter_scale = None

    def __init__(self, layer: DecoderLayer, dtype: torch.dtype):
        self.groups = {name: DecodeProjection(group, dtype) for name, group in layer.projections.items()}

    def run(self, op, group, x):
        return self.groups[group](x)

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
        prefill = PrefillRows(len(prompts), prompt_tokens, rows, positions[prompt_tokens])
        caches = [layer.prefill(prefill) for layer in cache.layers]
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
        rows = DecodeRows(positions[:, None], visible)
        caches = [
            layer.decode(rows, projections)
            for layer, projections in zip(cache.layers, self.projections, strict=True)
        ]
        h = self.model.hidden_states(tokens[:, None], rows.positions, None, caches)[:, 0]
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
