"""What a config means for the model: the device, the compute dtype and the adapter's shape.

Training, profiling and export all derive these from a TrainConfig the same way; keeping them here
lets export rebuild a run's model without importing the training loop.
"""

from __future__ import annotations

import re

import torch

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import count
from qlora_cli.model.lora import LoRAConfig
from qlora_kernels import TRITON_AVAILABLE, triton_setup_error


def select_device(name: str, option: str = "config key 'device'") -> torch.device:
    """The torch device `name` asks for: auto (CUDA when there is one), cpu, cuda or cuda:N; `option`
    names where the name came from, for the error line."""
    if error := triton_setup_error():
        raise QLoraError(error)
    index = re.fullmatch(r"cuda:(\d+)", name)
    if name not in ("auto", "cpu", "cuda") and index is None:
        raise QLoraError(f"{option} must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise QLoraError(f"{option} is {name!r} but no CUDA device is available")
    if index is not None and int(index[1]) >= torch.cuda.device_count():
        devices = torch.cuda.device_count()
        names = "cuda:0" if devices == 1 else f"cuda:0 to cuda:{devices - 1}"
        raise QLoraError(
            f"{option} is {name!r} but this machine has {count(devices, 'CUDA device')} ({names})"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


FP8_CAPABILITY = (8, 9)


def fp8_problem(device: torch.device) -> str | None:
    """Why this machine cannot multiply in FP8, or None: FP8 tensor cores start with Ada and
    Hopper (compute capability 8.9), and torch's FP8 GEMM and Triton's e4m3 type must exist."""
    wanted = "config key 'fp8' needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)"
    if device.type != "cuda":
        return f"{wanted}; this run is on the {device.type.upper()}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{wanted}; {device} is {name}, compute capability {capability[0]}.{capability[1]}"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"config key 'fp8' needs torch's FP8 GEMM (torch._scaled_mm), which torch {torch.__version__} lacks"
    if not TRITON_AVAILABLE:
        return "config key 'fp8' needs triton (pip install triton): its kernels quantize to e4m3"
    import triton.language as tl

    if not hasattr(tl, "float8e4nv"):
        return "config key 'fp8' needs a triton with the e4m3 type (float8e4nv): upgrade triton"
    return None


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.bf16 is True or (config.bf16 == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def lora_config(config: TrainConfig) -> LoRAConfig:
    """The adapter shape a config asks for."""
    return LoRAConfig(
        r=config.lora_r,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        target_modules=tuple(config.target_modules),
        use_rslora=config.peft_use_rslora,
        train_norms=config.train_norms,
        expert_targets=config.expert_targets,
    )
