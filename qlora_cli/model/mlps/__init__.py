"""The MLPs of a decoder layer, a module each: the dense SwiGLU MLP every family has.
Imports qlora_kernels, qlora_cli.core, sources, and model's modes and sliced_mlp."""

from qlora_cli.model.mlps.dense import DenseMLP

__all__ = ["DenseMLP"]
