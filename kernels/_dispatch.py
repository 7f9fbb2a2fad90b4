"""Which implementation a public kernel function runs, and the machine it launches on."""

import functools
import os
import warnings

import torch


def _triton_importable() -> bool:
    """pyproject installs triton on Linux only; macOS and Windows installs run the references."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_AVAILABLE = _triton_importable()


def interpreting() -> bool:
    """Triton's CPU interpreter is on; read per call so tests can switch paths."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def references_forced() -> bool:
    """QLORA_KERNELS=reference runs the torch references on CUDA too: the numerical truth for GPU tests."""
    return os.environ.get("QLORA_KERNELS") == "reference"


def triton_setup_error() -> str | None:
    """Why the kernels cannot run as the environment asks (the interpreter without triton), or None."""
    if interpreting() and not TRITON_AVAILABLE:
        return (
            "TRITON_INTERPRET=1 asks for Triton's interpreter, but triton is not installed: "
            "install it (pip install triton) or unset TRITON_INTERPRET to run the torch references"
        )
    return None


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors take Triton; CPU tensors take it only inside the interpreter.

    Without triton, CUDA tensors take the references (with one warning per process), and the
    interpreter, which cannot run, is an error rather than a silent switch to the references.
    """
    if references_forced() or not (x.is_cuda or interpreting()):
        return False
    if TRITON_AVAILABLE:
        return True
    if error := triton_setup_error():
        raise RuntimeError(error)
    _warn_cuda_runs_references()
    return False


@functools.cache
def _warn_cuda_runs_references() -> None:
    warnings.warn(
        "triton is not installed, so CUDA tensors run the torch references (slower); pip install triton",
        RuntimeWarning,
        stacklevel=4,
    )


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Launch sizes scale with the SM count; the interpreter gets a small GPU's worth."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
