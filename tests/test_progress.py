"""What a person watching sees: plain step lines where there is no terminal, and train.log."""

import io
import json
import re

import pytest
from rich.console import Console

from qlora_cli.core.errors import QLoraError
from qlora_cli.train.progress import RunOutput, step_line

RECORD = {"step": 10, "loss": 1.23456, "lr": 2e-4, "tokens_per_s": 12345.6, "memory_gib": 3.25}
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  "


def test_step_line_has_step_loss_lr_throughput_memory_and_eta():
    line = step_line(RECORD, 100, 83.4)
    assert line == "step 10/100  loss 1.2346  lr 2.00e-04  12,346 tok/s  3.2 GiB  ETA 0:01:23"
    cpu = {**RECORD, "memory_gib": None, "eval_loss": 1.5, "eval_ppl": 4.4817}
    assert step_line(cpu, 100, None) == (
        "step 10/100  loss 1.2346  lr 2.00e-04  12,346 tok/s  eval_loss 1.5000  eval_ppl 4.48"
    )
    assert step_line({"step": 20, "eval_loss": 1.0, "eval_ppl": 2.718}, 100, 0) == (
        "step 20/100  eval_loss 1.0000  eval_ppl 2.72  ETA 0:00:00"
    )


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    stream = io.StringIO()
    return Console(file=stream, force_terminal=terminal, force_jupyter=False, width=40), stream


def test_without_a_terminal_each_logged_step_is_a_plain_line_on_the_console_and_in_train_log(tmp_path):
    console, stream = _console(terminal=False)
    log = tmp_path / "train.log"
    with RunOutput(console, log) as out:
        out.print("[yellow]note:[/] something")
        with out.progress(total_steps=4, start_step=0) as progress:
            for step in (2, 4):
                progress.update({**RECORD, "step": step})
                progress.advance_to(step)
    shown = stream.getvalue().splitlines()
    assert shown[0] == "note: something"
    assert [re.sub(r"  ETA .*", "", line) for line in shown[1:]] == [
        "step 2/4  loss 1.2346  lr 2.00e-04  12,346 tok/s  3.2 GiB",
        "step 4/4  loss 1.2346  lr 2.00e-04  12,346 tok/s  3.2 GiB",
    ]
    assert shown[1].endswith(tuple(f"ETA 0:00:0{s}" for s in range(10)))
    assert "\x1b" not in stream.getvalue()
    kept = log.read_text().splitlines()
    assert [re.sub(STAMP, "", line) for line in kept] == shown


def test_on_a_terminal_the_bar_shows_and_train_log_still_gets_the_lines(tmp_path):
    console, stream = _console(terminal=True)
    log = tmp_path / "train.log"
    with RunOutput(console, log) as out, out.progress(total_steps=4, start_step=2) as progress:
        progress.update({**RECORD, "step": 4})
    assert "loss 1.2346" in stream.getvalue() and "step 4/4" not in stream.getvalue()
    (line,) = log.read_text().splitlines()
    assert re.fullmatch(STAMP + r"step 4/4  loss 1\.2346  .*  ETA 0:00:00", line)
    assert "\x1b" not in log.read_text()


def test_train_log_is_appended_and_ends_with_the_error_that_stopped_the_run(tmp_path):
    log = tmp_path / "train.log"
    with RunOutput(_console(False)[0], log) as out:
        out.print("first run")
    with pytest.raises(QLoraError), RunOutput(_console(False)[0], log) as out:
        out.print("resumed run")
        raise QLoraError("loss is nan at step 3; the run stopped")
    with pytest.raises(KeyboardInterrupt), RunOutput(_console(False)[0], log):
        raise KeyboardInterrupt
    with pytest.raises(ValueError), RunOutput(_console(False)[0], log):
        raise ValueError("bad value")
    assert [re.sub(STAMP, "", line) for line in log.read_text().splitlines()] == [
        "first run",
        "resumed run",
        "error: loss is nan at step 3; the run stopped",
        "interrupted",
        "error: ValueError: bad value",
    ]


def test_without_a_log_path_nothing_is_written(tmp_path):
    console, stream = _console(terminal=False)
    with RunOutput(console, None) as out, out.progress(2, 0) as progress:
        progress.update({**RECORD, "step": 2})
    assert stream.getvalue().startswith("step 2/2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("reference_ops")
def test_qlora_train_without_a_terminal_prints_step_lines_and_keeps_them_in_train_log(tmp_path, run_cli):
    """Four steps logged every two, then a resume to six: the console shows a line per logged step,
    and train.log keeps both runs, the resume appended."""
    from checkpoints import write_run

    config = write_run(tmp_path / "run", max_steps=4, logging_steps=2)
    code, _, err = run_cli("train", config)
    assert code is None or code == 0, err
    out = tmp_path / "run" / "out"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split("  ETA")[0] for line in lines] == [
        f"step {r['step']}/4  loss {r['loss']:.4f}  lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s"
        for r in records
    ]
    assert all(re.search(r"  ETA \d+:\d\d:\d\d$", line) for line in lines)

    code, _, err = run_cli("resume", out, "--set", "max_steps=6")
    assert code is None or code == 0, err
    kept = [re.sub(STAMP, "", line) for line in (out / "train.log").read_text().splitlines()]
    assert kept[0].startswith("qwen3 · 2 layers")
    steps = [line.split("  loss")[0] for line in kept if line.startswith("step ")]
    assert steps == ["step 2/4", "step 4/4", "step 6/6"]
    # The finished lines say how long each run took and how much of it was start-up.
    timing = r" in \d+\.\d s \(start-up \d+\.\d s\), adapter in "
    finished = [
        i
        for i, line in enumerate(kept)
        if re.fullmatch(f"finished: 4 steps{timing}{re.escape(str(out))}", line)
    ]
    assert len(finished) == 1 and finished[0] < kept.index(f"resuming from {out / 'checkpoint-4'} at step 4")
    assert re.fullmatch(f"finished: 6 steps{timing}{re.escape(str(out))}", kept[-1])
