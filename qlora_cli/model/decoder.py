"""The Qwen2 / Qwen2.5 / Qwen3 decoder with NF4 frozen projections and LoRA adapters.

One layer: fused residual-add + RMSNorm → QKV projection (+bias, + LoRA) → QK-norm + RoPE →
causal GQA attention → O projection → fused residual-add + RMSNorm → gate/up projection →
SwiGLU → down projection. Every op goes through `kernels`, which picks Triton on CUDA and the
torch reference on the CPU, so this file reads the same on both. `timed` names each op for
`qlora profile` and calls it straight through when profiling is off.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.offload import HostOffloader, OffloadedLayer
from qlora_cli.model.sliced_mlp import SlicedMLP, slice_tokens
from qlora_cli.sources.hub import resolve_model
from qlora_cli.sources.weights import ModelSpec, read_spec, stream_tensors
from qlora_kernels.attention import attention
from qlora_kernels.cross_entropy import linear_cross_entropy
from qlora_kernels.dropout import seeded_dropout
from qlora_kernels.linear import buffer_numel, lora_linear, lora_linear_a, lora_linear_b
from qlora_kernels.nf4 import NF4Weight, quantize_nf4
from qlora_kernels.rmsnorm import add_rms_norm
from qlora_kernels.rope import apply_rope
from qlora_kernels.swiglu import lora_swiglu

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
PROJECTION_GROUP = {name: group for group, names in GROUPS.items() for name in names}


def rope_inv_freq(spec: ModelSpec, device: torch.device | None = None) -> torch.Tensor:
    """RoPE frequencies computed exactly as transformers does, so positions rotate identically."""
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64, device=device).float() / spec.head_dim
    return 1.0 / (spec.rope_theta**exponents)


@dataclass(frozen=True)
class LoRAConfig:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    use_rslora: bool = False
    train_norms: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def lora_weights_per_layer(self, spec: ModelSpec) -> int:
        """LoRA A [r, in] and B [out, r] of each targeted projection of one layer."""
        shapes = spec.projection_shapes()
        return sum(self.r * (out + inp) for name, (out, inp) in shapes.items() if name in self.target_modules)

    def trained_weights(self, spec: ModelSpec) -> int:
        """Every weight the adapter trains: what the optimizer holds state for and a checkpoint saves.

        The memory planner and the output_dir's free-space check both count from here."""
        norms_per_layer = 2 * spec.hidden_size + (2 * spec.head_dim if spec.qk_norm else 0)
        per_layer = self.lora_weights_per_layer(spec) + (norms_per_layer if self.train_norms else 0)
        return per_layer * spec.num_layers + (spec.hidden_size if self.train_norms else 0)


class ProjectionGroup(nn.Module):
    """Projections that share one input (q/k/v, gate/up, or a single one), run as one fused call.

    Frozen weights are NF4 (or plain tensors when quantization is off) and live outside the
    parameter list; LoRA A/B are the trainable fp32 master weights, named as PEFT names them.
    LoRA dropout's mask is hash(the model's dropout seed, `salt`, token) (kernels.dropout): each
    group of each layer has its own salt, and a recompute repeats the mask without saving anything.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        shapes: dict[str, tuple[int, int]],
        lora: LoRAConfig | None,
        salt: int = 0,
    ):
        super().__init__()
        self.names = names
        self.salt = salt
        self.out_features = [shapes[n][0] for n in names]
        self.weights: list[NF4Weight | torch.Tensor | None] = [None] * len(names)
        self.biases: list[torch.Tensor | None] = [None] * len(names)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.scaling = lora.scaling if lora else 0.0
        self.dropout = lora.dropout if lora else 0.0
        for name in names:
            if lora and name in lora.target_modules:
                out_features, in_features = shapes[name]
                self.lora_A[name] = nn.Parameter(torch.empty(lora.r, in_features))
                self.lora_B[name] = nn.Parameter(torch.zeros(out_features, lora.r))
        self.scratch: torch.Tensor | None = None

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """A as PEFT initialises it (kaiming-uniform with a=sqrt(5)), B zeros: the adapter starts as a no-op."""
        for a in self.lora_A.values():
            bound = 1.0 / math.sqrt(a.shape[1])
            with torch.no_grad():
                a.uniform_(-bound, bound, generator=generator)
        for b in self.lora_B.values():
            with torch.no_grad():
                b.zero_()

    def lora_a_list(self) -> list[torch.Tensor | None]:
        return [self.lora_A.get(n) for n in self.names]

    def scratch_numel(self) -> int:
        return buffer_numel(self.weights, self.lora_a_list())

    def set_weight(self, name: str, weight: NF4Weight | torch.Tensor) -> None:
        self.weights[self.names.index(name)] = weight

    def set_bias(self, name: str, bias: torch.Tensor) -> None:
        self.biases[self.names.index(name)] = bias

    def forward(
        self,
        x: torch.Tensor,
        need_output: bool = True,
        *,
        keep_lora_t: bool = False,
        lora_t: torch.Tensor | None = None,
        dropout_seed: torch.Tensor | None = None,
        token_offset: int = 0,
    ):
        """The projections with LoRA. keep_lora_t: return (y without LoRA's B, t = lora_x @ A^T)
        for the next op to finish; lora_t: start from that t instead of x @ A^T. With dropout,
        `dropout_seed` draws the mask; x's first token is token `token_offset` of the micro-batch."""
        lora_x = x
        if self.dropout and self.training:
            if dropout_seed is None:
                raise ValueError("LoRA dropout needs the model's dropout seed")
            lora_x = seeded_dropout(x, self.dropout, dropout_seed, self.salt, token_offset * x.shape[-1])
        lora_b = [self.lora_B.get(n) for n in self.names]
        if keep_lora_t:
            return lora_linear_a(
                x, self.weights, self.biases, self.lora_a_list(), lora_x, self.scratch, need_output
            )
        if lora_t is not None:
            return lora_linear_b(
                x, lora_t, self.weights, self.biases, lora_b, self.scaling, self.scratch, need_output
            )
        return lora_linear(
            x,
            self.weights,
            self.biases,
            self.lora_a_list(),
            lora_b,
            self.scaling,
            lora_x=lora_x,
            buffer=self.scratch,
            need_output=need_output,
        )


def choose_attention_backend(setting: str, doc_ids: torch.Tensor | None) -> str:
    """`auto`: torch's fused attention for rows of one document, our kernel for packed rows.

    benchmarks/RESULTS.md has the numbers: sdpa is faster on plain causal rows, ours on packed rows,
    where sdpa needs a materialized mask.
    """
    if setting != "auto":
        return setting
    return "sdpa" if doc_ids is None else "triton"


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
        # Set while a generation prefill runs (qlora_cli/generate/decoding.py): called with the post-RoPE k and v.
        self.kv_capture = None

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

    def forward(self, x, residual, position_ids, doc_ids, inv_freq, dropout_seed=None):
        spec = self.spec
        b, s, _ = x.shape
        eps = spec.rms_norm_eps
        h, residual = timed(Op.RMSNORM_ATTN, add_rms_norm, x, residual, self.input_layernorm, eps)
        qkv = timed(Op.QKV_GEMM, self.projections["qkv"], h, dropout_seed=dropout_seed)
        qkv = qkv.view(b, s, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim)
        q, k, v = qkv.split([spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], dim=2)
        q, k = timed(Op.ROPE, apply_rope, q, k, position_ids, inv_freq, self.q_norm, self.k_norm, eps)
        if self.kv_capture is not None:
            self.kv_capture(k, v)
        backend = choose_attention_backend(self.attention_backend, doc_ids)
        attn = timed(Op.ATTENTION, attention, q, k, v, doc_ids, backend=backend)
        o = self.projections["o"]
        x = timed(Op.O_PROJ, o, attn.reshape(b, s, spec.q_size), dropout_seed=dropout_seed)
        h, residual = timed(Op.RMSNORM_FFN, add_rms_norm, x, residual, self.post_attention_layernorm, eps)
        x = self._mlp(h, dropout_seed)
        return x, residual

    def _mlp(self, h, dropout_seed=None):
        """The MLP, over slices of tokens when the row is long (qlora_cli/model/sliced_mlp.py)."""
        tokens = h.numel() // h.shape[-1]
        per_slice = slice_tokens(tokens, self.spec.intermediate_size, h.element_size())
        if per_slice == tokens:
            return self._mlp_whole(h, dropout_seed)
        mlp = [self.projections["gate_up"], self.projections["down"]]
        trainables = [p for group in mlp for p in group.parameters() if p.requires_grad]

        def mlp_slice(part, token_offset):
            return self._mlp_whole(part, dropout_seed, token_offset)

        return SlicedMLP.apply(mlp_slice, self.recomputation, self.recomputing, per_slice, h, *trainables)

    def _mlp_whole(self, h, dropout_seed=None, token_offset=0):
        """gate/up → SwiGLU → down, with LoRA's B of gate/up and A of down done inside SwiGLU
        (kernels.swiglu). Down's LoRA input is h itself unless LoRA dropout is on; then down
        takes h and runs its own LoRA."""
        gate_up, down = self.projections["gate_up"], self.projections["down"]
        dropout = dict(dropout_seed=dropout_seed, token_offset=token_offset)
        gate_up_out, gate_up_t = timed(Op.GATE_UP_GEMM, gate_up, h, keep_lora_t=True, **dropout)
        down_a = down.lora_A.get("down_proj")
        fuse_down = down_a is not None and not (down.dropout and self.training)
        activation, down_t = timed(
            Op.SILU,
            lora_swiglu,
            gate_up_out,
            gate_up_t,
            gate_up.lora_B.get("gate_proj"),
            gate_up.lora_B.get("up_proj"),
            gate_up.scaling,
            down_a if fuse_down else None,
            need_output=not (self.recomputing and fuse_down),
        )
        if fuse_down:
            return timed(Op.DOWN_GEMM, down, activation, need_output=not self.recomputing, lora_t=down_t)
        return timed(Op.DOWN_GEMM, down, activation, need_output=not self.recomputing, **dropout)


class QLoRAModel(nn.Module):
    """The decoder with frozen (NF4) base weights and trainable LoRA adapters."""

    def __init__(
        self,
        spec: ModelSpec,
        lora: LoRAConfig | None = None,
        *,
        attention_backend: str = "auto",
        checkpoint_layers: int = 0,
        offload_activations: bool = False,
    ):
        super().__init__()
        self.spec = spec
        self.offload_activations = offload_activations
        self.offloader: HostOffloader | None = None
        self.lora = lora
        self.layers = nn.ModuleList(
            DecoderLayer(spec, lora, attention_backend, index) for index in range(spec.num_layers)
        )
        trainable = bool(lora and lora.train_norms)
        self.norm = nn.Parameter(torch.ones(spec.hidden_size), requires_grad=trainable)
        self.embed_tokens: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.checkpoint_layers = checkpoint_layers
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        # Each rank writes its own micro-batch's seed here, so DDP must not broadcast buffers
        # (qlora_cli/train/distributed.py). A buffer so that `model.to(device)` moves it; not persistent:
        # it is no state, each micro-batch sets it.
        self.register_buffer("dropout_seed", torch.zeros(1, dtype=torch.int64), persistent=False)

    def set_dropout_seed(self, seed: int) -> None:
        """The seed of the next micro-batch's LoRA dropout masks, written on the device in place, so
        that a captured CUDA graph reads it too. Training sets one per micro-batch (qlora_cli/train/step.py)."""
        self.dropout_seed.fill_(seed)

    @classmethod
    def on_device(
        cls, spec: ModelSpec, lora: LoRAConfig | None, device, *, seed: int = 0, **options
    ) -> QLoRAModel:
        """Allocate the model straight on `device` (no CPU copy), LoRA initialised, base weights still empty."""
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(spec, lora, **options)
        model.to_empty(device=device)
        model.inv_freq = rope_inv_freq(spec, device)
        model.dropout_seed.zero_()
        generator = torch.Generator(device=device).manual_seed(seed)
        for layer in model.layers:
            for group in layer.projections.values():
                group.reset_lora(generator)
        return model

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | Path,
        *,
        quantize: bool = True,
        lora: LoRAConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        revision: str | None = None,
        attention_backend: str = "auto",
        checkpoint_layers: int = 0,
        offload_activations: bool = False,
        seed: int = 0,
    ) -> QLoRAModel:
        """Resolve, stream and (on the target device) quantize a checkpoint, one tensor at a time.

        dtype is the compute dtype: bf16 on CUDA and fp32 on the CPU unless given.
        """
        folder = resolve_model(str(path_or_repo_id), revision)
        spec = read_spec(folder)
        device = torch.device(device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # Triton launches on the current device, not the tensor's
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = cls.on_device(
            spec,
            lora,
            device,
            attention_backend=attention_backend,
            checkpoint_layers=checkpoint_layers,
            offload_activations=offload_activations,
            seed=seed,
        )
        model.load_base(stream_tensors(folder, spec), quantize=quantize, dtype=dtype)
        model.source = folder
        return model

    def load_base(self, tensors, *, quantize: bool, dtype: torch.dtype) -> None:
        """Take the frozen weights from a (name, tensor) stream; projections are quantized on arrival."""
        device = self.norm.device
        for name, tensor in tensors:
            tensor = tensor.to(device)
            parts = name.split(".")
            if name == "model.embed_tokens.weight":
                self.embed_tokens = tensor.to(dtype)
            elif name == "lm_head.weight":
                self.lm_head = tensor.to(dtype)
            elif name == "model.norm.weight":
                with torch.no_grad():
                    self.norm.copy_(tensor.float())
            elif parts[3] in ("input_layernorm", "post_attention_layernorm"):
                with torch.no_grad():
                    getattr(self.layers[int(parts[2])], parts[3]).copy_(tensor.float())
            elif parts[4] in ("q_norm", "k_norm"):
                with torch.no_grad():
                    getattr(self.layers[int(parts[2])], parts[4]).copy_(tensor.float())
            else:
                group = self.layers[int(parts[2])].projections[PROJECTION_GROUP[parts[4]]]
                if parts[-1] == "bias":
                    group.set_bias(parts[4], tensor.to(dtype))
                else:
                    weight = tensor.to(dtype)
                    group.set_weight(parts[4], quantize_nf4(weight) if quantize else weight)
        if self.spec.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        self._share_scratch(device, dtype)

    def _share_scratch(self, device: torch.device, dtype: torch.dtype) -> None:
        """One weight buffer (dequantized or concatenated) for all layers: they run one at a time."""
        groups = [group for layer in self.layers for group in layer.projections.values()]
        largest = max(group.scratch_numel() for group in groups)
        scratch = torch.empty(largest, dtype=dtype, device=device)
        for group in groups:
            group.scratch = scratch

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def hidden_states(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        """Final-normed hidden states [batch, seq, hidden]."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        x = timed(Op.EMBEDDING, F.embedding, input_ids, self.embed_tokens)
        residual = None
        for i, layer in enumerate(self.layers):
            if self.training and i < self.checkpoint_layers and torch.is_grad_enabled():
                # A recomputed layer keeps only its input: hand it the residual stream as one tensor.
                stream = x if residual is None else x + residual
                if self.offload_activations:
                    x, residual = self._offloaded(i, stream, position_ids, doc_ids)
                    continue
                x, residual = checkpoint(
                    layer,
                    stream,
                    None,
                    position_ids,
                    doc_ids,
                    self.inv_freq,
                    self.dropout_seed,
                    use_reentrant=False,
                    context_fn=layer.checkpoint_contexts,
                    # LoRA dropout, a layer's only random op, repeats its masks from dropout_seed; no
                    # RNG state to save, and none to read, which a CUDA graph capture could not do.
                    preserve_rng_state=False,
                )
            else:
                x, residual = layer(x, residual, position_ids, doc_ids, self.inv_freq, self.dropout_seed)
        h, _ = timed(Op.FINAL_NORM, add_rms_norm, x, residual, self.norm, self.spec.rms_norm_eps)
        return h

    def _offloaded(self, index: int, stream, position_ids, doc_ids):
        """Layer `index` recomputed in backward, its input kept in host memory (qlora_cli/model/offload.py)."""
        if self.offloader is None:
            self.offloader = HostOffloader(stream.device, len(self.layers))
        layer = self.layers[index]

        def run_layer(x):
            return layer(x, None, position_ids, doc_ids, self.inv_freq, self.dropout_seed)

        trainables = [p for p in layer.parameters() if p.requires_grad]
        return OffloadedLayer.apply(
            run_layer, self.offloader, index, layer.recomputation, stream, *trainables
        )

    def forward(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; training uses `loss`, which never builds them."""
        h = self.hidden_states(input_ids, position_ids, doc_ids)
        return (h @ self.lm_head.to(h.dtype).T).float()

    def loss(self, input_ids, labels, position_ids=None, doc_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, count of trained tokens); labels are already shifted."""
        h = self.hidden_states(input_ids, position_ids, doc_ids)
        return timed(
            Op.LM_HEAD_LOSS,
            linear_cross_entropy,
            h.reshape(-1, h.shape[-1]),
            self.lm_head,
            labels.reshape(-1),
        )
