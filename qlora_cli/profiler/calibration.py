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
    # Measured only for a run whose frozen projections multiply in FP8 (config key fp8).
    fp8_matmul_tflops: float | None = None


def _matmul_ms(size: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return measure(lambda: a @ b, device, repeats=repeats).min_ms


def _fp8_matmul_ms(size: int, device: torch.device, repeats: int) -> float:
    """A rowwise-scaled e4m3 GEMM, the kind kernels.fp8 runs for the frozen projections."""
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    a_scale = torch.ones(size, 1, device=device)
    b_scale = torch.ones(1, size, device=device)
    return measure(
        lambda: torch._scaled_mm(a, b.T, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16),
        device,
        repeats=repeats,
    ).min_ms


def _copy_ms(size_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(size_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device, repeats=repeats).min_ms


def calibrate(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, *, fp8: bool = False
) -> Calibration:
    """One large matmul (TFLOP/s) and one large device copy (GB/s, read + write), best of a few;
    with `fp8`, one large e4m3 matmul too (on CUDA, where fp8 runs).

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
        fp8_matmul_tflops=2.0 * size**3 / (_fp8_matmul_ms(size, device, repeats) * 1e-3) / 1e12
        if fp8 and cuda
        else None,
    )
