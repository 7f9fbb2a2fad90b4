"""The roofline the profile compares against: peaks measured on the spot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlora_cli.profiler.timing import measure


@dataclass
class Calibration:
    device: str
    dtype: str
    matmul_size: int
    matmul_tflops: float
    copy_mib: int
    copy_gbps: float


def _matmul_ms(size: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return measure(lambda: a @ b, device, repeats=repeats).min_ms


def _copy_ms(size_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(size_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device, repeats=repeats).min_ms


def calibrate(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Calibration:
    """One large matmul (TFLOP/s) and one large device copy (GB/s, read + write), best of a few.

    On CUDA the matmul runs in `dtype` (bf16 for training); on the CPU in fp32.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype if cuda else torch.float32
    size, copy_mib, repeats = (8192, 1024, 10) if cuda else (1024, 64, 3)
    matmul_ms = _matmul_ms(size, device, dtype, repeats)
    copy_bytes = copy_mib * 2**20
    copy_ms = _copy_ms(copy_bytes, device, repeats)
    return Calibration(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        dtype=str(dtype).removeprefix("torch."),
        matmul_size=size,
        matmul_tflops=2.0 * size**3 / (matmul_ms * 1e-3) / 1e12,
        copy_mib=copy_mib,
        copy_gbps=2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9,
    )
