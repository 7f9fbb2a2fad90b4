"""The decoder on kernels/: NF4 projections with LoRA, the layers, the memory planner, offload and the
sliced MLP. Imports qlora_kernels, qlora_cli.core, config and sources."""

from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.lora import LoRAConfig
from qlora_cli.model.settings import compute_dtype, lora_config, select_device

__all__ = ["LoRAConfig", "QLoRAModel", "compute_dtype", "lora_config", "select_device"]
