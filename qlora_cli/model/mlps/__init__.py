"""The MLPs of a decoder layer, a module each (the dense SwiGLU MLP, the mixture of experts, whose
load-balancing loss is balance.py's), and MLPS, the registry keyed by ModelSpec.mlp_types.
Imports qlora_kernels, qlora_cli.core, sources, and model's modes, sliced_mlp and lora."""

from qlora_cli.model.mlps.dense import DenseMLP
from qlora_cli.model.mlps.moe import MoEMLP
from qlora_cli.sources.spec import DENSE_MLP, MOE_MLP

# MLP kind (ModelSpec.mlp_types) -> its module.
MLPS = {DENSE_MLP: DenseMLP, MOE_MLP: MoEMLP}


__all__ = ["MLPS", "DenseMLP", "MoEMLP"]
