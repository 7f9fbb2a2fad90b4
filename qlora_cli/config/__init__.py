"""What a run is asked to do: the config schema, its checks, YAML and --set loading, and Axolotl's keys.
Imports only qlora_cli.core."""

from qlora_cli.config.loading import (
    apply_override,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
)
from qlora_cli.config.schema import DatasetConfig, TrainConfig

__all__ = [
    "DatasetConfig",
    "TrainConfig",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "parse_override",
    "save_config",
]
