"""The dense SwiGLU MLP: gate/up projection → SwiGLU → down projection, over slices of tokens when the
row is long (qlora_cli/model/sliced_mlp.py). The mode's projections run each op (qlora_cli/model/modes.py)."""

from __future__ import annotations

import torch
from torch import nn

from qlora_cli.model.lora import LoRAConfig
from qlora_cli.model.modes import Projections
from qlora_cli.model.sliced_mlp import SlicedMLP, slice_tokens, slice_working_bytes
from qlora_cli.sources.spec import ModelSpec


class DenseMLP(nn.Module):
    """The MLP of every family's layers. It holds no weights: its projection groups sit with the layer's
    others, in `DecoderLayer.projections`."""

    groups = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    checkpoint_module = "mlp"
    # down's output is the layer's: a recompute, which only keeps what backward saves, skips its GEMM.
    down_output_unread_in_recompute = True
    # No routed experts, so none of their LoRA (MoEMLP's).
    expert_lora = None
    # No router: the load-balancing loss leaves its layer out.
    routes_tokens = False

    def __init__(self, spec: ModelSpec, lora: LoRAConfig | None = None):
        """`lora` is the registry's common argument: this MLP's LoRA is its projection groups'."""
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.scratch: torch.Tensor | None = None

    @staticmethod
    def kept_activations(spec: ModelSpec) -> int:
        """Values a token keeps for the MLP's backward (bf16 units): gate/up's output."""
        return 2 * spec.intermediate_size

    @staticmethod
    def lora_kept_activations(spec: ModelSpec, lora: LoRAConfig) -> int:
        """None beyond kept_activations: its projections' LoRA is counted with the projections'."""
        return 0

    def reset_lora(self, generator: torch.Generator | None = None) -> None:
        """Nothing: its LoRA is the layer's projection groups', which reset their own."""

    @staticmethod
    def backward_working_bytes(spec: ModelSpec, tokens: int) -> int:
        """What its backward holds at once: one slice's gate/up output and its gradient."""
        return slice_working_bytes(tokens, spec.intermediate_size)

    def scratch_numel(self) -> int:
        """Of the layer's shared weight buffer it needs none itself: its groups are the layer's."""
        return 0

    def forward(self, h, project: Projections, layer):
        """`layer` is the DecoderLayer it runs in: its projection groups and its recompute state."""
        tokens = h.numel() // h.shape[-1]
        per_slice = slice_tokens(tokens, self.intermediate_size, h.element_size())
        if per_slice == tokens:
            return self._whole(h, project)
        mlp = [layer.projections[group] for group in self.groups]
        trainables = [p for group in mlp for p in group.parameters() if p.requires_grad]

        def mlp_slice(part, token_offset):
            return self._whole(part, project, token_offset)

        return SlicedMLP.apply(mlp_slice, layer.recomputation, layer.recomputing, per_slice, h, *trainables)

    @staticmethod
    def _whole(h, project: Projections, token_offset=0):
        gate_up = project.gate_up(h, token_offset)
        return project.down(project.swiglu(gate_up), token_offset)
