"""The per-op profiler: every row there, rows that add up to the measured step, nothing when off."""

import json

import pytest
import torch
from checkpoints import write_run

from qlora_cli import profiler
from qlora_cli.config import load_config
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.profiler import OpProfiler, active_profiler, region

pytestmark = pytest.mark.usefixtures("reference_ops")

ORIGINAL_ROWS = (
    "rmsnorm_attn",
    "qkv_gemm",
    "attention",
    "o_proj",
    "rmsnorm_ffn",
    "gate_up_gemm",
    "silu",
    "down_gemm",
    "lora_fwd",
    "down_bwd",
    "swiglu_bwd",
    "gate_up_bwd",
    "attn_bwd",
    "qkv_bwd",
    "norm_bwd",
    "lora_bwd",
)
REQUIRED_ROWS = (*ORIGINAL_ROWS, "embedding", "lm_head_loss", "optimizer", "data", "unattributed", "total")


def _check_adds_up(rows: dict[str, dict]) -> None:
    """Rows + unattributed make the measured step, the rows do not double count, and they cover most of it."""
    total = rows["total"]["ms"]
    attributed = sum(
        r["ms"] for name, r in rows.items() if name not in ("total", "unattributed") and not r["part_of"]
    )
    unattributed = rows["unattributed"]["ms"]
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
    report = profiler.profile(config, steps=2, warmup=1, json_path=json_path, trace_path=trace_path)

    data = json.loads(json_path.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(REQUIRED_ROWS) <= set(rows)
    assert [r["name"] for r in data["rows"]] == [r.name for r in report.rows]
    assert data["step_ms"] == pytest.approx(rows["total"]["ms"]) and data["steps"] == 2
    assert data["calibration"]["matmul_tflops"] > 0 and data["calibration"]["copy_gbps"] > 0
    _check_adds_up(rows)

    layers, micro = 2, config.gradient_accumulation_steps
    for name in ("rmsnorm_attn", "qkv_gemm", "rope", "attention", "o_proj", "rmsnorm_ffn", "gate_up_gemm"):
        assert (rows[name]["calls"], rows[name]["recomputed"]) == (2 * layers * micro, layers * micro), name
    for name in ("down_bwd", "swiglu_bwd", "gate_up_bwd", "o_proj_bwd", "attn_bwd", "rope_bwd", "qkv_bwd"):
        assert rows[name]["calls"] == layers * micro, name
    # The first layer's input norm has no backward: neither its input nor its weight needs a gradient.
    assert rows["norm_bwd"]["calls"] == (2 * layers - 1) * micro
    assert rows["embedding"]["calls"] == micro
    assert rows["lm_head_loss"]["calls"] == 2 * micro
    assert rows["optimizer"]["calls"] == 1 and rows["data"]["calls"] == 1 + micro
    for name in (*ORIGINAL_ROWS, "embedding", "lm_head_loss", "optimizer"):
        assert rows[name]["ms"] > 0, name
    # LoRA runs in the four projection groups and, for the MLP, in SwiGLU: five ops a layer.
    assert rows["lora_fwd"]["part_of"] and rows["lora_fwd"]["calls"] == 5 * 2 * layers * micro
    assert rows["qkv_gemm"]["tflops"] > 0 and rows["silu"]["gbps"] > 0
    assert rows["rmsnorm_ffn"]["roofline_percent"] > 0

    trace = json.loads(trace_path.read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"qkv_gemm", "attention", "down_gemm"} <= names
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
    assert region("data") is region("optimizer")
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


def test_timeline_attribution():
    """Each interval goes to the innermost open region once: recomputes nest inside a backward row,
    a backward row whose inputs need no gradient closes at the next one or at its scope's end."""
    timeline = OpProfiler()
    timeline._recording = True
    stamps = [
        (True, "qkv_gemm", False, 0.0),
        (False, "qkv_gemm", False, 1.0),
        (True, None, False, 1.5),  # backward scope
        (True, "down_bwd", True, 2.0),
        (True, "down_gemm", False, 3.0),  # recompute inside down_bwd
        (False, "down_gemm", False, 4.0),
        (False, "down_bwd", True, 6.0),
        (True, "qkv_bwd", True, 7.0),  # never closed: its input needs no gradient
        (True, "attn_bwd", True, 9.0),
        (False, None, False, 12.0),  # scope ends
    ]
    for opens, row, backward, seconds in stamps:
        entry = timeline.stamp(opens, row, backward=backward)
        entry.when = seconds / 1e3
    rows = timeline._resolve()
    assert {name: stat.ms for name, stat in rows.items()} == pytest.approx(
        {"qkv_gemm": 1.0, "down_bwd": 3.0, "down_gemm": 1.0, "qkv_bwd": 2.0, "attn_bwd": 3.0}
    )
    assert rows["down_gemm"].recomputed == 1 and rows["qkv_gemm"].recomputed == 0


def test_cli_profile_and_train_profile(tmp_path, run_cli):
    config = write_run(tmp_path / "run", max_steps=2)
    code, out, err = run_cli("profile", config, "--steps", 1, "--warmup", 0, "--json", tmp_path / "p.json")
    assert code == 0, err
    assert "qkv_gemm" in out and "unattributed" in out and "TFLOP/s" in out
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
    for stamp in watcher._timeline:
        if not stamp.backward and stamp.row is not None:
            open_forward[stamp.row] = open_forward.get(stamp.row, 0) + (1 if stamp.opens else -1)
    assert open_forward and set(open_forward.values()) == {0}
    rows = watcher._resolve()
    assert rows["down_gemm"].recomputed == 2 and rows["down_bwd"].calls == 2
    # The recompute skips down_proj's GEMM: its forward FLOPs are counted once, like its backward's.
    assert rows["down_gemm"].flops == rows["down_bwd"].flops > 0
