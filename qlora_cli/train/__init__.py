"""The training loop and its parts: the run built from a config, its objective, the step API, CUDA graphs,
DDP, signals, progress and trackers. Imports everything below it (core, config, sources, data, model, rundir)."""

from qlora_cli.train.loop import TrainResult, resume, train
from qlora_cli.train.objectives import Objective, causal_lm
from qlora_cli.train.run import Run, build_run
from qlora_cli.train.schedule import learning_rate
from qlora_cli.train.step import evaluate, optimizer_step, train_step

__all__ = [
    "Objective",
    "Run",
    "TrainResult",
    "build_run",
    "causal_lm",
    "evaluate",
    "learning_rate",
    "optimizer_step",
    "resume",
    "train",
    "train_step",
]
