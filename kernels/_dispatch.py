"""Which implementation a public kernel function runs."""

import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on; read per call so tests can switch paths."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def references_forced() -> bool:
    """QLORA_KERNELS=reference runs the torch references on CUDA too: the numerical truth for GPU tests."""
    return os.environ.get("QLORA_KERNELS") == "reference"


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors take Triton; CPU tensors take it only inside the interpreter."""
    return (x.is_cuda or interpreting()) and not references_forced()
