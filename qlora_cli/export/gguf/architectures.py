"""What each family becomes in llama.cpp: its GGUF architecture, the metadata that architecture reads
beyond the common keys, and what it does to every layer's tensors; each layer kind's own tensors are
layer_kinds.py's, each MLP kind's mlp_kinds.py's.

- qwen2 / qwen3: the tensors as they are. llama.cpp applies NeoX-style RoPE to these, as transformers
  does, so Q and K keep their row order.
- qwen3moe: qwen3's, with routed experts in every layer: llama.cpp has no dense MLP between them, so a
  model with dense layers (mlp_only_layers, decoder_sparse_step) is refused.
- qwen35 / qwen35moe (Qwen3.5/3.6, dense and MoE): every zero-centred norm x̂·(1+w) is stored as the
  plain weight 1+w (a layer kind may keep a plain norm of its own); q_proj keeps query and gate
  interleaved per head, as llama.cpp splits them; the layer kinds follow from one full-attention layer
  every N. qwen35moe has routed experts in every layer, as the family does.
- llama (Llama 3.x, Mistral): llama.cpp rotates adjacent pairs, transformers the two halves of each
  head, so Q's and K's rows are permuted within each head; llama3 RoPE becomes `rope_freqs.weight`,
  the factor each frequency is divided by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.gguf.layer_kinds import KindTensors, layer_kinds
from qlora_cli.export.gguf.mlp_kinds import mlp_kinds
from qlora_cli.export.gguf.parts import Part
from qlora_cli.sources.families import family
from qlora_cli.sources.rope import RopeScaling, rope_frequencies
from qlora_cli.sources.spec import DENSE_MLP, FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec

ROPE_FREQS = "rope_freqs.weight"
_DEFAULT_ROPE = RopeScaling()
# llama.cpp's Qwen3.5 architectures: the same layers, with a dense MLP or routed experts.
_QWEN35 = ("QWEN35", "QWEN35MOE")
# llama.cpp's architectures with routed experts in every layer and no dense MLP.
_EXPERTS_IN_EVERY_LAYER = ("QWEN3MOE", "QWEN35MOE")


@dataclass(frozen=True)
class Architecture:
    """One family's GGUF form: `arch` is the gguf package's MODEL_ARCH member name, `kinds` the forms
    of its layer kinds and MLP kinds. `part_of` takes a streamed tensor's name; the other methods a
    name of the file's tensors: one that streams whole, or a whole that streamed ones are parts of."""

    arch: str
    spec: ModelSpec
    kinds: tuple[KindTensors, ...]

    def _kind(self, name: str) -> KindTensors:
        """The layer or MLP kind whose own tensor this is; the identity for the others."""
        return next((k for k in self.kinds if f".{k.prefix}" in name), KindTensors(self.spec))

    def part_of(self, name: str) -> Part | None:
        return self._kind(name).part_of(name)

    def gguf_name(self, name: str) -> str:
        """The Hugging Face name gguf's TensorNameMap knows this tensor by."""
        return self._kind(name).gguf_name(name)

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self._kind(name).shape(name, shape)

    def keeps_f32(self, name: str) -> bool:
        return self._kind(name).keeps_f32(name)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        kind = self._kind(name)
        tensor = kind.transform(name, tensor)
        if self.arch in _QWEN35 and name.endswith("norm.weight") and not kind.plain_norm(name):
            return tensor.float() + 1
        if self.arch == "LLAMA":
            return self._llama(name, tensor)
        return tensor

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
        if self.arch in _QWEN35:
            sections = list(spec.mrope_section or (spec.rotary_dim // 2,))
            writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
            writer.add_full_attention_interval(full_attention_interval(spec))
        for kind in self.kinds:
            kind.add_metadata(writer)


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
    """The family's GGUF form, or the line refusing what llama.cpp cannot express."""
    arch = family(spec.model_type, "--gguf").gguf_architecture
    dense = [layer for layer, mlp in enumerate(spec.mlp_types) if mlp == DENSE_MLP]
    if arch in _EXPERTS_IN_EVERY_LAYER and dense:
        raise QLoraError(
            f"--gguf: llama.cpp's {arch.lower()} has routed experts in every layer, and this model's "
            f"layers {dense} are dense MLPs (config.json's mlp_only_layers and decoder_sparse_step)"
        )
    return Architecture(arch, spec, (*layer_kinds(spec), *mlp_kinds(spec)))
