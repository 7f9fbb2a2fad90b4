"""Each GPU kernel's time in a call, summed by name from torch's profiler: where a step's time goes,
printed beside the timings that benchmark it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_ms(run: Callable[[], object], repeats: int = 5) -> dict[str, float]:
    """Mean milliseconds per call of each kernel `run` launches (once before, untimed, so nothing
    compiles or autotunes inside the profile), the longest first."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    times = {
        event.key: event.device_time_total / repeats / 1000
        for event in profile.key_averages()
        if event.device_time_total > 0
    }
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def kernel_lines(times: dict[str, float], top: int, indent: str = "  ") -> list[str]:
    """The `top` longest kernels, each with its milliseconds and share of the total, then the rest."""
    total = sum(times.values())
    lines = [f"{indent}by kernel (ms): total {total:.3f}"]
    for name, ms in list(times.items())[:top]:
        lines.append(f"{indent}{ms:>10.3f} {ms / total:>6.1%}  {name[:100]}")
    rest = list(times.values())[top:]
    if rest:
        lines.append(f"{indent}{sum(rest):>10.3f} {sum(rest) / total:>6.1%}  {len(rest)} other kernels")
    return lines
