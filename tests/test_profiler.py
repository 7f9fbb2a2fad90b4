"""The per-op profiler: every row there, rows that add up to the measured step, nothing when off."""

import json

import pytest
import torch
from checkpoints import write_run
from rich.console import Console

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import WriteFailed
from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import active_profiler, region, timed
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.profiler.calibration import Calibration
from qlora_cli.profiler.command import profile, write_trace
from qlora_cli.profiler.recorder import OpProfiler, RowStat, StepRecord
from qlora_cli.profiler.report import TOTAL, UNATTRIBUTED, build_report, render_table
from qlora_kernels.rope import apply_rope

pytestmark = pytest.mark.usefixtures("reference_ops")

ORIGINAL_ROWS = (
    Op.RMSNORM_ATTN,
    Op.QKV_GEMM,
    Op.ATTENTION,
    Op.O_PROJ,
    Op.RMSNORM_FFN,
    Op.GATE_UP_GEMM,
    Op.SILU,
    Op.DOWN_GEMM,
    Op.LORA_FWD,
    Op.DOWN_BWD,
    Op.SWIGLU_BWD,
    Op.GATE_UP_BWD,
    Op.ATTN_BWD,
    Op.QKV_BWD,
    Op.NORM_BWD,
    Op.LORA_BWD,
)
REQUIRED_ROWS = (*ORIGINAL_ROWS, Op.EMBEDDING, Op.LM_HEAD_LOSS, Op.OPTIMIZER, Op.DATA, UNATTRIBUTED, TOTAL)


def _check_adds_up(rows: dict[str, dict]) -> None:
    """Rows + unattributed make the measured step, the rows do not double count, and they cover most of it."""
    total = rows[TOTAL]["ms"]
    attributed = sum(
        r["ms"] for name, r in rows.items() if name not in (TOTAL, UNATTRIBUTED) and not r["part_of"]
    )
    unattributed = rows[UNATTRIBUTED]["ms"]
    assert total > 0
    assert abs(attributed + unattributed - total) <= 0.1 * total
    assert attributed <= 1.05 * total
    assert -0.05 * total <= unattributed < 0.5 * total


def test_profile_table_json_and_trace(tmp_path):
    """Checkpointed layers and two micro-batches: calls per row follow from the run's shape exactly."""
    config = load_config(
        write_run(tmp_path / "run", gradient_checkpointing=True, gradient_accumulation_steps=2, max_steps=3)
    )
    json_path, trace_path = tmp_path / "report" / "profile.json", tmp_path / "trace.json"
    report = profile(config, steps=2, warmup=1, json_path=json_path, trace_path=trace_path)

    data = json.loads(json_path.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(REQUIRED_ROWS) <= set(rows)
    assert [r["name"] for r in data["rows"]] == [r.name for r in report.rows]
    assert data["step_ms"] == pytest.approx(rows[TOTAL]["ms"]) and data["steps"] == 2
    assert data["calibration"]["matmul_tflops"] > 0 and data["calibration"]["copy_gbps"] > 0
    _check_adds_up(rows)

    layers, micro = 2, config.gradient_accumulation_steps
    for name in (
        Op.RMSNORM_ATTN,
        Op.QKV_GEMM,
        Op.ROPE,
        Op.ATTENTION,
        Op.O_PROJ,
        Op.RMSNORM_FFN,
        Op.GATE_UP_GEMM,
    ):
        assert (rows[name]["calls"], rows[name]["recomputed"]) == (2 * layers * micro, layers * micro), name
    for name in (
        Op.DOWN_BWD,
        Op.SWIGLU_BWD,
        Op.GATE_UP_BWD,
        Op.O_PROJ_BWD,
        Op.ATTN_BWD,
        Op.ROPE_BWD,
        Op.QKV_BWD,
    ):
        assert rows[name]["calls"] == layers * micro, name
    # The first layer's input norm has no backward: neither its input nor its weight needs a gradient.
    assert rows[Op.NORM_BWD]["calls"] == (2 * layers - 1) * micro
    assert rows[Op.EMBEDDING]["calls"] == micro
    assert rows[Op.LM_HEAD_LOSS]["calls"] == 2 * micro
    assert rows[Op.OPTIMIZER]["calls"] == 1 and rows[Op.DATA]["calls"] == 1 + micro
    for name in (*ORIGINAL_ROWS, Op.EMBEDDING, Op.LM_HEAD_LOSS, Op.OPTIMIZER):
        assert rows[name]["ms"] > 0, name
    # LoRA runs in the four projection groups and, for the MLP, in SwiGLU: five ops a layer.
    assert rows[Op.LORA_FWD]["part_of"] and rows[Op.LORA_FWD]["calls"] == 5 * 2 * layers * micro
    assert rows[Op.QKV_GEMM]["tflops"] > 0 and rows[Op.SILU]["gbps"] > 0
    assert rows[Op.RMSNORM_FFN]["roofline_percent"] > 0

    trace = json.loads(trace_path.read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {Op.QKV_GEMM, Op.ATTENTION, Op.DOWN_GEMM} <= names
    assert not (tmp_path / "run" / "out").exists()


def test_profiling_off_records_nothing(tmp_path):
    """Off, ops run straight through: no stamps, no marker nodes in the graph, one shared region."""
    config = load_config(write_run(tmp_path / "run"))
    model = QLoRAModel.from_pretrained(config.base_model, lora=LoRAConfig(r=4)).train()
    ids = torch.randint(0, model.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    watcher = OpProfiler()

    def graph_names(loss) -> set[str]:
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is not None and node not in seen:
                seen.add(node)
                todo.extend(next_node for next_node, _ in node.next_functions)
        return {type(node).__name__ for node in seen}

    loss, _ = model.loss(ids, ids)
    loss.backward()
    assert active_profiler() is None and watcher.stamps_recorded == 0
    assert not any("Marker" in name for name in graph_names(loss))
    assert region(Op.DATA) is region(Op.OPTIMIZER)
    unprofiled = [p.grad.clone() for p in model.trainable_parameters()]

    model.zero_grad()
    with watcher.step("cpu"):
        loss, _ = model.loss(ids, ids)
        with region("backward"):
            loss.backward()
    assert watcher.stamps_recorded > 0 and any("Marker" in name for name in graph_names(loss))
    assert active_profiler() is None
    profiled = [p.grad for p in model.trainable_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(unprofiled, profiled, strict=True))


def test_lora_share_repeats_the_steps_calls_with_lora_dropout(tmp_path):
    """With LoRA dropout the projections draw their masks from the model's seed; the LoRA share's
    repeats of those calls take it too (without it they stopped with a traceback)."""
    config = load_config(write_run(tmp_path / "run", lora_dropout=0.1, max_steps=2))
    report = profile(config, steps=1, warmup=1)
    rows = {row.name: row for row in report.rows}
    assert rows[Op.LORA_FWD].calls > 0 and rows[Op.LORA_BWD].calls > 0


def test_timeline_attribution():
    """Each interval goes to the innermost open region once: recomputes nest inside a backward row,
    a backward row whose inputs need no gradient closes at the next one or at its scope's end."""
    timeline = OpProfiler()
    timeline._recording = True
    stamps = [
        (True, Op.QKV_GEMM, False, 0.0),
        (False, Op.QKV_GEMM, False, 1.0),
        (True, None, False, 1.5),  # backward scope
        (True, Op.DOWN_BWD, True, 2.0),
        (True, Op.DOWN_GEMM, False, 3.0),  # recompute inside down_bwd
        (False, Op.DOWN_GEMM, False, 4.0),
        (False, Op.DOWN_BWD, True, 6.0),
        (True, Op.QKV_BWD, True, 7.0),  # never closed: its input needs no gradient
        (True, Op.ATTN_BWD, True, 9.0),
        (False, None, False, 12.0),  # scope ends
    ]
    for opens, row, backward, seconds in stamps:
        entry = timeline.stamp(opens, row, backward=backward)
        entry.when = seconds / 1e3
    rows = timeline.resolve()
    assert {name: stat.ms for name, stat in rows.items()} == pytest.approx(
        {Op.QKV_GEMM: 1.0, Op.DOWN_BWD: 3.0, Op.DOWN_GEMM: 1.0, Op.QKV_BWD: 2.0, Op.ATTN_BWD: 3.0}
    )
    assert rows[Op.DOWN_GEMM].recomputed == 1 and rows[Op.QKV_GEMM].recomputed == 0


def test_cli_profile_and_train_profile(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    code, out, err = run_cli("profile", config, "--steps", 1, "--warmup", 0, "--json", tmp_path / "p.json")
    assert code == 0, err
    assert Op.QKV_GEMM in out and UNATTRIBUTED in out and "TFLOP/s" in out
    assert "(1 step after 0 warm-up)" in out and ": 0 warm-up steps + 1 timed step" in err
    _check_adds_up({r["name"]: r for r in json.loads((tmp_path / "p.json").read_text())["rows"]})
    assert not (tmp_path / "run" / "out").exists()

    code, out, err = run_cli("train", config, "--profile")
    assert code == 0, err
    assert all(name in out for name in REQUIRED_ROWS)
    assert (tmp_path / "run" / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
        (["--json", "."], "--json"),
    ],
)
def test_cli_profile_bad_options(tmp_path, run_cli, args, message):
    config = write_run(tmp_path / "run")
    code, _, err = run_cli("profile", config, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.parametrize("option", ["--json", "--trace"])
def test_cli_profile_checks_its_files_before_the_run(tmp_path, run_cli, option):
    """A path under a file cannot be written: one line before anything is built (no "profiling" line)."""
    config = write_run(tmp_path / "run")
    (tmp_path / "file").write_text("keep")
    target = tmp_path / "file" / "out.json"
    code, _, err = run_cli("profile", config, "--steps", 1, "--warmup", 0, option, target)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines == [
        f"error: cannot write {option} {target}: {tmp_path / 'file'}: is a file, not a folder"
    ]
    assert (tmp_path / "file").read_text() == "keep"


def test_a_trace_the_profiler_did_not_write_is_an_error(tmp_path, monkeypatch):
    """torch logs a failed export and returns; the trace's file is looked for, not taken on trust."""
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", lambda self, path: None)
    with pytest.raises(
        WriteFailed, match=r"could not write --trace .*trace\.json: the profiler wrote no trace"
    ):
        write_trace(lambda: torch.ones(2) + 1, tmp_path / "trace.json", torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []


def test_forward_rows_close_when_a_recompute_stops_early(tmp_path):
    """Every forward row that opens closes, also the one a checkpoint recompute stops in."""
    config = load_config(write_run(tmp_path / "run"))
    model = QLoRAModel.from_pretrained(config.base_model, lora=LoRAConfig(r=4), checkpoint_layers=2).train()
    ids = torch.randint(0, model.spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    watcher = OpProfiler()
    with watcher.step("cpu"):
        loss, _ = model.loss(ids, ids)
        loss.backward()
    open_forward: dict[str, int] = {}
    for stamp in watcher.timeline:
        if not stamp.backward and stamp.row is not None:
            open_forward[stamp.row] = open_forward.get(stamp.row, 0) + (1 if stamp.opens else -1)
    assert open_forward and set(open_forward.values()) == {0}
    rows = watcher.resolve()
    assert rows[Op.DOWN_GEMM].recomputed == 2 and rows[Op.DOWN_BWD].calls == 2
    # The recompute skips down_proj's GEMM: its forward FLOPs are counted once, like its backward's.
    assert rows[Op.DOWN_GEMM].flops == rows[Op.DOWN_BWD].flops > 0


def test_a_call_the_work_model_cannot_read_fails_loudly():
    """Work models read an op's arguments by name: a kernel whose parameters were renamed makes the
    profiled call fail, naming the op and the missing value, instead of counting the wrong tensor."""
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    positions, inv_freq = torch.arange(4)[None], torch.ones(4)

    def renamed_rope(q, k, positions, inv_freq, q_weight=None, k_weight=None, eps=1e-6):
        return apply_rope(q, k, positions, inv_freq, q_weight, k_weight, eps)

    profiler = OpProfiler()
    with profiler.step("cpu"):
        timed(Op.ROPE, apply_rope, q, k, positions, inv_freq)
    assert profiler.steps[0].rows[Op.ROPE].bytes == 2 * (q.numel() + k.numel()) * 4
    with pytest.raises(TypeError, match="work model of rope .*'q_norm_weight'"), OpProfiler().step("cpu"):
        timed(Op.ROPE, renamed_rope, q, k, positions, inv_freq)


def test_fp8_runs_compare_the_frozen_gemm_rows_with_the_fp8_roofline():
    """Under fp8 the projection rows (forward and backward) are marked and measured against the
    e4m3 matmul's peak; every other row keeps the bf16 matmul's."""
    rows = {
        Op.QKV_GEMM: RowStat(ms=1.0, calls=1, flops=1e12, bytes=1e6),
        Op.DOWN_BWD: RowStat(ms=1.0, calls=1, flops=1e12, bytes=1e6),
        Op.ATTENTION: RowStat(ms=1.0, calls=1, flops=1e12, bytes=1e6),
    }
    profiler = OpProfiler()
    profiler.steps = [StepRecord(total_ms=10.0, rows=rows, tokens=100, micro_batches=1)]
    calibration = Calibration("H200", "bfloat16", 8192, 500.0, 1024, 4000.0, fp8_matmul_tflops=1000.0)
    lora = {Op.LORA_FWD: (0.0, 0), Op.LORA_BWD: (0.0, 0)}
    report = build_report(profiler, profiler.steps, calibration, lora)
    # 1e12 FLOP in 1 ms is 1,000 TFLOP/s: all of the e4m3 peak, twice the bf16 one.
    assert report.row("qkv_gemm").fp8 and report.row("qkv_gemm").roofline_percent == pytest.approx(100.0)
    assert report.row("down_bwd").fp8 and report.row("down_bwd").roofline_percent == pytest.approx(100.0)
    assert not report.row("attention").fp8 and report.row("attention").roofline_percent == pytest.approx(
        200.0
    )
    console = Console(width=200, record=True)
    console.print(render_table(report))
    text = console.export_text()
    assert "qkv_gemm (fp8)" in text and "attention (fp8)" not in text and "e4m3 matmul" in text


def test_lora_share_repeats_swiglu_with_down_a_made_in_a_rerun_without_grad():
    """Down's A reaches SwiGLU as A times the adapter switch; in a rerun without grad that product
    needs no gradient, and the profiler's repeat must still differentiate it (it failed on the H200)."""
    from qlora_cli.profiler.lora import _lora_ms, _swiglu_calls, lora_call

    tokens, width, rank = 8, 12, 2
    gate_b, up_b = (torch.randn(width // 2, rank, requires_grad=True) for _ in range(2))
    down_a = torch.randn(rank, width // 2, requires_grad=True)
    with torch.no_grad():
        down_a_rerun = down_a * torch.ones(())
    values = {
        "gate_up": torch.randn(tokens, width),
        "lora_t": torch.randn(tokens, 2 * rank),
        "gate_b": gate_b,
        "up_b": up_b,
        "scaling": 2.0,
        "down_a": down_a_rerun,
    }
    forward, backward = _lora_ms(
        _swiglu_calls(lora_call(Op.SILU, values), tokens, "cpu", torch.float32), torch.device("cpu")
    )
    assert forward >= 0 and backward >= 0
