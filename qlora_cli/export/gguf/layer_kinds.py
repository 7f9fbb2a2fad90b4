"""Each layer kind's own tensors as llama.cpp reads them, a class per kind in GGUF_LAYER_KINDS (keyed as
ModelSpec.layer_types names kinds); what the whole architecture does to every layer, its norms and RoPE
rows, is architectures.py's.

- full attention: its tensors as they are.
- Gated DeltaNet (Qwen3.5's linear attention): A_log is stored as -exp(A_log), the decay rate llama.cpp
  multiplies by; dt_bias is `ssm_dt.bias`; the conv's [C, 1, K] weight is [C, K]; its gated norm is a
  plain x̂·w. Where there are more value heads than key heads, transformers pairs value head j with key
  head j // r (grouped) but llama.cpp broadcasts key heads by tiling (head j uses key head j % H_k), so
  the value-side heads (v rows of in_proj_qkv and of the conv, z, a, b, A_log, dt_bias, out_proj's
  columns) are reordered from grouped to tiled.
"""

from __future__ import annotations

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.gguf.parts import Part
from qlora_cli.sources.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec


class KindTensors:
    """A layer kind's tensors (those under `prefix` in a layer) as transformers writes them, which is
    how llama.cpp reads full attention's, and every tensor outside a kind's own."""

    prefix = "self_attn."

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def part_of(self, name: str) -> Part | None:
        """The tensor of the file that this streamed one is a part of (parts.py), or None: its own."""
        return None

    def gguf_name(self, name: str) -> str:
        return name

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def keeps_f32(self, name: str) -> bool:
        return False

    def plain_norm(self, name: str) -> bool:
        """Whether this norm scales by w even in a family whose norms scale by 1 + w."""
        return False

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def add_metadata(self, writer) -> None:
        """The keys llama.cpp reads for this kind beyond the architecture's."""


# (suffix, how many values make one value-side head: "v" for value_head_dim, 1 for a per-head scalar)
_VALUE_HEAD_ROWS = {
    "in_proj_z.weight": "v",
    "in_proj_a.weight": 1,
    "in_proj_b.weight": 1,
    "A_log": 1,
    "dt_bias": 1,
}


class GatedDeltaNetTensors(KindTensors):
    """Qwen3.5's linear attention as llama.cpp's qwen35 reads it: its `ssm_*` tensors and keys."""

    prefix = "linear_attn."
    # Small, and the conv's rows (K taps) fit no quant block: f32 whatever the file type.
    _F32 = ("conv1d.weight", "in_proj_a.weight", "in_proj_b.weight")

    def gguf_name(self, name: str) -> str:
        return name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], shape[2]) if name.endswith("conv1d.weight") else shape

    def keeps_f32(self, name: str) -> bool:
        return name.endswith(self._F32)

    def plain_norm(self, name: str) -> bool:
        return name.endswith("linear_attn.norm.weight")

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        linear = self.spec.linear_attention
        if name.endswith("A_log"):
            tensor = -tensor.float().exp()
        if name.endswith("conv1d.weight"):
            tensor = tensor[:, 0, :]
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk = 2 * linear.key_dim
            return torch.cat([tensor[:qk], self._tile_value_heads(tensor[qk:], linear.value_head_dim)])
        if name.endswith("out_proj.weight"):
            return self._tile_value_heads(tensor.T, linear.value_head_dim).T
        for suffix, size in _VALUE_HEAD_ROWS.items():
            if name.endswith(suffix):
                return self._tile_value_heads(tensor, linear.value_head_dim if size == "v" else 1)
        return tensor

    def _tile_value_heads(self, rows: torch.Tensor, head_size: int) -> torch.Tensor:
        """Value-side heads from grouped by key head ([k0v0, k0v1, k1v0, k1v1]) to tiled ([k0v0, k1v0,
        k0v1, k1v1]); rows hold head_size values per head."""
        linear = self.spec.linear_attention
        per_key = linear.num_value_heads // linear.num_key_heads
        grouped = rows.reshape(linear.num_key_heads, per_key, head_size, *rows.shape[1:])
        return grouped.transpose(0, 1).reshape(rows.shape).contiguous()

    def add_metadata(self, writer) -> None:
        linear = self.spec.linear_attention
        writer.add_ssm_conv_kernel(linear.conv_kernel)
        writer.add_ssm_state_size(linear.key_head_dim)
        writer.add_ssm_group_count(linear.num_key_heads)
        writer.add_ssm_time_step_rank(linear.num_value_heads)
        writer.add_ssm_inner_size(linear.value_dim)


GGUF_LAYER_KINDS: dict[str, type[KindTensors]] = {
    FULL_ATTENTION: KindTensors,
    LINEAR_ATTENTION: GatedDeltaNetTensors,
}


def layer_kinds(spec: ModelSpec) -> list[KindTensors]:
    """The GGUF form of each layer kind the model has, or the line refusing a kind llama.cpp cannot take."""
    kinds = []
    for kind in dict.fromkeys(spec.layer_types):
        if kind not in GGUF_LAYER_KINDS:
            raise QLoraError(f"--gguf: qlora has no GGUF form for layers of kind '{kind}'")
        kinds.append(GGUF_LAYER_KINDS[kind](spec))
    return kinds
