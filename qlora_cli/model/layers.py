"""The decoder layer: its sequence of ops, written once for training, generation's prefill and its decode step.

fused residual-add + RMSNorm → the mixer → fused residual-add + RMSNorm → the MLP. The mixer is the
layer kind's (qlora_cli/model/mixers/: attention, or Gated DeltaNet in three of four Qwen3.5 layers);
the MLP is the layer's kind of MLP (qlora_cli/model/mlps/: dense SwiGLU, or routed experts).

What differs by mode is which kernels run an op, never the order (qlora_cli/model/modes.py):

- training and the prefill run the layer's own projection groups through the fused NF4 + LoRA
  kernels (`FusedProjections`) and packed causal attention;
- a decode step (one token a row) runs generation's decode copies of the projections and attends
  to each row's cached keys; both come with its cache.

Every op goes through `kernels`, which picks Triton on CUDA and the torch reference on the CPU, so
this file reads the same on both. `timed` names each op for `qlora profile` and calls it straight
through when profiling is off.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import timed
from qlora_cli.model.lora import LoRAConfig, ProjectionGroup
from qlora_cli.model.mixers import MIXERS
from qlora_cli.model.mlps import MLPS
from qlora_cli.model.modes import LayerCache
from qlora_cli.sources.spec import DENSE_MLP, ModelSpec
from qlora_kernels.rmsnorm import add_rms_norm
from qlora_kernels.swiglu import lora_swiglu

# Each layer's projection groups take salts index * SALTS_PER_LAYER + i for LoRA dropout's masks.
SALTS_PER_LAYER = 4


def layer_groups(kind: str, mlp: str = DENSE_MLP) -> dict[str, tuple[str, ...]]:
    """The projection groups a layer of `kind` with an MLP of kind `mlp` can have, in the order it runs
    them: its mixer's, then the MLP's (a layer builds those whose projections its spec has)."""
    return {**MIXERS[kind].groups, **MLPS[mlp].groups}


def shape_problem(spec: ModelSpec) -> str | None:
    """Why the kernels cannot take the model's layers, or None: said before anything loads, instead of a
    traceback from the first packed micro-batch."""
    for kind in dict.fromkeys(spec.layer_types):
        if problem := MIXERS[kind].shape_problem(spec):
            return problem
    return None


class FusedProjections:
    """A layer's projection groups through the training kernels (qlora_kernels.linear and .swiglu):
    NF4 GEMMs with LoRA fused, LoRA dropout drawn from `dropout_seed`. Training and the prefill run these.

    The MLP's LoRA is split across ops: gate/up stops at t = x @ A^T, SwiGLU adds gate/up's B and
    takes down's A, and down starts from that. Down's LoRA input is SwiGLU's output itself unless
    LoRA dropout is on; then down runs its own LoRA. In a recompute (the layer's `recomputing`)
    down's GEMM is skipped: nothing reads the layer's output there.
    """

    def __init__(
        self, layer: DecoderLayer, dropout_seed: torch.Tensor | None, adapter_scale: torch.Tensor | None
    ):
        self.layer = layer
        self.groups = layer.projections
        self.dropout_seed = dropout_seed
        self.adapter_scale = adapter_scale
        down = self.groups["down"] if "down" in self.groups else None  # noqa: SIM401 - a ModuleDict
        self.fuse_down = (
            down is not None and "down_proj" in down.lora_A and not (down.dropout and layer.training)
        )

    @property
    def skip_down_output(self) -> bool:
        """In a recompute nothing reads down's output when it is the layer's (the dense MLP's)."""
        return self.layer.recomputing and self.layer.mlp.down_output_unread_in_recompute

    def run(self, op, group, x):
        return timed(
            op, self.groups[group], x, dropout_seed=self.dropout_seed, adapter_scale=self.adapter_scale
        )

    def gate_up(self, h, token_offset):
        group = self.groups["gate_up"]
        dropout = dict(dropout_seed=self.dropout_seed, token_offset=token_offset)
        return timed(Op.GATE_UP_GEMM, group, h, keep_lora_t=True, adapter_scale=self.adapter_scale, **dropout)

    def swiglu(self, gate_up):
        gate_up_out, gate_up_t = gate_up
        group = self.groups["gate_up"]
        # SwiGLU forms down's t from down's A, so the adapter switch reaches down's LoRA through it;
        # taken per call, since a sliced MLP backpropagates each slice's call on its own.
        down_a = self.groups["down"].lora_a_list(self.adapter_scale)[0] if self.fuse_down else None
        return timed(
            Op.SILU,
            lora_swiglu,
            gate_up_out,
            gate_up_t,
            group.lora_B.get("gate_proj"),
            group.lora_B.get("up_proj"),
            group.scaling,
            down_a,
            need_output=not (self.skip_down_output and self.fuse_down),
        )

    def down(self, activation, token_offset):
        activation, down_t = activation
        group, need_output = self.groups["down"], not self.skip_down_output
        if self.fuse_down:
            return timed(Op.DOWN_GEMM, group, activation, need_output=need_output, lora_t=down_t)
        dropout = dict(dropout_seed=self.dropout_seed, token_offset=token_offset)
        switch = self.adapter_scale
        return timed(
            Op.DOWN_GEMM, group, activation, need_output=need_output, adapter_scale=switch, **dropout
        )


class DecoderLayer(nn.Module):
    """One layer: its two norms, the mixer of its kind, the MLP, and the projection groups of both in
    the order they run (mixer's first), each group with its LoRA dropout salt."""

    def __init__(self, spec: ModelSpec, lora: LoRAConfig | None, attention_backend: str, index: int = 0):
        super().__init__()
        self.spec = spec
        self.kind, self.mlp_kind = spec.layer_kinds[index]
        trainable = bool(lora and lora.train_norms)
        h = spec.hidden_size
        self.input_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h), requires_grad=trainable)
        # Registered before the projections: parameters() lists the mixer's norms right after the
        # layer's own, the order the optimizer's saved state has.
        mlp_backward_bytes = MLPS[self.mlp_kind].backward_working_bytes
        self.mixer = MIXERS[self.kind](spec, trainable, attention_backend, mlp_backward_bytes)
        self.mlp = MLPS[self.mlp_kind](spec, lora)
        shapes = spec.projection_shapes(self.kind, self.mlp_kind)
        groups = {
            g: names
            for g, names in layer_groups(self.kind, self.mlp_kind).items()
            if all(name in shapes for name in names)
        }
        self.projections = nn.ModuleDict(
            {
                g: ProjectionGroup(names, shapes, lora, salt=index * SALTS_PER_LAYER + i)
                for i, (g, names) in enumerate(groups.items())
            }
        )
        # Each projection's group, and the module the checkpoint keeps it below (self_attn, mlp, ...).
        self.group_of = {name: g for g, names in groups.items() for name in names}
        self.module_of = {
            name: part.checkpoint_module
            for part in (self.mixer, self.mlp)
            for g, names in part.groups.items()
            if g in groups
            for name in names
        }
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
        adapter_scale=None,
        cache: LayerCache | None = None,
        balance_tokens: torch.Tensor | None = None,
    ):
        """(x, residual) [batch, seq, hidden] in and out. `cache` is None in training; in generation
        it keeps this layer's keys and values (or conv and recurrent states), and a decode step's
        cache brings the decode kernels, with LoRA folded in as it was when the cache was made.
        `adapter_scale`, a 0-d tensor, multiplies LoRA's contribution (QLoRAModel.adapter_off).
        `balance_tokens`, given to a layer whose MLP routes tokens when training adds the load-balancing
        loss, adds the router's tally to what it returns (qlora_cli/model/mlps/balance.py): an output,
        so that a recompute or an offload runs its backward as the layer's."""
        eps, zero_centred = self.spec.rms_norm_eps, self.spec.zero_centred_norms
        decoding = cache is not None and cache.decoding
        project = cache.projections if decoding else FusedProjections(self, dropout_seed, adapter_scale)
        norm = dict(zero_centred=zero_centred)
        h, residual = timed(Op.RMSNORM_ATTN, add_rms_norm, x, residual, self.input_layernorm, eps, **norm)
        x = self.mixer(h, position_ids, doc_ids, inv_freq, project, cache)
        h, residual = timed(
            Op.RMSNORM_FFN, add_rms_norm, x, residual, self.post_attention_layernorm, eps, **norm
        )
        if balance_tokens is None:
            return self.mlp(h, project, self), residual
        out, tally = self.mlp(h, project, self, balance_tokens)
        return out, residual, tally
