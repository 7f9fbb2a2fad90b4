"""The decoder of every family qlora trains, with NF4 frozen projections and LoRA adapters.

The model: embedding → the layers (qlora_cli/model/layers.py) → final RMSNorm → lm_head, with the
checkpointing and host offload the planner chose, and the loading of a checkpoint's weights.
Training calls `loss` (a preference objective `document_log_probs`, and for its reference model
`adapter_off`); generation calls `hidden_states` with a cache for each layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.layers import DecoderLayer, shape_problem
from qlora_cli.model.lora import LoRAConfig
from qlora_cli.model.mlps.balance import load_balancing_loss
from qlora_cli.model.modes import LayerCache
from qlora_cli.model.offload import HostOffloader, OffloadedLayer
from qlora_cli.sources.hub import resolve_model
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.weights import stream_tensors
from qlora_kernels.cross_entropy import linear_cross_entropy, linear_document_logprobs
from qlora_kernels.formats import DENSE, NF4
from qlora_kernels.fp8 import fp8_scales
from qlora_kernels.rmsnorm import add_rms_norm


def rope_inv_freq(spec: ModelSpec, device: torch.device | None = None) -> torch.Tensor:
    """RoPE frequencies computed exactly as transformers does for the config's RoPE type
    (qlora_cli/sources/rope.py), so positions rotate identically."""
    return spec.rope_frequencies(device)[0]


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
        if problem := shape_problem(spec):
            raise QLoraError(problem)
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
        # 1.0 with the adapter on, 0.0 off (adapter_off): a device value, so that a captured CUDA graph
        # that runs the model both ways (a preference loss's policy and reference) reads the switch.
        self.register_buffer("adapter_scale", torch.ones(()), persistent=False)
        # The last training forward's load-balancing loss, unscaled (`loss`): a device value written in
        # place, which a CUDA graph's replays write too, for the step to log.
        self.register_buffer("router_aux_loss", torch.zeros(()), persistent=False)
        # Whether the lm_head's GEMMs skip the tokens no loss reads (kernels/cross_entropy.py's
        # trained_rows_only); training sets it where its data masks many (qlora_cli/train/run.py).
        self.lm_head_trained_rows_only = False

    @property
    def balances_experts(self) -> bool:
        """Whether training adds the load-balancing loss: config.json's output_router_logits, on a model
        with a router (a Qwen3 MoE may have made every layer dense)."""
        asked = self.spec.moe is not None and self.spec.moe.router_aux_loss_coef is not None
        return asked and any(layer.mlp.routes_tokens for layer in self.layers)

    def set_dropout_seed(self, seed: int) -> None:
        """The seed of the next micro-batch's LoRA dropout masks, written on the device in place, so
        that a captured CUDA graph reads it too. Training sets one per micro-batch (qlora_cli/train/step.py)."""
        self.dropout_seed.fill_(seed)

    @contextlib.contextmanager
    def adapter_off(self):
        """The base model inside the block: LoRA's contribution multiplied by 0 through `adapter_scale`,
        set in place and restored from a device copy, so nothing reads back to the host and a CUDA
        graph can capture the switch and its restoring."""
        previous = self.adapter_scale.clone()
        self.adapter_scale.zero_()
        try:
            yield
        finally:
            self.adapter_scale.copy_(previous)

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
        model.adapter_scale.fill_(1.0)
        model.router_aux_loss.zero_()
        generator = torch.Generator(device=device).manual_seed(seed)
        for layer in model.layers:
            for group in layer.projections.values():
                group.reset_lora(generator)
            layer.mlp.reset_lora(generator)
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
        base_format = NF4 if quantize else DENSE
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
            else:
                layer = self.layers[int(parts[2])]
                # Below `model.layers.N.`: `module.projection.weight|bias` for a projection, else the
                # MLP's own tensors (a MoE layer's router and experts) or the mixer's.
                local = ".".join(parts[3:])
                module, projection, kind = local.rsplit(".", 2) if len(parts) > 5 else ("", "", "")
                if projection in layer.group_of and layer.module_of[projection] == module:
                    group = layer.projections[layer.group_of[projection]]
                    if kind == "bias":
                        group.set_bias(projection, tensor.to(dtype))
                    else:
                        group.set_weight(projection, base_format.encode(tensor.to(dtype)))
                elif parts[3] == "mlp":
                    layer.mlp.load(local.removeprefix("mlp."), tensor, base_format, dtype)
                else:
                    layer.mixer.load(parts[4], tensor)
        if self.spec.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        self._share_scratch(device, dtype)

    def _share_scratch(self, device: torch.device, dtype: torch.dtype) -> None:
        """One weight buffer (dequantized or concatenated) for all layers: they run one at a time."""
        # Every MLP takes the buffer too: a MoE layer's routed experts multiply through it one at a time.
        groups = [group for layer in self.layers for group in (*layer.projections.values(), layer.mlp)]
        largest = max(group.scratch_numel() for group in groups)
        scratch = torch.empty(largest, dtype=dtype, device=device)
        for group in groups:
            group.scratch = scratch

    def use_fp8(self) -> None:
        """Multiply every frozen projection in e4m3 (kernels.fp8) from now on; the scales are the
        weights' own, so this is computed once. A group FP8 GEMMs cannot take is named."""
        for index, layer in enumerate(self.layers):
            for name, group in layer.projections.items():
                try:
                    group.fp8 = fp8_scales(group.weights)
                except ValueError as err:
                    raise ValueError(f"layer {index} {name}: {err}") from None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def hidden_states(
        self, input_ids, position_ids=None, doc_ids=None, caches: Sequence[LayerCache] | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [batch, seq, hidden]. `caches`, one per layer, in generation
        (qlora_cli/generate/decoding.py)."""
        return self._run_layers(input_ids, position_ids, doc_ids, caches)[0]

    def _run_layers(self, input_ids, position_ids, doc_ids, caches=None, balance_tokens=None):
        """(final-normed hidden states, the routed layers' tallies for the load-balancing loss, taken
        where `balance_tokens` is given: see DecoderLayer.forward)."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        x = timed(Op.EMBEDDING, F.embedding, input_ids, self.embed_tokens)
        residual = None
        tallies = []
        for i, layer in enumerate(self.layers):
            tokens = balance_tokens if layer.mlp.routes_tokens else None
            if self.training and i < self.checkpoint_layers and torch.is_grad_enabled():
                # A recomputed layer keeps only its input: hand it the residual stream as one tensor.
                stream = x if residual is None else x + residual
                if self.offload_activations:
                    x, residual, *tally = self._offloaded(i, stream, position_ids, doc_ids, tokens)
                    tallies += tally
                    continue
                x, residual, *tally = checkpoint(
                    layer,
                    stream,
                    None,
                    position_ids,
                    doc_ids,
                    self.inv_freq,
                    self.dropout_seed,
                    self.adapter_scale,
                    balance_tokens=tokens,
                    use_reentrant=False,
                    context_fn=layer.checkpoint_contexts,
                    # LoRA dropout, a layer's only random op, repeats its masks from dropout_seed; no
                    # RNG state to save, and none to read, which a CUDA graph capture could not do.
                    preserve_rng_state=False,
                )
            else:
                cache = None if caches is None else caches[i]
                x, residual, *tally = layer(
                    x,
                    residual,
                    position_ids,
                    doc_ids,
                    self.inv_freq,
                    self.dropout_seed,
                    self.adapter_scale,
                    cache=cache,
                    balance_tokens=tokens,
                )
            tallies += tally
        h, _ = timed(
            Op.FINAL_NORM,
            add_rms_norm,
            x,
            residual,
            self.norm,
            self.spec.rms_norm_eps,
            zero_centred=self.spec.zero_centred_norms,
        )
        return h, tallies

    def _offloaded(self, index: int, stream, position_ids, doc_ids, balance_tokens):
        """Layer `index` recomputed in backward, its input kept in host memory (qlora_cli/model/offload.py)."""
        if self.offloader is None:
            self.offloader = HostOffloader(stream.device, len(self.layers))
        layer = self.layers[index]

        def run_layer(x):
            return layer(
                x,
                None,
                position_ids,
                doc_ids,
                self.inv_freq,
                self.dropout_seed,
                self.adapter_scale,
                balance_tokens=balance_tokens,
            )

        trainables = [p for p in layer.parameters() if p.requires_grad]
        return OffloadedLayer.apply(
            run_layer, self.offloader, index, layer.recomputation, stream, *trainables
        )

    def forward(self, input_ids, position_ids=None, doc_ids=None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; training uses `loss`, which never builds them."""
        h = self.hidden_states(input_ids, position_ids, doc_ids)
        return (h @ self.lm_head.to(h.dtype).T).float()

    def document_log_probs(self, input_ids, labels, position_ids=None, doc_ids=None) -> torch.Tensor:
        """fp32 [batch, seq]: [b, d] sums the trained labels' log-probs of row b's d-th document (the
        layout of qlora_kernels.cross_entropy.linear_document_logprobs), what a preference loss compares;
        labels are already shifted. Like `loss`, it never builds the logits."""
        h = self.hidden_states(input_ids, position_ids, doc_ids)
        return timed(Op.LM_HEAD_LOSS, linear_document_logprobs, h, self.lm_head, labels, doc_ids)

    def loss(
        self, input_ids, labels, position_ids=None, doc_ids=None, real_tokens=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token losses, count of trained tokens); labels are already shifted.

        A MoE whose config.json asks for the load-balancing loss (`balances_experts`) adds
        router_aux_loss_coef · aux · count to the sum while training, so that the sum over the count is
        transformers' loss with labels: the mean token loss plus the weighted aux. `real_tokens`
        [batch, seq], False at padding, keeps padding out of the aux as transformers' attention mask
        does; None counts every token. The aux itself is left in `router_aux_loss`."""
        balance_tokens = None
        if self.training and self.balances_experts:
            counted = torch.ones_like(input_ids, dtype=torch.bool) if real_tokens is None else real_tokens
            balance_tokens = counted.reshape(-1).float()
        h, tallies = self._run_layers(input_ids, position_ids, doc_ids, balance_tokens=balance_tokens)
        loss_sum, count = timed(
            Op.LM_HEAD_LOSS,
            linear_cross_entropy,
            h.reshape(-1, h.shape[-1]),
            self.lm_head,
            labels.reshape(-1),
            trained_rows_only=self.lm_head_trained_rows_only,
        )
        if balance_tokens is None:
            return loss_sum, count
        aux = load_balancing_loss(tallies, balance_tokens)
        self.router_aux_loss.copy_(aux.detach())
        return loss_sum + self.spec.moe.router_aux_loss_coef * aux * count, count
