"""Per-op timing of a training step, forward and backward, and the table that shows where it goes.

Off (the default) it costs one `if` per op: `timed(name, fn, *args)` calls `fn` straight through
and `region(name)` hands back one shared no-op context; nothing syncs, allocates or records. On,
inside `OpProfiler.step`, every op stamps the step's timeline where it starts and where it ends:
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
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from qlora_cli.config import TrainConfig
from qlora_cli.errors import QLoraError
from qlora_kernels.linear import lora_linear
from qlora_kernels.swiglu import lora_swiglu

if TYPE_CHECKING:
    from qlora_cli.train import TrainResult

# Forward row of each timed op -> the row its backward goes to. Rows named the same both ways
# (final_norm, lm_head_loss) hold forward and backward together.
BACKWARD_ROW = {
    "rmsnorm_attn": "norm_bwd",
    "qkv_gemm": "qkv_bwd",
    "rope": "rope_bwd",
    "attention": "attn_bwd",
    "o_proj": "o_proj_bwd",
    "rmsnorm_ffn": "norm_bwd",
    "gate_up_gemm": "gate_up_bwd",
    "silu": "swiglu_bwd",
    "down_gemm": "down_bwd",
    "final_norm": "final_norm",
    "lm_head_loss": "lm_head_loss",
}
LAYER_FORWARD = (
    "rmsnorm_attn",
    "qkv_gemm",
    "rope",
    "attention",
    "o_proj",
    "rmsnorm_ffn",
    "gate_up_gemm",
    "silu",
    "down_gemm",
)
LAYER_BACKWARD = (
    "down_bwd",
    "swiglu_bwd",
    "gate_up_bwd",
    "o_proj_bwd",
    "attn_bwd",
    "rope_bwd",
    "qkv_bwd",
    "norm_bwd",
)
OUTSIDE_LAYERS = ("embedding", "final_norm", "lm_head_loss", "optimizer", "data")
LORA_ROWS = ("lora_fwd", "lora_bwd")
# Projection group (or SwiGLU, which does the MLP's share of LoRA) -> (its forward row, its
# backward row), for LoRA's share of both.
GROUP_ROWS = {
    "qkv": ("qkv_gemm", "qkv_bwd"),
    "o": ("o_proj", "o_proj_bwd"),
    "gate_up": ("gate_up_gemm", "gate_up_bwd"),
    "down": ("down_gemm", "down_bwd"),
    "swiglu": ("silu", "swiglu_bwd"),
}
LORA_GROUP = {rows[0]: group for group, rows in GROUP_ROWS.items()}
# Regions that only bracket other regions: their own time stays unattributed.
SCOPES = ("backward",)

_active: OpProfiler | None = None
_NO_REGION = contextlib.nullcontext()


def active_profiler() -> OpProfiler | None:
    """The profiler of the step running now, or None (the default: profiling off)."""
    return _active


def timed(name: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), timed under row `name` (and its backward row) when a profiled step runs."""
    if _active is None:
        return fn(*args, **kwargs)
    return _active.time_op(name, fn, args, kwargs)


def region(name: str, tensors: Iterable[torch.Tensor] = ()):
    """A forward-only region (data, optimizer) or a scope ("backward"); `tensors` size its bytes."""
    if _active is None:
        return _NO_REGION
    return _Region(_active, name, tensors)


# ----------------------------------------------------------------------------- work per call


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes moved by one forward call and by its backward."""

    flops: float = 0.0
    bytes: float = 0.0
    bwd_flops: float = 0.0
    bwd_bytes: float = 0.0


def _gemm_work(args, out, need_output: bool = True, **_) -> Work:
    """Frozen projection [M, K] x [K, N]: 2·M·N·K forward, the same again for dX (W is frozen, no dW).

    LoRA's rank-r products are left out of the FLOPs; their time is in the row (see lora_fwd/bwd).
    A recompute that skips the GEMM (kernels.linear's need_output=False) does no forward work.
    """
    x = args[0]
    k = x.shape[-1]
    m = x.numel() // k
    n = out.shape[-1]
    size = x.element_size()
    flops = 2.0 * m * n * k
    moved = (m * k + m * n + n * k) * size
    needs_dx = x.requires_grad
    backward = (flops, moved) if needs_dx else (0.0, m * n * size)
    return Work(flops, moved, *backward) if need_output else Work(0.0, 0.0, *backward)


def _attention_work(args, out, **_) -> Work:
    """Causal: half of 4·B·H·S²·D forward, 2.5x that backward (the full triangle, even when packed)."""
    q, k, v = args[:3]
    b, s, h, d = q.shape
    flops = 2.0 * b * h * s * s * d
    qkv_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
    out_bytes = out.numel() * out.element_size()
    return Work(flops, qkv_bytes + out_bytes, 2.5 * flops, 2 * qkv_bytes + 2 * out_bytes)


def _norm_work(args, out, **_) -> Work:
    """(Residual-add +) RMSNorm: x (+ residual) in, normed (+ sum) out; backward reads dy (+ dsum) and x."""
    x, residual = args[0], args[1]
    elements = x.numel() * x.element_size()
    if residual is None:
        return Work(0.0, 2 * elements, 0.0, 3 * elements)
    return Work(0.0, 4 * elements, 0.0, 4 * elements)


def _rope_work(args, out, **_) -> Work:
    """Q and K read and written once; backward also rereads them when QK-norm is fused."""
    q, k, q_norm = args[0], args[1], args[4]
    elements = (q.numel() + k.numel()) * q.element_size()
    return Work(0.0, 2 * elements, 0.0, (3 if q_norm is not None else 2) * elements)


def _swiglu_work(args, out, need_output: bool = True, **_) -> Work:
    """gate_up [T, 2I] in, [T, I] out (not written in a recompute); backward reads dout and
    gate_up, writes dgate_up. LoRA's rank-r products are left out, as for the GEMMs."""
    elements = out.numel() * out.element_size()
    return Work(0.0, (3 if need_output else 2) * elements, 0.0, 5 * elements)


def _embedding_work(args, out, **_) -> Work:
    ids = args[0]
    return Work(0.0, ids.numel() * ids.element_size() + 2 * out.numel() * out.element_size())


def _loss_work(args, out, **_) -> Work:
    """lm_head + cross-entropy: logits 2·T·V·H, and as much again for d hidden when training.

    The fused kernel computes d hidden during forward (logits written, reread, rewritten as the
    softmax gradient and reread), so forward carries nearly all of it; backward only scales.
    """
    hidden, weight = args[0], args[1]
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    size = hidden.element_size()
    training = hidden.requires_grad
    flops = 2.0 * tokens * vocab * width * (2 if training else 1)
    moved = (
        vocab * width + tokens * width * (2 if training else 1) + tokens * vocab * (4 if training else 2)
    ) * size
    return Work(flops, moved, 0.0, 2 * tokens * width * size)


def _optimizer_work(tensors) -> Work:
    """AdamW reads param, grad, m, v and writes param, m, v; global-norm clipping reads and scales grads."""
    return Work(0.0, sum(t.numel() * t.element_size() for t in tensors) * 10)


WORK = {
    "qkv_gemm": _gemm_work,
    "o_proj": _gemm_work,
    "gate_up_gemm": _gemm_work,
    "down_gemm": _gemm_work,
    "attention": _attention_work,
    "rmsnorm_attn": _norm_work,
    "rmsnorm_ffn": _norm_work,
    "final_norm": _norm_work,
    "rope": _rope_work,
    "silu": _swiglu_work,
    "embedding": _embedding_work,
    "lm_head_loss": _loss_work,
}


# ----------------------------------------------------------------------------- recording


class _Stamp:
    """One point of the timeline: a row's region opens or closes there."""

    __slots__ = ("opens", "row", "backward", "flops", "bytes", "when")

    def __init__(self, opens: bool, row: str | None, backward: bool, when, flops=0.0, moved=0.0):
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
    __slots__ = ("profiler", "name", "tensors")

    def __init__(self, profiler: OpProfiler, name: str, tensors):
        self.profiler, self.name, self.tensors = profiler, name, tensors

    def __enter__(self):
        row = None if self.name in SCOPES else self.name
        work = _optimizer_work(self.tensors) if self.name == "optimizer" else Work()
        self.profiler.stamp(True, row, flops=work.flops, moved=work.bytes)

    def __exit__(self, *exc):
        self.profiler.stamp(False, None if self.name in SCOPES else self.name)


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
    rows: dict[str, RowStat]
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
        # How the step first called each op that can carry LoRA, for lora_share: (fn, call).
        self.groups: dict[str, tuple[Callable, dict]] = {}
        self._timeline: list[_Stamp] = []
        self._events: list[torch.cuda.Event] = []
        self._recording = False
        self._tokens = 0
        self._micro_batches = 0

    @contextlib.contextmanager
    def step(self, device: torch.device | str):
        """Profile one optimizer step: synchronize, time every op inside, synchronize, resolve."""
        global _active
        if _active is not None:
            raise RuntimeError("a profiled step is already running")
        self.device = torch.device(device)
        self._timeline, self._tokens, self._micro_batches = [], 0, 0
        _synchronize(self.device)
        start = time.perf_counter()
        self._recording = True
        _active = self
        try:
            yield self
        finally:
            _active = None
            self._recording = False
        _synchronize(self.device)
        total_ms = (time.perf_counter() - start) * 1e3
        self.steps.append(StepRecord(total_ms, self._resolve(), self._tokens, self._micro_batches))

    def stamp(
        self, opens: bool, row: str | None, *, backward: bool = False, flops=0.0, moved=0.0
    ) -> _Stamp | None:
        if not self._recording:
            return None
        if self.device.type == "cuda":
            index = len(self._timeline)
            if index == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            when = self._events[index]
            when.record()
        else:
            when = time.perf_counter()
        entry = _Stamp(opens, row, backward, when, flops, moved)
        self._timeline.append(entry)
        self.stamps_recorded += 1
        return entry

    def time_op(self, name: str, fn: Callable, args: tuple, kwargs: dict):
        backward_row = BACKWARD_ROW.get(name)
        marking = backward_row is not None and torch.is_grad_enabled()
        work_of = WORK[name]
        self._note_call(name, fn, args, kwargs)
        if marking:
            args = self._mark(args, False, backward_row, None)
        opened = self.stamp(True, name)
        try:
            if self.annotate:
                with torch.profiler.record_function(name):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
        finally:
            # Checkpointing ends a recompute by raising out of the op that saves the layer's last
            # tensor; the row closes there, or that op's backward would be counted under it.
            self.stamp(False, name)
        work = work_of(args, out[0] if isinstance(out, tuple) else out, **kwargs)
        opened.flops, opened.bytes = work.flops, work.bytes
        if marking:
            out = self._mark(out, True, backward_row, work)
        return out

    def _note_call(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> None:
        if name == "embedding":
            self._tokens += args[0].numel()
            self._micro_batches += 1
            self.dtype = args[1].dtype
        elif name in LORA_GROUP and LORA_GROUP[name] not in self.groups:
            self.groups[LORA_GROUP[name]] = (fn, _call_of(name, args, kwargs))

    def _mark(self, values, opens: bool, row: str, work: Work | None):
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
        if not self._timeline:
            return []
        if self.device.type == "cuda":
            first = self._timeline[0].when
            return [first.elapsed_time(entry.when) for entry in self._timeline]
        start = self._timeline[0].when
        return [(entry.when - start) * 1e3 for entry in self._timeline]

    def _resolve(self) -> dict[str, RowStat]:
        """Each interval to the innermost open region; a backward region whose input marker never
        fired (its inputs needed no gradient) closes when the next one opens or its scope ends."""
        rows: dict[str, RowStat] = {}
        stack: list[_Stamp] = []
        previous = None
        for entry, now in zip(self._timeline, self._times_ms(), strict=True):
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
            if not entry.backward and any(open_.backward for open_ in stack):
                stat.recomputed += 1
        return rows

    def counted_steps(self) -> list[StepRecord]:
        return self.steps[self.warmup_steps :] or self.steps

    def report(self, calibration: Calibration | None = None) -> ProfileReport:
        """The table's numbers, averaged over the counted steps; calibrates now if not given."""
        steps = self.counted_steps()
        if not steps:
            raise QLoraError("no step was profiled")
        calibration = calibration or calibrate(self.device, self.dtype)
        return build_report(self, steps, calibration, lora_share(self, steps))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """Peaks measured on the spot: the roofline the table compares against."""

    device: str
    dtype: str
    matmul_size: int
    matmul_tflops: float
    copy_mib: int
    copy_gbps: float


def _best_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _matmul_ms(size: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return _best_ms(lambda: a @ b, device, repeats)


def _copy_ms(size_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(size_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return _best_ms(lambda: dst.copy_(src), device, repeats)


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


def _call_of(name: str, args: tuple, kwargs: dict) -> dict:
    """What lora_share needs to repeat a call: its mode and LoRA tensors, never its activations
    (they would hold the step's autograd graph alive)."""
    if name != "silu":
        return {"keep_lora_t": bool(kwargs.get("keep_lora_t")), "from_t": kwargs.get("lora_t") is not None}
    gate_up, lora_t, gate_b, up_b, scaling, down_a = args[:6]
    return {
        "width": gate_up.shape[-1],
        "ranks": None if lora_t is None else lora_t.shape[-1],
        "lora": (gate_b, up_b, scaling, down_a),
    }


def _projection_calls(group: torch.nn.Module, call: dict, tokens: int, device, dtype):
    """(with LoRA, without, the leaves each differentiates, incoming gradients) for one call of a
    projection group made as the step made it: whole, stopping at t (keep_lora_t) or from t."""
    count = len(group.names)
    x = torch.randn(tokens, group.weights[0].shape[1], device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, sum(group.out_features), device=device, dtype=dtype)
    ranks = sum(a.shape[0] for a in group.lora_A.values())
    t = torch.randn(tokens, ranks, device=device, dtype=dtype, requires_grad=True)
    if call["keep_lora_t"]:
        leaves, grads = [x, *group.lora_A.values()], (dy, t.detach())

        def with_lora():
            return group(x, keep_lora_t=True)
    elif call["from_t"]:
        leaves, grads = [x, t, *group.lora_B.values()], (dy,)

        def with_lora():
            return (group(x, lora_t=t),)
    else:
        leaves, grads = [x, *group.lora_A.values(), *group.lora_B.values()], (dy,)

        def with_lora():
            return (group(x),)

    def without_lora():
        none = [None] * count
        return (lora_linear(x, group.weights, group.biases, none, none, 0.0, buffer=group.scratch),)

    return with_lora, without_lora, leaves, [x], grads


def _swiglu_calls(call: dict, tokens: int, device, dtype):
    """The same for SwiGLU with the MLP's LoRA (gate/up's B, down's A) against plain SwiGLU."""
    gate_b, up_b, scaling, down_a = call["lora"]
    g = torch.randn(tokens, call["width"], device=device, dtype=dtype, requires_grad=True)
    t = None
    if call["ranks"]:
        t = torch.randn(tokens, call["ranks"], device=device, dtype=dtype, requires_grad=True)
    dh = torch.randn(tokens, call["width"] // 2, device=device, dtype=dtype)
    loras = [m for m in (t, gate_b, up_b, down_a) if m is not None]
    grads = (
        (dh,) if down_a is None else (dh, torch.randn(tokens, down_a.shape[0], device=device, dtype=dtype))
    )

    def with_lora():
        h, down_t = lora_swiglu(g, t, gate_b, up_b, scaling, down_a)
        return (h,) if down_t is None else (h, down_t)

    return with_lora, lambda: (lora_swiglu(g)[0],), [g, *loras], [g], grads


def _carries_lora(group_name: str, fn: Callable, call: dict) -> bool:
    if group_name == "swiglu":
        return any(m is not None for m in call["lora"][:2] + call["lora"][3:])
    return len(fn.lora_A) > 0


def _lora_ms(calls, device: torch.device) -> tuple[float, float]:
    """(forward, backward) ms that LoRA adds to one call: with minus without; best of a few each."""
    with_lora, without_lora, leaves, plain_leaves, grads = calls
    repeats = 10 if device.type == "cuda" else 7
    forward = _best_ms(with_lora, device, repeats) - _best_ms(without_lora, device, repeats)
    both = _best_ms(lambda: torch.autograd.grad(with_lora(), leaves, grads), device, repeats) - _best_ms(
        lambda: torch.autograd.grad(without_lora(), plain_leaves, grads[:1]), device, repeats
    )
    return max(0.0, forward), max(0.0, both - forward)


def lora_share(profiler: OpProfiler, steps: list[StepRecord]) -> dict[str, float]:
    """ms per step that LoRA adds inside the gemm and SwiGLU rows, measured apart from the step.

    LoRA runs inside the projections' fused calls and, for the MLP, inside SwiGLU, so the step
    cannot time it alone. Each such op (the first of its kind the step timed) is timed with and
    without LoRA at the step's tokens per micro-batch; the differences times the step's calls of
    that op are the estimate.
    """
    tokens = sum(s.tokens for s in steps) // max(1, sum(s.micro_batches for s in steps))
    share = {"lora_fwd": 0.0, "lora_bwd": 0.0, "lora_fwd_calls": 0.0, "lora_bwd_calls": 0.0}
    device, dtype = profiler.device, profiler.dtype
    for group_name, (fn, call) in profiler.groups.items():
        if tokens == 0 or not _carries_lora(group_name, fn, call):
            continue
        if group_name == "swiglu":
            calls = _swiglu_calls(call, tokens, device, dtype)
        else:
            calls = _projection_calls(fn, call, tokens, device, dtype)
        forward, backward = _lora_ms(calls, device)
        for name, row, ms in zip(LORA_ROWS, GROUP_ROWS[group_name], (forward, backward), strict=True):
            calls = statistics.fmean(s.rows.get(row, RowStat()).calls for s in steps)
            share[name] += ms * calls
            share[f"{name}_calls"] += calls
    return share


# ----------------------------------------------------------------------------- report


@dataclass
class Row:
    name: str
    section: str
    ms: float
    percent: float
    calls: float
    recomputed: float = 0.0
    flops_per_call: float | None = None
    bytes_per_call: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    roofline_percent: float | None = None
    part_of: str | None = None


@dataclass
class ProfileReport:
    device: str
    steps: int
    warmup: int
    step_ms: float
    tokens_per_step: float
    calibration: Calibration
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "steps": self.steps,
            "warmup": self.warmup,
            "step_ms": self.step_ms,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step / (self.step_ms * 1e-3) if self.step_ms else None,
            "calibration": asdict(self.calibration),
            "rows": [asdict(r) for r in self.rows],
            "notes": self.notes,
        }


def _throughput(row: Row, stat: RowStat, calibration: Calibration) -> None:
    """Achieved rate and % of the roofline min(peak FLOP/s, intensity x peak bandwidth)."""
    if stat.calls:
        row.flops_per_call = stat.flops / stat.calls or None
        row.bytes_per_call = stat.bytes / stat.calls or None
    seconds = stat.ms * 1e-3
    if seconds <= 0:
        return
    if stat.flops:
        row.tflops = stat.flops / seconds / 1e12
    if stat.bytes:
        row.gbps = stat.bytes / seconds / 1e9
    peak_flops, peak_bytes = calibration.matmul_tflops * 1e12, calibration.copy_gbps * 1e9
    if stat.flops and stat.bytes:
        attainable = min(peak_flops, stat.flops / stat.bytes * peak_bytes)
        row.roofline_percent = 100.0 * stat.flops / seconds / attainable
    elif stat.bytes:
        row.roofline_percent = 100.0 * stat.bytes / seconds / peak_bytes


def _summed(steps: list[StepRecord]) -> dict[str, RowStat]:
    summed: dict[str, RowStat] = {}
    for record in steps:
        for name, stat in record.rows.items():
            total = summed.setdefault(name, RowStat())
            total.ms += stat.ms
            total.calls += stat.calls
            total.recomputed += stat.recomputed
            total.flops += stat.flops
            total.bytes += stat.bytes
    return summed


NOTES = (
    "rows are summed over layers and micro-batches and averaged over the counted steps; "
    "total is the wall clock of the whole step between two synchronizes",
    "attn_bwd is attention alone (o_proj_bwd is its own row); norm_bwd is both layer norms' "
    "backward; rope/rope_bwd hold RoPE with the fused QK-norm; final_norm and lm_head_loss "
    "hold forward and backward together",
)
LORA_SECTION = "LoRA, inside the gemm and SwiGLU rows"
GEMM_ROWS = "qkv_gemm, o_proj, gate_up_gemm, silu, down_gemm and their backward rows"


def build_report(
    profiler: OpProfiler, steps: list[StepRecord], calibration: Calibration, lora: dict[str, float]
) -> ProfileReport:
    count = len(steps)
    step_ms = statistics.fmean(s.total_ms for s in steps)
    summed = _summed(steps)
    rows: list[Row] = []
    sections = (
        ("layer forward", LAYER_FORWARD),
        ("layer backward", LAYER_BACKWARD),
        ("outside the layers", OUTSIDE_LAYERS),
    )
    for section, names in sections:
        for name in names:
            stat = summed.get(name, RowStat())
            ms = stat.ms / count
            row = Row(name, section, ms, 100.0 * ms / step_ms, stat.calls / count, stat.recomputed / count)
            _throughput(row, stat, calibration)
            rows.append(row)
    attributed = sum(r.ms for r in rows)
    notes = list(NOTES)
    recomputed = sum(r.recomputed for r in rows)
    if recomputed:
        notes.append(
            f"gradient checkpointing: {recomputed:g} forward calls per step are recomputes in backward, "
            "counted under their forward rows"
        )
    for name in LORA_ROWS:
        ms = lora[name]
        rows.append(
            Row(name, LORA_SECTION, ms, 100.0 * ms / step_ms, lora[f"{name}_calls"], part_of=GEMM_ROWS)
        )
    if lora["lora_fwd_calls"]:
        notes.append(
            "lora_fwd/lora_bwd: LoRA is fused into the projection calls and, for the MLP, into SwiGLU, "
            "so its time is inside those rows; these two rows are measured apart (each such op with "
            "and without LoRA at the step's tokens per micro-batch, times its calls) and are not "
            "added into the total"
        )
    else:
        notes.append("lora_fwd/lora_bwd: no LoRA on the timed projections")
    unattributed = step_ms - attributed
    rows.append(Row("unattributed", "step", unattributed, 100.0 * unattributed / step_ms, 0.0))
    rows.append(Row("total", "step", step_ms, 100.0, 1.0))
    warmup = len(profiler.steps) - count
    if profiler.warmup_steps and not warmup:
        notes.append("every profiled step was counted, warm-up included: the run had no step past warm-up")
    return ProfileReport(
        device=str(profiler.device),
        steps=count,
        warmup=warmup,
        step_ms=step_ms,
        tokens_per_step=statistics.fmean(s.tokens for s in steps),
        calibration=calibration,
        rows=rows,
        notes=notes,
    )


def _number(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def _calls(row: Row) -> str:
    calls = f"{row.calls:g}"
    return f"{calls} ({row.recomputed:g} re)" if row.recomputed else calls


def _achieved(row: Row) -> str:
    if row.tflops is not None:
        return f"{row.tflops:,.2f} TFLOP/s"
    if row.gbps is not None:
        return f"{row.gbps:,.1f} GB/s"
    return "—"


def render_table(report: ProfileReport) -> Table:
    cal = report.calibration
    tokens_per_s = report.tokens_per_step / (report.step_ms * 1e-3) if report.step_ms else 0.0
    table = Table(
        title=(
            f"step {report.step_ms:,.2f} ms on {cal.device} ({report.steps} steps after {report.warmup} warm-up) · "
            f"{report.tokens_per_step:,.0f} tokens/step · {tokens_per_s:,.0f} tokens/s\n"
            f"roofline measured now: {cal.matmul_tflops:,.2f} TFLOP/s ({cal.dtype} matmul {cal.matmul_size}³) · "
            f"{cal.copy_gbps:,.1f} GB/s (copy of {cal.copy_mib} MiB)"
        ),
        box=box.SIMPLE_HEAD,
        caption="\n".join(report.notes),
        caption_justify="left",
    )
    table.add_column("op", no_wrap=True)
    for header in ("ms/step", "% step", "calls", "GFLOP/call", "MB/call", "achieved", "% roof"):
        table.add_column(header, justify="right", no_wrap=True)
    section = None
    for row in report.rows:
        if row.section != section and section is not None:
            table.add_section()
        if row.section != section:
            table.add_row(f"[bold]{row.section}[/]", *[""] * 7)
            section = row.section
        style = "dim" if row.part_of else ("bold" if row.name == "total" else None)
        table.add_row(
            row.name,
            _number(row.ms, 3),
            _number(row.percent, 1),
            _calls(row),
            _number(row.flops_per_call / 1e9 if row.flops_per_call else None, 3),
            _number(row.bytes_per_call / 1e6 if row.bytes_per_call else None, 2),
            _achieved(row),
            _number(row.roofline_percent, 1),
            style=style,
        )
    return table


def print_report(report: ProfileReport, console: Console | None = None) -> None:
    """The table on stdout, wide enough for every column when stdout is not a terminal."""
    console = console or Console()
    if not console.is_terminal:
        console = Console(file=console.file, width=max(console.width, 140))
    console.print(render_table(report))


# ----------------------------------------------------------------------------- commands


def _writable(path: Path | None, option: str) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise QLoraError(f"{option} {path} is a folder; give a file name")
    return path


def _write(path: Path, text: str, option: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise QLoraError(f"cannot write {option} {path}: {err.strerror or err}") from err


def write_trace(step: Callable[[], object], path: Path, device: torch.device) -> None:
    """One step under torch.profiler (CPU, and CUDA when present), as a Chrome trace; ops are
    labelled with their row names."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    labels = OpProfiler(annotate=True)
    with torch.profiler.profile(activities=activities) as trace, labels.step(device):
        step()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        trace.export_chrome_trace(str(path))
    except OSError as err:
        raise QLoraError(f"cannot write --trace {path}: {err.strerror or err}") from err


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
    from qlora_cli.run import build_run
    from qlora_cli.step import optimizer_step, train_step

    if steps < 1:
        raise QLoraError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise QLoraError(f"--warmup must be 0 or more, got {warmup}")
    json_path = _writable(json_path, "--json")
    trace_path = _writable(trace_path, "--trace")
    console = console or Console(stderr=True)
    run = build_run(config, eager=True)
    torch.manual_seed(config.seed)
    dtype = run.model.embed_tokens.dtype
    console.print(
        f"profiling {run.model.spec.model_type} · {run.model.spec.num_layers} layers on {run.device}: "
        f"{warmup} warm-up + {steps} timed steps"
    )
    calibration = calibrate(run.device, dtype)
    profiler = OpProfiler(warmup_steps=warmup)

    def one_step(step: int) -> None:
        train_step(run, step)
        optimizer_step(run, step)

    for step in range(warmup + steps):
        with profiler.step(run.device):
            one_step(step)
    report = profiler.report(calibration)
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
    from qlora_cli.train import train

    profiler = OpProfiler(warmup_steps=1)
    result = train(config, console=console, profiler=profiler)
    return result, profiler.report()
