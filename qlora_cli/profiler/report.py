"""The profile's numbers and its table: rows per op, rates, and % of the measured roofline."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table

from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.ops import (
    FROZEN_GEMM_ROWS,
    HYBRID_ROWS,
    LAYER_BACKWARD,
    LAYER_FORWARD,
    LORA_ROWS,
    MOE_ROWS,
    OUTSIDE_LAYERS,
    Op,
)
from qlora_cli.core.wording import count, number
from qlora_cli.profiler.calibration import Calibration, calibrate
from qlora_cli.profiler.lora import lora_share
from qlora_cli.profiler.recorder import OpProfiler, RowStat, StepRecord

UNATTRIBUTED = "unattributed"
TOTAL = "total"


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
    # Its GEMMs ran in FP8, and its roofline is the FP8 matmul's.
    fp8: bool = False


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
    """Achieved rate and % of the roofline min(peak FLOP/s, intensity x peak bandwidth); an FP8
    row's peak FLOP/s is the e4m3 matmul's."""
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
    matmul_tflops = calibration.fp8_matmul_tflops if row.fp8 else calibration.matmul_tflops
    peak_flops, peak_bytes = matmul_tflops * 1e12, calibration.copy_gbps * 1e9
    if stat.flops and stat.bytes:
        attainable = min(peak_flops, stat.flops / stat.bytes * peak_bytes)
        row.roofline_percent = 100.0 * stat.flops / seconds / attainable
    elif stat.bytes:
        row.roofline_percent = 100.0 * stat.bytes / seconds / peak_bytes


def _summed(steps: list[StepRecord]) -> dict[Op, RowStat]:
    summed: dict[Op, RowStat] = {}
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
GEMM_ROWS = "qkv_gemm, in_proj, o_proj, out_proj, gate_up_gemm, silu, down_gemm and their backward rows"


def build_report(
    profiler: OpProfiler,
    steps: list[StepRecord],
    calibration: Calibration,
    lora: dict[Op, tuple[float, float]],
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
    for section, ops in sections:
        for op in ops:
            stat = summed.get(op, RowStat())
            if (op in HYBRID_ROWS or op in MOE_ROWS) and not stat.calls:
                continue
            ms = stat.ms / count
            row = Row(
                op.value, section, ms, 100.0 * ms / step_ms, stat.calls / count, stat.recomputed / count
            )
            row.fp8 = calibration.fp8_matmul_tflops is not None and op in FROZEN_GEMM_ROWS
            _throughput(row, stat, calibration)
            rows.append(row)
    attributed = sum(r.ms for r in rows)
    notes = list(NOTES)
    if calibration.fp8_matmul_tflops is not None:
        notes.append(
            "fp8: the frozen projections multiply in e4m3 (rows marked fp8, against the e4m3 matmul's "
            "roofline); LoRA's products in them stay in bf16"
        )
    recomputed = sum(r.recomputed for r in rows)
    if recomputed:
        notes.append(
            f"gradient checkpointing: {recomputed:g} forward calls per step are recomputes in backward, "
            "counted under their forward rows"
        )
    for op in LORA_ROWS:
        ms, calls = lora[op]
        rows.append(Row(op.value, LORA_SECTION, ms, 100.0 * ms / step_ms, calls, part_of=GEMM_ROWS))
    if lora[Op.LORA_FWD][1]:
        notes.append(
            "lora_fwd/lora_bwd: LoRA is fused into the projection calls and, for the MLP, into SwiGLU, "
            "so its time is inside those rows; these two rows are measured apart (each such op with "
            "and without LoRA at the step's tokens per micro-batch, times its calls) and are not "
            "added into the total"
        )
    else:
        notes.append("lora_fwd/lora_bwd: no LoRA on the timed projections")
    unattributed = step_ms - attributed
    rows.append(Row(UNATTRIBUTED, "step", unattributed, 100.0 * unattributed / step_ms, 0.0))
    rows.append(Row(TOTAL, "step", step_ms, 100.0, 1.0))
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


def profile_report(
    profiler: OpProfiler, calibration: Calibration | None = None, *, fp8: bool = False
) -> ProfileReport:
    """The table's numbers, averaged over the recorder's counted steps; calibrates now if not given
    (the e4m3 matmul too, for a run with fp8)."""
    steps = profiler.counted_steps()
    if not steps:
        raise QLoraError("no step was profiled")
    calibration = calibration or calibrate(profiler.device, profiler.dtype, fp8=fp8)
    return build_report(profiler, steps, calibration, lora_share(profiler, steps))


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
            f"step {report.step_ms:,.2f} ms on {cal.device} ({count(report.steps, 'step')} after {number(report.warmup)} warm-up) · "
            f"{report.tokens_per_step:,.0f} tokens/step · {tokens_per_s:,.0f} tokens/s\n"
            f"roofline measured now: {cal.matmul_tflops:,.2f} TFLOP/s ({cal.dtype} matmul {cal.matmul_size}³) · "
            f"{cal.copy_gbps:,.1f} GB/s (copy of {cal.copy_mib} MiB)"
            + (f" · {cal.fp8_matmul_tflops:,.2f} TFLOP/s (e4m3 matmul)" if cal.fp8_matmul_tflops else "")
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
        style = "dim" if row.part_of else ("bold" if row.name == TOTAL else None)
        table.add_row(
            f"{row.name} (fp8)" if row.fp8 else row.name,
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
    """The table on stdout, at its natural width when stdout is not a terminal."""
    console = console or OutputConsole()
    console.print(render_table(report))
