"""Data parallelism over processes that torchrun starts: who this process is, and the few exchanges a run needs.

Every rank builds the same model and batch plan. Optimizer step s reads the next A·N micro-batches of
its epoch (A = gradient_accumulation_steps, N = world size; the epoch's last step those left), and rank r
takes those whose offset in the step is r, r + N, r + 2N, …: N processes consume per step exactly what
one process would with A·N accumulation. DDP all-reduces the LoRA gradients; a few scalars per step (trained tokens, loss,
a stop request) are summed across ranks. Rank 0 alone writes files. Outside torchrun there is no process
group and every call here is a no-op, so a single process trains exactly as it always did.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError, RunInterrupted, TrainingStopped
from qlora_cli.core.wording import count
from qlora_cli.rundir.folder import check_new_run, latest_checkpoint
from qlora_cli.rundir.trainer_state import read_trainer_state
from qlora_cli.train.objectives import Objective

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
FAILURE_KEY = "qlora/first-failure"


class RankFailed(QLoraError):
    """Another rank failed first: it printed its own error, and this rank stops because of it.
    `same_error`: this rank met the same error (bad data every rank reads), so its line would repeat."""

    exit_code = 1
    same_error = False


# Outcomes every rank reaches together; rank 0 reports them for all.
SHARED_OUTCOMES = (TrainingStopped, RunInterrupted, RankFailed)


class LossModule(nn.Module):
    """The run's objective on the model as a module's forward, so DDP's hooks see every forward and backward."""

    def __init__(self, model: nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, input_ids, labels, position_ids, doc_ids, real_tokens):
        return self.objective(self.model, input_ids, labels, position_ids, doc_ids, real_tokens)


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise QLoraError(f"torchrun environment variable {name} is {value!r}, expected an integer") from None


@dataclass
class Distributed:
    """This process's place in the run: rank, world size and the device it computes and communicates on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    store: dist.Store | None = None

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def resume_option(self) -> str:
        """What `qlora resume` needs to continue this run's checkpoints."""
        return f" --nproc {self.world_size}" if self.active else ""

    @classmethod
    def from_env(cls, device: torch.device) -> Distributed:
        """Join the process group torchrun describes (NCCL on GPUs, gloo on the CPU); alone without it."""
        if os.environ.get("WORLD_SIZE", "1") == "1":
            return cls(device=device)
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise QLoraError(
                f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: start the processes with torchrun "
                "or `qlora train CONFIG --nproc N`"
            )
        rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if device.type == "cuda":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
            available = torch.cuda.device_count()
            if local_world > available:
                raise QLoraError(
                    f"{count(local_world, 'process', 'processes')} on this machine need one GPU each, "
                    f"but it has {count(available, 'GPU')}"
                )
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            device_id=device if device.type == "cuda" else None,
        )
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            _env_int("MASTER_PORT"),
            is_master=False,
            timeout=timedelta(seconds=30),
        )
        return cls(rank, world_size, local_rank, device, store)

    def close(self) -> None:
        """Release the store and collect what still holds the group's pending work while the interpreter
        is whole: left to its finalization, a gloo rank sometimes aborted after its run had finished
        ("terminate called without an active exception": 6 of 40 two-process test runs, none of 70 since)."""
        self.store = None
        if self.active and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    # ----- which data this rank reads -----

    def micro_batches(self, step_indices: range) -> range:
        """This rank's share of the micro-batches an optimizer step reads; in an epoch's last step it
        may be empty."""
        return step_indices[self.rank :: self.world_size]

    def shard(self, count: int) -> range:
        """This rank's share of `count` items (evaluation batches): r, r + N, r + 2N, …"""
        return range(self.rank, count, self.world_size)

    # ----- exchanges -----

    def sum(self, *values: float) -> list[float]:
        """Each value summed over all ranks (float64, so token counts stay exact)."""
        if not self.active:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: float | None) -> float | None:
        """The largest value any rank holds; None stays None (every rank has the same kind of device)."""
        if not self.active or value is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_gather_json(self, value) -> list:
        """Every rank's JSON-able value, in rank order; sent as UTF-8 bytes, never pickled."""
        if not self.active:
            return [value]
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=self.device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return [
            json.loads(bytes(g[: int(s)].cpu().tolist()).decode())
            for g, s in zip(gathered, sizes, strict=True)
        ]

    # ----- gradients -----

    def wrap(self, model: nn.Module, objective: Objective) -> nn.Module:
        """The module a training step calls: the objective on the model, under DDP when there are several ranks.

        Only LoRA (and trained norm) weights are parameters that need gradients; frozen NF4 weights are
        plain attributes DDP never sees. Every trainable parameter is used in every forward. Buffers are
        not broadcast: RoPE's inverse frequencies are the same on every rank, and the LoRA dropout seed
        must stay each rank's own (it names the micro-batch the rank reads).
        """
        module = LossModule(model, objective)
        if not self.active:
            return module
        # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still syncs buffers at
        # init; False keeps them each rank's own on every torch this supports.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            return DistributedDataParallel(
                module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=False,
                broadcast_buffers=False,
            )

    def accumulating(self, module: nn.Module, last: bool):
        """Skip the gradient all-reduce on every micro-batch of an accumulation but the last."""
        if isinstance(module, DistributedDataParallel) and not last:
            return module.no_sync()
        return nullcontext()

    # ----- failures -----

    def first_failure(self, err: BaseException) -> tuple[int, str] | None:
        """Record this rank's failure unless another rank's came first; returns the first one.

        The store lives in the torchrun agent, so it outlives the rank that failed.
        """
        if self.store is None:
            return None
        mine = json.dumps([self.rank, _failure_text(err)])
        try:
            first = self.store.compare_set(FAILURE_KEY, "", mine)
        except (RuntimeError, dist.DistError):
            return None
        rank, message = json.loads(first)
        return rank, message


@contextmanager
def distributed(device: torch.device) -> Iterator[Distributed]:
    """The process group of one run (none outside torchrun), closed however the run ends.

    A rank that fails first records its error for the others and names itself in its message; the ranks
    that then lose contact with it stop with RankFailed naming it, instead of a broken-connection error.
    """
    run = Distributed.from_env(device)
    try:
        yield run
    except KeyboardInterrupt:
        raise
    except Exception as err:
        if not run.active or isinstance(err, SHARED_OUTCOMES):
            raise
        first = run.first_failure(err)
        if first is not None and first[0] != run.rank:
            failed = RankFailed(f"rank {first[0]} failed: {first[1]}; every rank stopped")
            failed.same_error = first[1] == _failure_text(err)
            raise failed from None
        if isinstance(err, QLoraError) and not run.is_main:
            err.args = (f"rank {run.rank}: {err}",)
        err.failed_rank = run.rank
        raise
    finally:
        run.close()


def _failure_text(err: BaseException) -> str:
    return str(err) if isinstance(err, QLoraError) else f"{type(err).__name__}: {err}"


def check_world_size(checkpoint: Path, world_size: int) -> None:
    """A checkpoint continues only with the number of processes that wrote it: the data order depends on it."""
    saved = read_trainer_state(checkpoint).world_size
    if saved != world_size:
        raise QLoraError(
            f"cannot resume {checkpoint}: it was written by {count(saved, 'process', 'processes')} "
            f"and this run has {world_size}; resume it with `--nproc {saved}`"
        )


def _launch(nproc: int, args: list[str]) -> int:
    """Run `qlora ARGS` in `nproc` processes under torchrun (its agent quiet: torchrun_agent.py); returns
    the ranks' exit code.

    torchrun runs in its own session, so a Ctrl-C reaches it once, through here; it passes the signal on
    to every rank, which finish the step, save and stop. A run stopped by a signal exits 128 + signal.
    """
    command = [
        sys.executable,
        "-m",
        "qlora_cli.train.torchrun_agent",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "qlora_cli",
        *args,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    child = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and code != 0:
        return 128 + received[0]
    return code


def _set_options(overrides) -> list[str]:
    return [f"--set={text}" for text in overrides]


def launch_train(nproc: int, config_path: Path, overrides=(), accept_changed_data=False) -> int:
    """`qlora train CONFIG` in `nproc` processes; a bad config or an output_dir holding another run is one
    error here, before any starts."""
    config = load_config(config_path, overrides)
    check_new_run(Path(config.output_dir), config.overwrite_output_dir)
    accept = ["--accept-changed-data"] if accept_changed_data else []
    return _launch(nproc, ["train", str(config_path), *accept, *_set_options(overrides)])


def launch_resume(
    nproc: int, output_dir: Path, checkpoint: Path | None = None, overrides=(), accept_changed_data=False
) -> int:
    """`qlora resume OUTPUT_DIR` in `nproc` processes, once the checkpoint it would pick fits that many."""
    found = Path(checkpoint) if checkpoint else latest_checkpoint(Path(output_dir))
    if found is not None and found.is_dir():
        check_world_size(found, nproc)
    chosen = [f"--checkpoint={checkpoint}"] if checkpoint else []
    chosen += ["--accept-changed-data"] if accept_changed_data else []
    return _launch(nproc, ["resume", str(output_dir), *chosen, *_set_options(overrides)])
