"""The recorder: the timeline of a profiled step, forward and backward, summed per row.

Inside `OpProfiler.step`, every op stamps the step's timeline where it starts and where it ends:
CUDA events on the GPU, resolved once after the step's synchronize, `time.perf_counter` on the
CPU, where ops run synchronously. Backward times come from identity autograd markers placed on
each op's outputs and inputs: the engine runs the output marker's backward just before the op's
own backward and the input marker's just after it, so the two stamps bracket the op's backward.

The timeline is read back as a stack: each interval between two stamps belongs to the innermost
open region, or to no row ("unattributed") when none is open, so no time is counted twice. A
forward region that opens inside a backward region is a gradient-checkpointing recompute.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from qlora_cli.core.ops import BACKWARD_ROW, SCOPES, Op
from qlora_cli.core.profiling import profiling
from qlora_cli.profiler.lora import LORA_GROUP, lora_call
from qlora_cli.profiler.work import Work, named_arguments, optimizer_work, work_of


class _Stamp:
    """One point of the timeline: a row's region opens or closes there."""

    __slots__ = ("opens", "row", "backward", "flops", "bytes", "when")

    def __init__(self, opens: bool, row: Op | None, backward: bool, when, flops=0.0, moved=0.0):
        self.opens = opens
        self.row = row
        self.backward = backward
        self.when = when
        self.flops = flops
        self.bytes = moved


class _Marker(torch.autograd.Function):
    """Identity whose backward stamps the timeline: on an op's outputs it opens the op's backward
    row, on its inputs it closes it."""

    @staticmethod
    def forward(ctx, profiler, opens, row, work, *tensors):
        ctx.set_materialize_grads(False)
        ctx.stamp = (profiler, opens, row, work)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        profiler, opens, row, work = ctx.stamp
        profiler.stamp(opens, row, backward=True, flops=work.bwd_flops, moved=work.bwd_bytes)
        return (None, None, None, None, *grads)


class _Region:
    __slots__ = ("profiler", "row", "tensors")

    def __init__(self, profiler: OpProfiler, op: Op, tensors: Iterable[torch.Tensor]):
        self.profiler = profiler
        self.row = None if op in SCOPES else op
        self.tensors = tensors

    def __enter__(self):
        work = optimizer_work(self.tensors) if self.row == Op.OPTIMIZER else Work()
        self.profiler.stamp(True, self.row, flops=work.flops, moved=work.bytes)

    def __exit__(self, *exc):
        self.profiler.stamp(False, self.row)


@dataclass
class RowStat:
    ms: float = 0.0
    calls: int = 0
    recomputed: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class StepRecord:
    total_ms: float
    rows: dict[Op, RowStat]
    tokens: int
    micro_batches: int


class OpProfiler:
    """Records the timeline of each step run under `step()` and sums it per row.

    The first `warmup_steps` recorded steps are left out of the report while later ones exist.
    """

    def __init__(self, warmup_steps: int = 0, *, annotate: bool = False):
        self.warmup_steps = warmup_steps
        self.annotate = annotate
        self.steps: list[StepRecord] = []
        self.stamps_recorded = 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        # How the step first called each op that can carry LoRA, for the LoRA share: (fn, call).
        self.groups: dict[str, tuple[Callable, dict]] = {}
        self.timeline: list[_Stamp] = []
        self._events: list[torch.cuda.Event] = []
        self._recording = False
        self._tokens = 0
        self._micro_batches = 0

    @contextlib.contextmanager
    def step(self, device: torch.device | str):
        """Profile one optimizer step: synchronize, time every op inside, synchronize, resolve."""
        self.device = torch.device(device)
        self.timeline, self._tokens, self._micro_batches = [], 0, 0
        _synchronize(self.device)
        start = time.perf_counter()
        self._recording = True
        try:
            with profiling(self):
                yield self
        finally:
            self._recording = False
        _synchronize(self.device)
        total_ms = (time.perf_counter() - start) * 1e3
        self.steps.append(StepRecord(total_ms, self.resolve(), self._tokens, self._micro_batches))

    def stamp(
        self, opens: bool, row: Op | None, *, backward: bool = False, flops=0.0, moved=0.0
    ) -> _Stamp | None:
        if not self._recording:
            return None
        if self.device.type == "cuda":
            index = len(self.timeline)
            if index == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            when = self._events[index]
            when.record()
        else:
            when = time.perf_counter()
        entry = _Stamp(opens, row, backward, when, flops, moved)
        self.timeline.append(entry)
        self.stamps_recorded += 1
        return entry

    def region(self, op: Op, tensors: Iterable[torch.Tensor]) -> _Region:
        return _Region(self, Op(op), tensors)

    def time_op(self, op: Op, fn: Callable, args: tuple, kwargs: dict):
        op = Op(op)
        values = named_arguments(fn, args, kwargs)
        backward_row = BACKWARD_ROW.get(op)
        marking = backward_row is not None and torch.is_grad_enabled()
        self._note_call(op, fn, values)
        if marking:
            args = self._mark(args, False, backward_row, None)
        opened = self.stamp(True, op)
        try:
            if self.annotate:
                with torch.profiler.record_function(op.value):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
        finally:
            # Checkpointing ends a recompute by raising out of the op that saves the layer's last
            # tensor; the row closes there, or that op's backward would be counted under it.
            self.stamp(False, op)
        work = work_of(op, values, out[0] if isinstance(out, tuple) else out)
        opened.flops, opened.bytes = work.flops, work.bytes
        if marking:
            out = self._mark(out, True, backward_row, work)
        return out

    def _note_call(self, op: Op, fn: Callable, values: dict) -> None:
        if op == Op.EMBEDDING:
            self._tokens += values["input"].numel()
            self._micro_batches += 1
            self.dtype = values["weight"].dtype
        elif op in LORA_GROUP and LORA_GROUP[op] not in self.groups:
            self.groups[LORA_GROUP[op]] = (fn, lora_call(op, values))

    def _mark(self, values, opens: bool, row: Op, work: Work | None):
        """`values` (a tensor, a tuple of outputs, or the argument tuple) with those needing grad marked."""
        single = not isinstance(values, tuple)
        items = (values,) if single else values
        where = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return values
        marked = _Marker.apply(self, opens, row, work or Work(), *(items[i] for i in where))
        items = list(items)
        for i, tensor in zip(where, marked, strict=True):
            items[i] = tensor
        return items[0] if single else tuple(items)

    def _times_ms(self) -> list[float]:
        if not self.timeline:
            return []
        if self.device.type == "cuda":
            first = self.timeline[0].when
            return [first.elapsed_time(entry.when) for entry in self.timeline]
        start = self.timeline[0].when
        return [(entry.when - start) * 1e3 for entry in self.timeline]

    def resolve(self) -> dict[Op, RowStat]:
        """The step's timeline summed per row: each interval to the innermost open region; a backward
        region whose input marker never fired (its inputs needed no gradient) closes when the next
        one opens or its scope ends."""
        rows: dict[Op, RowStat] = {}
        stack: list[_Stamp] = []
        previous = None
        for entry, now in zip(self.timeline, self._times_ms(), strict=True):
            if previous is not None and stack and stack[-1].row is not None:
                rows.setdefault(stack[-1].row, RowStat()).ms += now - previous
            previous = now
            if not entry.opens:
                for depth in range(len(stack) - 1, -1, -1):
                    if stack[depth].row == entry.row:
                        del stack[depth:]
                        break
                continue
            if entry.backward:
                while stack and stack[-1].backward:
                    stack.pop()
            stack.append(entry)
            if entry.row is None:
                continue
            stat = rows.setdefault(entry.row, RowStat())
            stat.calls += 1
            stat.flops += entry.flops
            stat.bytes += entry.bytes
            # A forward op inside a backward row, or inside the backward scope before any row opened
            # (a layer whose first backward node is untimed unpacks its recompute there), reruns.
            if not entry.backward and any(open_.backward or open_.row is None for open_ in stack):
                stat.recomputed += 1
        return rows

    def counted_steps(self) -> list[StepRecord]:
        return self.steps[self.warmup_steps :] or self.steps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
