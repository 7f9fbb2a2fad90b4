"""The token mixers of a decoder layer, a module per layer kind, and MIXERS, the registry keyed by kind.
Imports qlora_kernels, qlora_cli.core, sources, and model's modes, sizes and sliced_mlp."""

from qlora_cli.model.mixers.attention import Attention
from qlora_cli.model.mixers.gated_deltanet import GatedDeltaNet
from qlora_cli.sources.spec import FULL_ATTENTION, LINEAR_ATTENTION

# Layer kind (ModelSpec.layer_types) -> its mixer, in the order adapters list their norms.
MIXERS = {FULL_ATTENTION: Attention, LINEAR_ATTENTION: GatedDeltaNet}

__all__ = ["MIXERS", "Attention", "GatedDeltaNet"]
