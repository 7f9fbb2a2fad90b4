"""Frozen-weight formats: what a base weight is stored as, and every rule that depends on it.

Kernels and the model ask `frozen_format(weight)` instead of testing a weight's type, so a new
format is one module here, registered with `register_format`.
"""

from qlora_kernels.formats.base import FrozenFormat, FrozenWeight, frozen_format, register_format
from qlora_kernels.formats.dense import DENSE
from qlora_kernels.formats.nf4 import NF4

__all__ = ["DENSE", "NF4", "FrozenFormat", "FrozenWeight", "frozen_format", "register_format"]
