"""The instrumentation the model and the training step call, at the bottom of the profiler.

`timed(op, fn, *args)` wraps each op of the model, `region(op)` the data, optimizer and backward
parts of a step. Off (the default) each costs one `if`: `timed` calls `fn` straight through and
`region` hands back one shared no-op context; nothing syncs, allocates or records. On, inside
`profiling(recorder)`, both hand over to the recorder (qlora_cli/profiler/recorder.py). This module
imports nothing of ours, so anything may call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

_active = None
_NO_REGION = contextlib.nullcontext()


def active_profiler():
    """The recorder of the step running now, or None (the default: profiling off)."""
    return _active


@contextlib.contextmanager
def profiling(recorder) -> Iterator[None]:
    """Hand every timed op and region to `recorder` until the block ends."""
    global _active
    if _active is not None:
        raise RuntimeError("a profiled step is already running")
    _active = recorder
    try:
        yield
    finally:
        _active = None


def timed(op: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), timed under row `op` (and its backward row) when a profiled step runs."""
    if _active is None:
        return fn(*args, **kwargs)
    return _active.time_op(op, fn, args, kwargs)


def region(op: str, tensors: Iterable = ()):
    """A forward-only region (data, optimizer) or a scope (backward); `tensors` size its bytes."""
    if _active is None:
        return _NO_REGION
    return _active.region(op, tensors)
