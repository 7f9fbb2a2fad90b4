"""`qlora profile` and `qlora train --profile`: a run driven through the public step API, timed per op."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import check_writable, reason, replace_file, temp_beside
from qlora_cli.core.wording import count
from qlora_cli.profiler.calibration import calibrate
from qlora_cli.profiler.recorder import OpProfiler
from qlora_cli.profiler.report import ProfileReport, profile_report
from qlora_cli.train.loop import TrainResult, train
from qlora_cli.train.run import build_run
from qlora_cli.train.step import optimizer_step, train_step


def _writable(path: Path | None, option: str) -> Path | None:
    """The file an option names, checked before the run, so a path that cannot be written costs no run."""
    if path is None:
        return None
    path = Path(path)
    try:
        check_writable(path)
    except OSError as err:
        raise QLoraError(f"cannot write {option} {path}: {reason(err, path)}") from None
    return path


def _write(path: Path, text: str, option: str) -> None:
    try:
        replace_file(path, text.encode())
    except OSError as err:
        raise WriteFailed(f"could not write {option} {path}: {reason(err, path)}") from None


def write_trace(step: Callable[[], object], path: Path, device: torch.device) -> None:
    """One step under torch.profiler (CPU, and CUDA when present), as a Chrome trace; ops are
    labelled with their row names."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    labels = OpProfiler(annotate=True)
    with torch.profiler.profile(activities=activities) as trace, labels.step(device):
        step()
    temp = temp_beside(path)
    try:
        trace.export_chrome_trace(str(temp))
        if not temp.is_file():  # torch logs a failed write and returns as if it had written
            raise OSError(errno.EIO, "the profiler wrote no trace", str(path))
        temp.replace(path)
    except OSError as err:
        raise WriteFailed(f"could not write --trace {path}: {reason(err, path)}") from None
    finally:
        temp.unlink(missing_ok=True)


def profile(
    config: TrainConfig,
    *,
    steps: int = 3,
    warmup: int = 1,
    json_path: Path | None = None,
    trace_path: Path | None = None,
    console: Console | None = None,
) -> ProfileReport:
    """Build the run as `qlora train` does, run `warmup` then `steps` timed optimizer steps and
    report per op; nothing is written to output_dir. With trace_path, one more step is traced."""
    if steps < 1:
        raise QLoraError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise QLoraError(f"--warmup must be 0 or more, got {warmup}")
    json_path = _writable(json_path, "--json")
    trace_path = _writable(trace_path, "--trace")
    console = console or OutputConsole(stderr=True)
    run = build_run(config, eager=True)
    torch.manual_seed(config.seed)
    dtype = run.model.embed_tokens.dtype
    console.print(
        f"profiling {run.model.spec.model_type} · {count(run.model.spec.num_layers, 'layer')} on {run.device}: "
        f"{count(warmup, 'warm-up step')} + {count(steps, 'timed step')}"
    )
    calibration = calibrate(run.device, dtype, fp8=config.fp8)
    profiler = OpProfiler(warmup_steps=warmup)

    def one_step(step: int) -> None:
        train_step(run, step)
        optimizer_step(run, step)

    for step in range(warmup + steps):
        with profiler.step(run.device):
            one_step(step)
    report = profile_report(profiler, calibration)
    if trace_path is not None:
        write_trace(lambda: one_step(warmup + steps), trace_path, run.device)
    if json_path is not None:
        _write(json_path, json.dumps(report.to_json(), indent=2) + "\n", "--json")
    return report


def profiled_train(
    config: TrainConfig, *, console: Console | None = None
) -> tuple[TrainResult, ProfileReport]:
    """`qlora train --profile`: the ordinary run with every step timed, and its report.

    The first step is left out as warm-up when the run has more; peaks are measured after the run.
    """
    profiler = OpProfiler(warmup_steps=1)
    result = train(config, console=console, observe_step=profiler.step)
    return result, profile_report(profiler, fp8=config.fp8)
