"""The training loop: step, log, evaluate, checkpoint, and stop cleanly.

`_train` reads as the run's sequence: build it, restore it when resuming, then for each optimizer step
run it (qlora_cli/train/step.py), fold it into the metrics window, evaluate when due, log, checkpoint when
due, and stop on a signal. Each of those is a named piece below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from qlora_cli.config.loading import apply_override, config_from_dict, config_to_dict, parse_override
from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.console import OutputConsole
from qlora_cli.core.errors import OutOfMemory, QLoraError, RunInterrupted, TrainingStopped, WriteFailed
from qlora_cli.core.files import describe, replace_file
from qlora_cli.core.wording import count
from qlora_cli.data.examples import reads_local_files
from qlora_cli.data.files import changed_files, moved_files
from qlora_cli.model.from_config import compute_dtype, select_device
from qlora_cli.rundir.base_model import check_base, is_local_base
from qlora_cli.rundir.checkpoint import load_checkpoint, read_checkpoint_config, save_checkpoint
from qlora_cli.rundir.folder import latest_checkpoint, owned_output_dir, usable_checkpoint
from qlora_cli.rundir.names import ADAPTER_FILES, LOG_FILE, METRICS_FILE, checkpoint_name
from qlora_cli.rundir.trainer_state import TrainerState, read_trainer_state
from qlora_cli.sources.spec import MOE_MLP
from qlora_cli.train.distributed import Distributed, check_world_size, distributed
from qlora_cli.train.progress import MetricsLog, RunOutput, StepProgress, logged_records, memory_gib
from qlora_cli.train.run import Run, build_run, memory_advice
from qlora_cli.train.schedule import learning_rate, schedule_change
from qlora_cli.train.signals import StopSignals
from qlora_cli.train.step import evaluate, optimizer_step, train_step
from qlora_cli.train.trackers import Trackers

# Keys that fix the shape or meaning of the trained weights: a checkpoint cannot continue under others.
BREAKING_KEYS = (
    "base_model",
    "revision",
    "load_in_4bit",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "lora_target_linear",
    "lora_target_parameters",
    "peft_use_rslora",
    "train_norms",
)

# Keys that change how the steps left train, but not the weights' shape: a resume under other values
# says so (the learning-rate schedule's keys have a note of their own, train/schedule.py).
TRAINING_KEYS = (
    "lora_dropout",
    "optimizer",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "bf16",
    "fp8",
)

# Keys that fix the batch plan a checkpoint's data cursor points into (qlora_cli/data/examples.py): which
# examples there are, how they pack into rows and rows into micro-batches, their order, and how many
# micro-batches a step reads. Under other values the checkpoint's step places the run among other rows.
BATCH_PLAN_KEYS = (
    "seed",
    "sample_packing",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "sequence_len",
    "val_set_size",
    "dataset_exact_deduplication",
    "excess_length_strategy",
    # Rows left with no trained token are dropped, so which tokens train decides which rows there are.
    "train_on_inputs",
    "chat_template",
    "chat_template_jinja",
    "chat_template_kwargs",
)
# The keys of a datasets entry that say where its rows are rather than which: a local entry's files are
# recorded by their bytes instead (_check_data_files), so that a file that moved is no change. A hub
# entry's revision is the commit the checkpoint pinned, which a config naming a branch finds only once
# it downloads, so it is not compared either.
LOCAL_PLACE_KEYS = ("path", "data_files", "revision")
HUB_PLACE_KEYS = ("revision",)

# Wraps each optimizer step: a context manager opened with the run's device.
StepObserver = Callable[[torch.device], AbstractContextManager]


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    loss: float | None
    checkpoint: Path | None
    startup_s: float | None = None  # from `train` being called to the first step starting
    seconds: float | None = None  # from `train` being called to its end
    steps_run: int | None = None  # this call's steps: 0 when a resumed checkpoint was the run's end


@dataclass
class StepOutcome:
    """One optimizer step as every rank agrees on it."""

    loss_sum: float  # summed token loss of all ranks
    trained_tokens: int
    input_tokens: int  # of all ranks, padding included
    grad_norm: float
    aux_loss_sum: float | None  # of all ranks, as StepLoss has it

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.trained_tokens)


class LossWatchdog:
    """Stops a run whose loss stays above a threshold for `patience` steps in a row: training broke down."""

    def __init__(self, threshold: float | None, patience: int | None):
        self.threshold = threshold
        self.patience = patience or 3
        self.high: list[float] = []

    def too_high(self, loss: float) -> bool:
        if self.threshold is None:
            return False
        self.high = self.high + [loss] if loss > self.threshold else []
        return len(self.high) >= self.patience

    def describe(self) -> str:
        losses = ", ".join(f"{loss:.4g}" for loss in self.high)
        return f"loss above loss_watchdog_threshold {self.threshold:g} for {count(len(self.high), 'step')} in a row ({losses})"


class MetricWindow:
    """Loss, tokens and time since the last logged step: what one metrics.jsonl record averages."""

    def __init__(self, run: Run):
        self.run = run
        self._restart()

    def _restart(self) -> None:
        self.loss_sum, self.trained_tokens, self.input_tokens = 0.0, 0, 0
        self.aux_loss_sum: float | None = None
        self.start = time.perf_counter()
        self.extra: dict = {}

    def add(self, outcome: StepOutcome) -> None:
        self.loss_sum += outcome.loss_sum
        self.trained_tokens += outcome.trained_tokens
        self.input_tokens += outcome.input_tokens
        if outcome.aux_loss_sum is not None:
            self.aux_loss_sum = (self.aux_loss_sum or 0.0) + outcome.aux_loss_sum

    def due(self, done: int) -> bool:
        return done % self.run.config.logging_steps == 0 or done == self.run.total_steps

    def close(self, done: int, grad_norm: float) -> dict:
        """The window's record, ending at optimizer step `done` (1-based); the next window starts now."""
        run = self.run
        elapsed = max(1e-9, time.perf_counter() - self.start)
        peaks = run.dist.all_gather_json(memory_gib(run.device))
        batches_per_step = run.config.gradient_accumulation_steps * run.dist.world_size
        trained = max(1, self.trained_tokens)
        # A MoE's load-balancing loss, unscaled, averaged as the loss (which holds it scaled) is.
        aux = {} if self.aux_loss_sum is None else {"aux_loss": self.aux_loss_sum / trained}
        record = {
            "step": done,
            "loss": self.loss_sum / trained,
            **aux,
            "lr": learning_rate(run.config, done - 1, run.total_steps),
            "grad_norm": grad_norm,
            "epoch": round(run.train_plan.epochs_done(done, batches_per_step), 4),
            "trained_tokens": self.trained_tokens,
            "input_tokens": self.input_tokens,
            "seconds": elapsed,
            "tokens_per_s": self.input_tokens / elapsed,
            "memory_gib": None if peaks[0] is None else max(peaks),
        }
        if run.dist.active:
            record["memory_gib_per_rank"] = peaks
        record.update(self.extra)
        self._restart()
        return record


def _save(run: Run, step: int, metrics: list[dict], trackers: Trackers) -> Path:
    """Rank 0 writes the checkpoint, with the tracker runs' ids; the others wait until it is written.

    No RNG state: training draws nothing from torch's generators (LoRA dropout hashes a seed made from
    the run's seed and the micro-batch, qlora_cli/train/step.py), so the step alone places a resumed run."""
    plan, dist = run.train_plan, run.dist
    epoch, index = divmod(
        step, plan.steps_per_epoch(run.config.gradient_accumulation_steps * dist.world_size)
    )
    state = TrainerState(
        step=step,
        total_steps=run.total_steps,
        epoch=epoch,
        batch_index=index * run.config.gradient_accumulation_steps * dist.world_size,
        world_size=dist.world_size,
        compute_dtype=str(compute_dtype(run.config, run.device)).removeprefix("torch."),
        lr=learning_rate(run.config, max(0, step - 1), run.total_steps),
        metrics=metrics[-100:],
        trackers=trackers.state(),
        run_id=run.run_id,
        data_files=run.data_files,
        base_fingerprint=run.base_fingerprint,
    )
    folder = Path(run.config.output_dir) / checkpoint_name(step)
    if dist.is_main:
        folder = save_checkpoint(folder.parent, step, run.model, run.optimizer, state, run.config)
        trackers.saved(folder, step)
    dist.barrier()
    return folder


def train(
    config: TrainConfig,
    *,
    resume_from: Path | None = None,
    console: Console | None = None,
    observe_step: StepObserver | None = None,
    accept_changed_data: bool = False,
    command: Sequence[str] = (),
) -> TrainResult:
    """Train LoRA adapters as the config says; with resume_from, continue that checkpoint (whose local
    data files must read as they did, and whose batch plan the config must keep, unless
    accept_changed_data).

    `command`: the arguments of the `qlora` command that asked for this, which a refusal that
    --accept-changed-data lifts suggests again with it (by default `resume OUTPUT_DIR --checkpoint
    RESUME_FROM`, which continues the checkpoint's own config).

    With `observe_step`, every optimizer step runs inside `observe_step(device)`, and the steps run
    eagerly (no CUDA graphs), so that what it times is each op: `qlora profile` passes its recorder's
    `step` (qlora_cli/profiler/recorder.py).

    Under torchrun every process calls this and they share the work (distributed.py); rank 0 alone
    prints and writes files. The run owns its output_dir while it trains (qlora_cli/rundir/folder.py), and
    signals are answered from the start (qlora_cli/train/signals.py).
    """
    started = time.perf_counter()
    if resume_from is None:
        resume_from = configured_resume(config)
    console = console or OutputConsole(stderr=True)
    output_dir = Path(config.output_dir)
    if resume_from is not None and not command:
        command = ("resume", str(output_dir), "--checkpoint", str(resume_from))
    trackers = Trackers(config)  # a missing extra stops the run here, before output_dir is touched
    with StopSignals(console, output_dir) as signals, distributed(select_device(config.device)) as dist:
        if resume_from is not None:
            # Refused before output_dir is claimed and anything loads; _train notes an accepted change.
            saved = read_checkpoint_config(resume_from)
            check_batch_plan(saved, config, resume_from, accept_changed_data, command, dist)
        with owned_output_dir(
            output_dir, resume_from=resume_from, overwrite=config.overwrite_output_dir, writer=dist.is_main
        ) as ownership:
            if not dist.is_main:
                console = signals.console = OutputConsole(quiet=True)
            signals.resume_option = dist.resume_option
            for folder in ownership.set_aside:
                console.print(
                    f"[yellow]note:[/] a later continuation of this run is kept aside as {escape(str(folder))}"
                )
            result = _train(
                config, dist, resume_from, console, signals, trackers, ownership.run_id, observe_step,
                started, accept_changed_data, command,
            )  # fmt: skip
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


def configured_resume(config: TrainConfig) -> Path | None:
    """The checkpoint the config says to continue: resume_from_checkpoint, or with
    auto_resume_from_checkpoints the newest complete one in output_dir (none there: a fresh start)."""
    if config.auto_resume_from_checkpoints:
        return latest_checkpoint(Path(config.output_dir))
    if config.resume_from_checkpoint is None:
        return None
    checkpoint = Path(config.resume_from_checkpoint)
    if not checkpoint.is_dir():
        raise QLoraError(f"config key 'resume_from_checkpoint': {checkpoint} is not a checkpoint folder")
    return checkpoint


def check_continues(saved: TrainConfig, config: TrainConfig, checkpoint: Path) -> list[str]:
    """A checkpoint continues only under the keys that fixed the shape and meaning of its weights; its
    local base may be found in another folder holding the same weights (qlora_cli/rundir/base_model.py).
    Returns the notes to print."""
    keys, notes = BREAKING_KEYS, []
    if is_local_base(saved.base_model):
        notes = check_base(checkpoint, saved.base_model, config.base_model)
        keys = tuple(key for key in BREAKING_KEYS if key != "base_model")
    for key in keys:
        if getattr(config, key) != getattr(saved, key):
            raise QLoraError(
                f"cannot resume {checkpoint}: '{key}' changed from {getattr(saved, key)!r} to "
                f"{getattr(config, key)!r}, which changes the trained weights"
            )
    return notes


def training_change(saved: TrainConfig, config: TrainConfig, step: int) -> list[str]:
    """The note for TRAINING_KEYS a resume changes from the checkpoint's (config `saved`) values."""
    changes = [
        f"{key} {getattr(config, key)!r} (was {getattr(saved, key)!r})"
        for key in TRAINING_KEYS
        if getattr(config, key) != getattr(saved, key)
    ]
    return (
        [f"resumed with changed settings: {', '.join(changes)}; steps from {step + 1} train with them"]
        if changes
        else []
    )


def batch_plan_changes(saved: TrainConfig, config: TrainConfig) -> list[str]:
    """The keys whose new values change the batch plan of the checkpoint (config `saved`), each as
    "'key' changed from OLD to NEW", dotted as --set names them (datasets.0.split)."""
    changes = [
        (key, getattr(saved, key), getattr(config, key))
        for key in BATCH_PLAN_KEYS
        # val_set_size holds rows out only where there are no test_datasets
        if not (key == "val_set_size" and saved.test_datasets and config.test_datasets)
    ]
    changes.append(("number of datasets", len(saved.datasets), len(config.datasets)))
    for index, (before, now) in enumerate(zip(saved.datasets, config.datasets, strict=False)):
        place = LOCAL_PLACE_KEYS if reads_local_files(before) else HUB_PLACE_KEYS
        changes += [
            (f"datasets.{index}.{key.name}", getattr(before, key.name), getattr(now, key.name))
            for key in dataclasses.fields(before)
            if key.name not in place
        ]
    return [f"'{key}' changed from {old!r} to {new!r}" for key, old, new in changes if old != new]


def check_batch_plan(
    saved: TrainConfig,
    config: TrainConfig,
    checkpoint: Path,
    accept: bool,
    command: Sequence[str],
    dist: Distributed,
) -> None:
    """A checkpoint continues on its own batch plan, unless accept: its step places the run in the data
    by position, so another plan would skip or repeat rows of the epoch it is in."""
    changes = batch_plan_changes(saved, config)
    if not changes or accept:
        return
    state = read_trainer_state(checkpoint)
    raise QLoraError(
        f"cannot resume {checkpoint}: {', '.join(changes)}, which changes the batch plan the checkpoint's "
        f"step {state.step} places the run in (at micro-batch {state.batch_index} of epoch "
        f"{state.epoch}), so the remaining steps would skip or repeat rows of this epoch; keep the "
        f"checkpoint's {'value' if len(changes) == 1 else 'values'}, or continue on the new batch plan with "
        f"{_suggest([*command, '--accept-changed-data'], dist)}"
    )


def _batch_plan_note(run: Run, saved: TrainConfig, step: int) -> list[str]:
    """What an accepted change of the batch plan means for the steps left."""
    changes = batch_plan_changes(saved, run.config)
    if not changes:
        return []
    per_step = run.config.gradient_accumulation_steps * run.dist.world_size
    epoch, batches = run.train_plan.step_micro_batches(step, per_step)
    return [
        f"{', '.join(changes)} (--accept-changed-data): the remaining steps, from step {step + 1}, draw a "
        f"new batch plan, from its micro-batch {batches.start} of epoch {epoch}, so rows of this epoch may "
        "be skipped or seen twice"
    ]


def _train(
    config: TrainConfig,
    dist: Distributed,
    resume_from: Path | None,
    console: Console,
    signals: StopSignals,
    trackers: Trackers,
    run_id: str | None,
    observe_step: StepObserver | None = None,
    started: float | None = None,
    accept_changed_data: bool = False,
    command: Sequence[str] = (),
) -> TrainResult:
    """`started`: when the caller began, so that the start-up reported covers its part too."""
    started = time.perf_counter() if started is None else started
    if resume_from is not None:
        check_world_size(resume_from, dist.world_size)
    run = build_run(config, dist, eager=observe_step is not None, check_space=dist.is_main)
    run.run_id = run_id
    config = run.config
    if resume_from is not None:
        saved, state = read_checkpoint_config(resume_from), read_trainer_state(resume_from)
        run.notes += check_continues(saved, config, resume_from)
        run.notes += _steps_left_note(run, state.step, resume_from)
        run.notes += _batch_plan_note(run, saved, state.step)
        run.notes += training_change(saved, config, state.step)
        change = schedule_change(saved, state, config, run.total_steps)
        run.notes += [change] if change else []
    output_dir = Path(config.output_dir)
    with RunOutput(console, output_dir / LOG_FILE if dist.is_main else None) as out, trackers:
        start, metrics, tracker_state = _restore(run, resume_from, out, accept_changed_data, command)
        if dist.is_main:
            logged = [] if resume_from is None else logged_records(output_dir / METRICS_FILE)
            trackers.start(output_dir, start, tracker_state, warn=out.print, logged=logged)
        _announce(run, trackers, out)
        log = _metrics_log(run, None if resume_from is None else start)
        watchdog = LossWatchdog(config.loss_watchdog_threshold, config.loss_watchdog_patience)
        last_checkpoint, loss = resume_from, None
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        startup = time.perf_counter() - started
        out.print(_startup_line(run, startup))
        window = MetricWindow(run)
        window.extra["startup_s"] = startup
        window.extra.update({f"startup_{part}_s": seconds for part, seconds in run.startup_s.items()})
        with out.progress(run.total_steps, start) as progress:
            for step in range(start, run.total_steps):
                signals.training(step + 1)
                with observe_step(run.device) if observe_step else contextlib.nullcontext():
                    outcome = _run_step(run, step, watchdog, last_checkpoint)
                if run.graphed is not None and (note := run.graphed.fallback_note()):
                    out.print(f"[yellow]note:[/] {escape(note)}")
                done, loss = step + 1, outcome.loss
                window.add(outcome)
                record = window.close(done, outcome.grad_norm) if window.due(done) else None
                record = _with_evaluation(run, done, record, last_checkpoint)
                if record is not None:
                    _publish(record, log, metrics, progress, trackers)
                progress.advance_to(done)
                stop_signal = _agreed_signal(run, signals)
                if stop_signal or _checkpoint_due(run, done):
                    signals.saving_checkpoint()
                    last_checkpoint = _save(run, done, metrics, trackers)
                    stop_signal = stop_signal or _agreed_signal(run, signals)
                if stop_signal:
                    signals.closing()
                    raise _interrupted(run, stop_signal, done, last_checkpoint)
        signals.closing()
        if last_checkpoint is not None and dist.is_main:
            _write_final_adapter(run, last_checkpoint)
        total = time.perf_counter() - started
        out.to_file(
            f"finished: {count(run.total_steps, 'step')} in {total:.1f} s (start-up {startup:.1f} s), adapter in {output_dir}"
        )
    return TrainResult(
        output_dir, run.total_steps, loss, last_checkpoint, startup, steps_run=run.total_steps - start
    )


def _steps_left_note(run: Run, step: int, checkpoint: Path) -> list[str]:
    """A checkpoint at the run's last step leaves nothing to train, which is said; one past it would
    stand for a shorter run than it is, which is refused."""
    if step < run.total_steps:
        return []
    further = "to train further, raise num_epochs or max_steps with --set"
    if step > run.total_steps:
        raise QLoraError(
            f"{checkpoint} is at step {step}, past this run's {count(run.total_steps, 'step')}: "
            f"its adapter is that of a longer run; {further}"
        )
    return [
        f"{checkpoint} is this run's last step ({step} of {run.total_steps}): nothing left to train; {further}"
    ]


def _restore(
    run: Run, resume_from: Path | None, out: RunOutput, accept_changed_data: bool, command: Sequence[str]
) -> tuple[int, list[dict], dict]:
    """(the step to start at, the metrics so far, the tracker runs to continue): a checkpoint's, or a
    fresh start's. An "rng" entry that older checkpoints hold is not read: nothing draws from it."""
    if resume_from is None:
        return 0, [], {}
    state = load_checkpoint(resume_from, run.model, run.optimizer)
    _check_data_files(run, state, resume_from, out, accept_changed_data, command)
    out.print(escape(f"resuming from {resume_from} at step {state.step}"))
    return state.step, list(state.metrics), state.trackers


def _check_data_files(
    run: Run, state: TrainerState, checkpoint: Path, out: RunOutput, accept: bool, command: Sequence[str]
) -> None:
    """A resumed run continues at the checkpoint's step, which places it in the data by position: a local
    file that changed since (checkpoints before this check record none) moves the rows under it. Files
    that only moved, the same bytes read in the same order, are the same rows."""
    recorded = run.data_files if state.data_files is None else state.data_files
    moved = moved_files(recorded, run.data_files)
    for then, now in moved or ():
        note = f"data file {then} moved to {now} since {checkpoint}: the same bytes, so the same rows"
        out.print(f"[yellow]note:[/] {escape(note)}")
    changed = [] if moved is not None else changed_files(recorded, run.data_files)
    if not changed:
        return
    at = (
        f"step {state.step} continues at micro-batch {state.batch_index} of epoch "
        f"{state.epoch} of the changed data, so rows of this epoch may be skipped or seen twice"
    )
    if not accept:
        others = f" (and {count(len(changed) - 1, 'other file')})" if len(changed) > 1 else ""
        raise QLoraError(
            f"cannot resume {checkpoint}: {changed[0]}{others} since the checkpoint was written; "
            f"{at}; continue anyway with {_suggest([*command, '--accept-changed-data'], run.dist)}"
        )
    for change in changed:
        out.print(f"[yellow]note:[/] {escape(f'{change} since {checkpoint} (--accept-changed-data): {at}')}")


def _suggest(words: Sequence[str], dist: Distributed | None = None) -> str:
    """A `qlora` command as a message suggests it: quoted for the shell, so that it runs as written, and
    under several processes with their number."""
    return f"`qlora {shlex.join(words)}{dist.resume_option if dist else ''}`"


def _announce(run: Run, trackers: Trackers, out: RunOutput) -> None:
    for note in run.notes + trackers.notes:
        out.print(f"[yellow]note:[/] {escape(note)}")
    n_trainable = sum(p.numel() for p in run.model.trainable_parameters())
    out.print(
        f"{run.model.spec.model_type} · {count(run.model.spec.num_layers, 'layer')} · "
        f"{'NF4' if run.config.quantize else 'unquantized'} base · {count(n_trainable, 'trainable parameter')} · "
        f"{count(run.train_plan.num_batches, 'micro-batch', 'micro-batches')} per epoch · "
        f"{count(run.total_steps, 'step')} on {run.device}"
    )
    if experts := run.model.lora.expert_weights_per_layer(run.model.spec):
        weights = experts * run.model.spec.mlp_types.count(MOE_MLP)
        out.print(
            f"routed experts' LoRA ({', '.join(run.model.lora.expert_targets)}): "
            f"{count(weights, 'weight')}, {weights * 4 / 1e6:.1f} MB of the fp32 adapter"
        )
    if run.dist.active:
        out.print(
            f"data parallel over {count(run.dist.world_size, 'process', 'processes')} ({run.dist.device.type})"
        )


def _startup_line(run: Run, seconds: float) -> str:
    """How long the run took to reach its first step, and what that went to."""
    parts = run.startup_s
    return (
        f"start-up {seconds:.1f} s to the first step: data {parts.get('data', 0.0):.1f} s (read, tokenize, "
        f"pack), model {parts.get('model', 0.0):.1f} s (load, quantize)"
    )


def _metrics_log(run: Run, resumed_at: int | None) -> MetricsLog | None:
    """Rank 0 writes metrics.jsonl; a resumed run drops the lines past its checkpoint's step."""
    if not run.dist.is_main:
        return None
    return MetricsLog(Path(run.config.output_dir) / METRICS_FILE, resumed_at)


def _agreed_signal(run: Run, signals: StopSignals) -> int:
    """The signal any rank has received (0: none), asked after each step and after each save, so that
    every rank stops after the same one and a signal during a save stops the run right after it."""
    return int(run.dist.max(signals.received or 0))


def _run_step(run: Run, step: int, watchdog: LossWatchdog, last_checkpoint: Path | None) -> StepOutcome:
    """Forward, backward and update of optimizer step `step`. A non-finite loss, or one the watchdog
    finds too high for too long, stops the run before the update; so does running out of GPU memory."""
    stopped = _run_stopped(last_checkpoint)
    try:
        loss_sum, trained, inputs, aux_sum = train_step(run, step)
        loss_sum, inputs, all_aux = run.dist.sum(loss_sum, inputs, aux_sum or 0.0)
        if not math.isfinite(loss_sum):
            raise TrainingStopped(f"loss is {loss_sum} at step {step + 1}{stopped}")
        if watchdog.too_high(loss_sum / max(1, trained)):
            raise TrainingStopped(f"{watchdog.describe()} at step {step + 1}{stopped}")
        grad_norm = optimizer_step(run, step)
    except torch.OutOfMemoryError:
        raise OutOfMemory(_out_of_memory(run, f"in step {step + 1}") + stopped) from None
    return StepOutcome(loss_sum, trained, int(inputs), grad_norm, None if aux_sum is None else all_aux)


def _run_stopped(last_checkpoint: Path | None) -> str:
    """How the line of a run that stopped on its own ends: what stays of it."""
    return "; the run stopped" + (f"; last good checkpoint: {last_checkpoint}" if last_checkpoint else "")


def _out_of_memory(run: Run, doing: str) -> str:
    """What ran out (`doing`: in which step, or evaluating after it), at what shape, what to change."""
    config = run.config
    shape = f"{config.micro_batch_size} x {config.sequence_len} tokens a micro-batch"
    if (peak := memory_gib(run.device)) is not None:
        total = torch.cuda.get_device_properties(run.device).total_memory / 2**30
        shape += f", {peak:.1f} GiB in use of {total:.1f}"
    advice = memory_advice(run.model.checkpoint_layers, run.model.spec.num_layers)
    return f"out of GPU memory {doing} ({shape}): {advice}"


def _with_evaluation(run: Run, done: int, record: dict | None, last_checkpoint: Path | None) -> dict | None:
    """The step's record with the validation loss added when an evaluation is due."""
    if run.eval_plan is None or not run.eval_every or done % run.eval_every:
        return record
    try:
        eval_loss, eval_ppl = evaluate(run)
    except torch.OutOfMemoryError:
        doing = f"evaluating after step {done}"
        raise OutOfMemory(_out_of_memory(run, doing) + _run_stopped(last_checkpoint)) from None
    record = record or {"step": done}
    record.update(eval_loss=eval_loss, eval_ppl=eval_ppl)
    return record


def _publish(
    record: dict, log: MetricsLog | None, metrics: list[dict], progress: StepProgress, trackers: Trackers
) -> None:
    """One logged step, to metrics.jsonl, the checkpoint's history, the screen and the trackers."""
    if log is not None:
        log.write(record)
    metrics.append(record)
    progress.update(record)
    trackers.log(record)


def _checkpoint_due(run: Run, done: int) -> bool:
    first = run.config.save_first_step and done == 1
    return bool(run.save_every and done % run.save_every == 0) or first or done == run.total_steps


def _interrupted(run: Run, stop_signal: int, done: int, checkpoint: Path) -> RunInterrupted:
    name = signal.Signals(stop_signal).name
    return RunInterrupted(
        f"{name} received, so the run ended after step {done}; its checkpoint is {checkpoint}; "
        f"continue with `qlora resume {Path(run.config.output_dir)}{run.dist.resume_option}`",
        stop_signal,
    )


def _write_final_adapter(run: Run, checkpoint: Path) -> None:
    """The last checkpoint's adapter files, also at the top of output_dir where users look first."""
    output_dir = Path(run.config.output_dir)
    for name in ADAPTER_FILES:
        try:
            replace_file(output_dir / name, (checkpoint / name).read_bytes())
        except OSError as err:
            raise WriteFailed(
                f"could not write the final adapter: {describe(err, output_dir / name)}"
            ) from None


def _check_data_found(saved: TrainConfig, config: TrainConfig, checkpoint: Path) -> None:
    """Each local dataset the checkpoint read is still where its config names it, or is given a new place."""
    for key in ("datasets", "test_datasets"):
        for index, (before, now) in enumerate(zip(getattr(saved, key), getattr(config, key), strict=False)):
            path = Path(now.path)
            if now.path == before.path and path.is_absolute() and not path.exists():
                raise QLoraError(
                    f"cannot resume {checkpoint}: its dataset {key}.{index}, {path}, does not exist; if it "
                    f"moved, give its new place with --set {key}.{index}.path=NEW_PATH"
                )


def resume(
    output_dir: Path, *, checkpoint: Path | None = None, overrides=(), console=None, accept_changed_data=False
) -> TrainResult:
    """Continue a run from its newest complete checkpoint (or the one given); accept_changed_data: even
    when a local data file it read has changed since, or an override changes its batch plan."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise QLoraError(f"{output_dir} is not a folder with checkpoints")
    options = [option for text in overrides for option in ("--set", text)]
    given = ["--checkpoint", str(checkpoint)] if checkpoint else []
    command = ["resume", str(output_dir), *given, *options]
    accept = ["--accept-changed-data"] if accept_changed_data else []

    def use_instead(found: Path) -> str:
        again = ["resume", str(output_dir), "--checkpoint", str(found), *options, *accept]
        return f"continue from it with {_suggest(again)}"

    checkpoint = Path(checkpoint) if checkpoint else usable_checkpoint(output_dir, use_instead)
    if checkpoint is None:
        raise QLoraError(f"{output_dir} has no complete checkpoint to resume from")
    if not checkpoint.is_dir():
        raise QLoraError(f"checkpoint {checkpoint} does not exist")
    saved = read_checkpoint_config(checkpoint)
    raw = config_to_dict(saved)
    for text in overrides:
        path, value = parse_override(text)
        if path == ["output_dir"]:
            raise QLoraError(
                f"resume trains on in the folder it resumes, {output_dir}, so --set output_dir would be "
                "ignored; to go on elsewhere, copy the folder and resume the copy"
            )
        apply_override(raw, path, value)
    config = config_from_dict(raw)
    # Refused here, before output_dir is claimed; _train checks again and prints the notes.
    check_continues(saved, config, checkpoint)
    _check_data_found(saved, config, checkpoint)
    config = dataclasses.replace(config, output_dir=str(output_dir.resolve()))
    return train(
        config,
        resume_from=checkpoint,
        console=console,
        accept_changed_data=accept_changed_data,
        command=command,
    )
