"""The one timing helper of the profiler and the benchmarks: min and median per call."""

import time
import types

import pytest
import torch

from qlora_cli.profiler import timing
from qlora_cli.profiler.timing import measure


def test_wall_clock_times_each_call_after_the_warm_up(monkeypatch):
    """On the CPU each call is timed on its own: the warm-up is left out, min and median are exact."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    durations = iter([50.0, 4.0, 1.0, 3.0, 2.0, 5.0])  # ms; the first call is the warm-up

    def call():
        clock.now += next(durations) / 1e3

    result = measure(call, "cpu", repeats=5, warmup=1)
    assert (result.calls, result.method) == (5, "wall clock")
    assert (result.min_ms, result.median_ms) == pytest.approx((1.0, 3.0))
    assert result.to_json() == pytest.approx(
        {"min_ms": 1.0, "median_ms": 3.0, "calls": 5, "method": "wall clock"}
    )
    with pytest.raises(StopIteration):
        next(durations)


def test_wall_clock_measures_real_time():
    result = measure(lambda: time.sleep(0.004), torch.device("cpu"), repeats=3, warmup=0)
    assert 4.0 <= result.min_ms <= result.median_ms < 1000.0


@pytest.mark.parametrize(
    "options, message",
    [({"repeats": 0}, "repeats must be at least 1"), ({"graph": True}, "needs a CUDA device")],
)
def test_bad_requests(options, message):
    with pytest.raises(ValueError, match=message):
        measure(lambda: None, "cpu", **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_and_graph_replay():
    """Both CUDA methods time the same matmul alike; a captured graph replays without launch overhead."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    events = measure(lambda: torch.matmul(a, a, out=out), "cuda", repeats=20, warmup=3)
    replays = measure(lambda: torch.matmul(a, a, out=out), "cuda", repeats=20, warmup=3, graph=True)
    assert (events.method, replays.method) == ("cuda events", "cuda graph replay")
    for result in (events, replays):
        assert 0 < result.min_ms <= result.median_ms and result.calls == 20
    assert replays.median_ms == pytest.approx(events.median_ms, rel=0.25)
