"""What each family becomes in llama.cpp: its GGUF architecture, the metadata that architecture reads
beyond the common keys, and how a Hugging Face tensor turns into llama.cpp's.

- qwen2 / qwen3: the tensors as they are. llama.cpp applies NeoX-style RoPE to these, as transformers
  does, so Q and K keep their row order.
- qwen35 (Qwen3.5/3.6): every zero-centred norm x̂·(1+w) is stored as the plain weight 1+w, but not
  linear attention's gated norm, which is a plain x̂·w already; A_log is stored as -exp(A_log), the
  decay rate llama.cpp multiplies by; dt_bias is `ssm_dt.bias`; the conv's [C, 1, K] weight is [C, K].
  Where there are more value heads than key heads, transformers pairs value head j with key head
  j // r (grouped) but llama.cpp broadcasts key heads by tiling (head j uses key head j % H_k), so the
  value-side heads (v rows of in_proj_qkv and of the conv, z, a, b, A_log, dt_bias, out_proj's columns)
  are reordered from grouped to tiled. q_proj keeps query and gate interleaved per head, as llama.cpp
  splits them.
- llama (Llama 3.x, Mistral): llama.cpp rotates adjacent pairs, transformers the two halves of each
  head, so Q's and K's rows are permuted within each head; llama3 RoPE becomes `rope_freqs.weight`,
  the factor each frequency is divided by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.families import family
from qlora_cli.sources.rope import RopeScaling, rope_frequencies
from qlora_cli.sources.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec

ROPE_FREQS = "rope_freqs.weight"
_DEFAULT_ROPE = RopeScaling()
# Tensors kept in f32 whatever the file type: small, and the conv's rows (K taps) fit no quant block.
_F32_SUFFIXES = ("linear_attn.conv1d.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")
_GATED_NORM = "linear_attn.norm.weight"
# (suffix, how many values make one value-side head: "v" for value_head_dim, 1 for a per-head scalar)
_VALUE_HEAD_ROWS = {
    "linear_attn.in_proj_z.weight": "v",
    "linear_attn.in_proj_a.weight": 1,
    "linear_attn.in_proj_b.weight": 1,
    "linear_attn.A_log": 1,
    "linear_attn.dt_bias": 1,
}


@dataclass(frozen=True)
class Architecture:
    """One family's GGUF form: `arch` is the gguf package's MODEL_ARCH member name."""

    arch: str
    spec: ModelSpec

    def gguf_name(self, name: str) -> str:
        """The Hugging Face name gguf's TensorNameMap knows this tensor by."""
        return name.replace("linear_attn.dt_bias", "linear_attn.dt_proj.bias")

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.arch == "QWEN35" and name.endswith("linear_attn.conv1d.weight"):
            return (shape[0], shape[2])
        return shape

    def keeps_f32(self, name: str) -> bool:
        return name.endswith(_F32_SUFFIXES)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.arch == "QWEN35":
            return self._qwen35(name, tensor)
        if self.arch == "LLAMA":
            return self._llama(name, tensor)
        return tensor

    def _qwen35(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("norm.weight") and not name.endswith(_GATED_NORM):
            return tensor.float() + 1
        linear = self.spec.linear_attention
        if name.endswith("linear_attn.A_log"):
            tensor = -tensor.float().exp()
        if name.endswith("linear_attn.conv1d.weight"):
            tensor = tensor[:, 0, :]
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
            qk = 2 * linear.key_dim
            return torch.cat([tensor[:qk], self._tile_value_heads(tensor[qk:], linear.value_head_dim)])
        if name.endswith("linear_attn.out_proj.weight"):
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

    def _llama(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = {"self_attn.q_proj": self.spec.num_heads, "self_attn.k_proj": self.spec.num_kv_heads}
        for module, count in heads.items():
            if name.endswith((f"{module}.weight", f"{module}.bias")):
                return pairwise_rope_rows(tensor, count)
        return tensor

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors llama.cpp reads that the checkpoint has none of, by GGUF name."""
        if self.arch == "LLAMA" and self.spec.rope_scaling.rope_type == "llama3":
            default = rope_frequencies(self.spec.rope_theta, self.spec.rotary_dim, _DEFAULT_ROPE)[0]
            return {ROPE_FREQS: default / self.spec.rope_frequencies()[0]}
        return {}

    def add_metadata(self, writer, gguf) -> None:
        spec = self.spec
        writer.add_rope_dimension_count(spec.rotary_dim)
        _add_rope_scaling(writer, gguf, spec, self.arch)
        if self.arch != "QWEN35":
            return
        linear = spec.linear_attention
        sections = list(spec.mrope_section or (spec.rotary_dim // 2,))
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
        writer.add_full_attention_interval(full_attention_interval(spec))
        writer.add_ssm_conv_kernel(linear.conv_kernel)
        writer.add_ssm_state_size(linear.key_head_dim)
        writer.add_ssm_group_count(linear.num_key_heads)
        writer.add_ssm_time_step_rank(linear.num_value_heads)
        writer.add_ssm_inner_size(linear.value_dim)


def pairwise_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from transformers' halves order to llama.cpp's adjacent pairs: within a head,
    row 2i is row i and row 2i+1 is row i + head_dim/2."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def full_attention_interval(spec: ModelSpec) -> int:
    """Every how many layers one is full attention: llama.cpp derives Qwen3.5's layer kinds from it."""
    interval = spec.layer_types.index(FULL_ATTENTION) + 1
    periodic = tuple(
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(spec.num_layers)
    )
    if spec.layer_types != periodic:
        raise QLoraError(
            "--gguf: llama.cpp's qwen35 takes one full-attention layer every N layers; this model's "
            f"layer_types {list(spec.layer_types)} follow no such pattern"
        )
    return interval


_ROPE_SCALING_TYPES = {"linear": "LINEAR", "yarn": "YARN"}


def _add_rope_scaling(writer, gguf, spec: ModelSpec, arch: str) -> None:
    """The RoPE scaling keys llama.cpp's converter writes: linear and yarn in metadata, llama3 as the
    rope_freqs tensor (llama arch only); dynamic rescales only past max_position_embeddings."""
    scaling = spec.rope_scaling
    if scaling.rope_type == "llama3" and arch != "LLAMA":
        raise QLoraError(f"--gguf: llama3 RoPE scaling is not something llama.cpp's {arch.lower()} reads")
    if scaling.rope_type not in _ROPE_SCALING_TYPES:
        return
    writer.add_rope_scaling_type(getattr(gguf.RopeScalingType, _ROPE_SCALING_TYPES[scaling.rope_type]))
    writer.add_rope_scaling_factor(scaling.factor)
    if scaling.rope_type == "yarn":
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        if scaling.attention_factor is not None:
            writer.add_rope_scaling_yarn_attn_factor(scaling.attention_factor)
        if scaling.beta_fast:
            writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
        if scaling.beta_slow:
            writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)


def architecture(spec: ModelSpec) -> Architecture:
    return Architecture(family(spec.model_type, "--gguf").gguf_architecture, spec)
