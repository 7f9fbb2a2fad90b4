"""How long a call takes on a device: the one timing method of the profiler and the benchmarks.

On CUDA each timed call sits between two CUDA events, with no host synchronisation between calls,
so the times are the GPU's; with `graph=True` the call is captured once as a CUDA graph and its
replays are timed, which leaves out Python's launch overhead. On the CPU, where ops run
synchronously, the wall clock times each call. Both report the fastest call (a peak, as a roofline
wants) and the median (a typical call, robust to a stray slow one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over the timed calls."""

    min_ms: float
    median_ms: float
    calls: int
    method: str  # "cuda events", "cuda graph replay" or "wall clock"

    def to_json(self) -> dict:
        return {
            "min_ms": self.min_ms,
            "median_ms": self.median_ms,
            "calls": self.calls,
            "method": self.method,
        }


def measure(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    repeats: int = 10,
    warmup: int = 1,
    graph: bool = False,
) -> Timing:
    """Call `fn` `warmup` times untimed, then `repeats` times timed (or capture it and replay it)."""
    device = torch.device(device)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if graph and device.type != "cuda":
        raise ValueError(f"CUDA-graph replay needs a CUDA device, got {device}")
    if graph:
        return _summary(_replay_ms(fn, device, repeats, warmup), "cuda graph replay")
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return _summary(_event_ms(fn, device, repeats), "cuda events")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return _summary(times, "wall clock")


def _summary(times: list[float], method: str) -> Timing:
    return Timing(min(times), statistics.median(times), len(times), method)


def _event_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _replay_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Warm-up calls on a side stream (as a capture needs), one capture, then timed replays."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    captured.replay()
    return _event_ms(captured.replay, device, repeats)
