"""Each MLP kind's tensors as llama.cpp reads them, a class per kind in GGUF_MLP_KINDS (keyed as
ModelSpec.mlp_types names kinds), as layer_kinds.py has the token mixers'; which MLP kinds an
architecture takes is architectures.py's.

- dense: gate, up and down as transformers writes them (`ffn_gate`, `ffn_up`, `ffn_down`).
- mixture of experts: llama.cpp holds each projection of a layer's routed experts as one tensor
  [experts, out, in] (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), of which each expert's matrix,
  streamed one by one, is a part. The router (`ffn_gate_inp`) and the shared expert's gate
  (`ffn_gate_inp_shexp`) stay f32: qlora's model never quantizes them, and llama.cpp's converter keeps
  its routers so. The shared expert is a dense MLP's tensors under `ffn_*_shexp`. llama.cpp's MoE
  graphs always renormalise a token's top-k expert weights to sum to 1, so a model that does not
  (norm_topk_prob false) is refused.
"""

from __future__ import annotations

import re

from qlora_cli.core.errors import QLoraError
from qlora_cli.export.gguf.layer_kinds import KindTensors
from qlora_cli.export.gguf.parts import Part
from qlora_cli.sources.spec import DENSE_MLP, MOE_MLP, ModelSpec


class DenseMLPTensors(KindTensors):
    """The dense SwiGLU MLP's tensors, as transformers writes them."""

    prefix = "mlp."


# A routed expert's matrix: (the layer's experts, the expert's index, its projection's weight).
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(\w+\.weight)")


class MoETensors(DenseMLPTensors):
    """The routed experts, their router and a shared expert with its gate, as llama.cpp's qwen3moe and
    qwen35moe read them."""

    _F32 = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if not spec.moe.norm_topk_prob:
            raise QLoraError(
                "--gguf: llama.cpp renormalises each token's top-k expert weights to sum to 1, and this "
                "model's config.json has norm_topk_prob false; llama.cpp cannot compute it"
            )

    def part_of(self, name: str) -> Part | None:
        match = _EXPERT.fullmatch(name)
        if match is None:
            return None
        experts, index, projection = match.groups()
        return Part(f"{experts}.{projection}", int(index), self.spec.moe.num_experts)

    def keeps_f32(self, name: str) -> bool:
        return name.endswith(self._F32)

    def add_metadata(self, writer) -> None:
        moe = self.spec.moe
        writer.add_expert_count(moe.num_experts)
        writer.add_expert_used_count(moe.top_k)
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
        if moe.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)


GGUF_MLP_KINDS: dict[str, type[KindTensors]] = {
    DENSE_MLP: DenseMLPTensors,
    MOE_MLP: MoETensors,
}


def mlp_kinds(spec: ModelSpec) -> list[KindTensors]:
    """The GGUF form of each MLP kind the model has, or the line refusing one llama.cpp cannot take."""
    kinds = []
    for kind in dict.fromkeys(spec.mlp_types):
        if kind not in GGUF_MLP_KINDS:
            raise QLoraError(f"--gguf: qlora has no GGUF form for MLPs of kind '{kind}'")
        kinds.append(GGUF_MLP_KINDS[kind](spec))
    return kinds
