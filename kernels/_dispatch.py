"""Which implementation a public kernel function runs."""

import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on; read per call so tests can switch paths."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors take Triton; CPU tensors take it only inside the interpreter."""
    return x.is_cuda or interpreting()
