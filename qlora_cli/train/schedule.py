"""The learning-rate schedule, as Hugging Face's schedulers shape it: linear warmup, then constant, linear or
cosine decay to 0 at the run's last step; and a note wherever it does what a user may not expect: a
warmup as long as the run, or a resume whose new settings bend the curve the run was on."""

from __future__ import annotations

import math

from qlora_cli.config.schema import TrainConfig
from qlora_cli.rundir.trainer_state import TrainerState


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    if config.warmup_steps is not None:
        return config.warmup_steps
    return math.ceil(config.warmup_ratio * total_steps)


def learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup, then the schedule."""
    warmup = warmup_steps(config, total_steps)
    if step < warmup:
        return config.learning_rate * (step + 1) / (warmup + 1)
    if config.lr_scheduler == "constant":
        return config.learning_rate
    progress = (step - warmup) / max(1, total_steps - warmup)
    if config.lr_scheduler == "linear":
        return config.learning_rate * max(0.0, 1.0 - progress)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_note(config: TrainConfig, total_steps: int) -> str | None:
    """A warmup at least as long as the run warms up all of it and never reaches learning_rate (Hugging
    Face's schedulers run it so too): a note saying how high it gets."""
    warmup = warmup_steps(config, total_steps)
    if warmup < total_steps:
        return None
    key = "warmup_steps" if config.warmup_steps is not None else "warmup_ratio"
    top = learning_rate(config, total_steps - 1, total_steps)
    return (
        f"{key} gives {warmup} warmup steps and the run has {total_steps}: every step warms up, and the "
        f"learning rate rises only to {top:.3g} of learning_rate {config.learning_rate:g}"
    )


def schedule_change(
    saved: TrainConfig, state: TrainerState, config: TrainConfig, total_steps: int
) -> str | None:
    """What a resumed run's settings change in the schedule its checkpoint (config `saved`, trainer `state`)
    was on, from the step it continues at; None when they change nothing."""
    step = state.step
    saved_total = total_steps if state.total_steps is None else state.total_steps
    changes = []
    if config.learning_rate != saved.learning_rate:
        changes.append(f"learning_rate {config.learning_rate:g} (was {saved.learning_rate:g})")
    if config.lr_scheduler != saved.lr_scheduler:
        changes.append(f"lr_scheduler {config.lr_scheduler} (was {saved.lr_scheduler})")
    warmup, saved_warmup = warmup_steps(config, total_steps), warmup_steps(saved, saved_total)
    if warmup != saved_warmup:
        changes.append(f"{warmup} warmup steps (was {saved_warmup})")
    if total_steps != saved_total and config.lr_scheduler != "constant":
        changes.append(f"the {config.lr_scheduler} decay now ends at step {total_steps} (was {saved_total})")
    if not changes:
        return None
    before = (
        f"{learning_rate(saved, step, saved_total):.3g}"
        if step < saved_total
        else f"none, it ended at step {saved_total}"
    )
    return (
        f"the learning-rate schedule changes: {'; '.join(changes)}; step {step + 1} trains at "
        f"{learning_rate(config, step, total_steps):.3g} (the saved schedule: {before})"
    )
