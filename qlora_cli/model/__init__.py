"""The decoder on kernels/: NF4 projections with LoRA, the layers, the memory planner, offload and the
sliced MLP. Imports qlora_kernels, qlora_cli.core, config and sources."""

from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import compute_dtype, lora_config, select_device
from qlora_cli.model.lora import LoRAConfig

__all__ = ["LoRAConfig", "QLoRAModel", "compute_dtype", "lora_config", "select_device"]
