"""The training loop: accumulate, clip, schedule, evaluate, log, checkpoint, and stop cleanly.

Everything a step depends on is a pure function of the step number (the learning rate, which
micro-batches it reads) or lives in a checkpoint (weights, optimizer moments, RNG states), which
is what makes `qlora resume` continue bit for bit where the run stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from qlora_cli.checkpoint import latest_checkpoint, load_checkpoint, read_checkpoint_config, save_checkpoint
from qlora_cli.config import TrainConfig, apply_override, config_from_dict, config_to_dict, parse_override
from qlora_cli.data import BatchPlan, load_examples, split_validation
from qlora_cli.distributed import Distributed, check_world_size, distributed
from qlora_cli.errors import QLoraError, RunInterrupted, TrainingStopped
from qlora_cli.graphs import GraphedLoss
from qlora_cli.hub import resolve_dataset, resolve_model
from qlora_cli.memory import layers_to_checkpoint
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.profiler import OpProfiler, region
from qlora_cli.progress import MetricsLog, TrainProgress, memory_gib
from qlora_cli.tokenizer import ChatTokenizer
from qlora_cli.weights import read_spec

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
    "peft_use_rslora",
    "train_norms",
)


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    loss: float | None
    checkpoint: Path | None


def select_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise QLoraError("config key 'device' is 'cuda' but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.bf16 is True or (config.bf16 == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def learning_rate(config: TrainConfig, step: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup, then the schedule."""
    warmup = (
        config.warmup_steps
        if config.warmup_steps is not None
        else math.ceil(config.warmup_ratio * total_steps)
    )
    if step < warmup:
        return config.learning_rate * (step + 1) / (warmup + 1)
    if config.lr_scheduler == "constant":
        return config.learning_rate
    progress = (step - warmup) / max(1, total_steps - warmup)
    if config.lr_scheduler == "linear":
        return config.learning_rate * max(0.0, 1.0 - progress)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lora_config(config: TrainConfig) -> LoRAConfig:
    """The adapter shape a config asks for."""
    return LoRAConfig(
        r=config.lora_r,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        target_modules=tuple(config.target_modules),
        use_rslora=config.peft_use_rslora,
        train_norms=config.train_norms,
    )


def _local_dataset(dataset):
    """A dataset path that is not on disk is a hub dataset repo id."""
    if Path(dataset.path).exists():
        return dataset
    folder = resolve_dataset(dataset.path, dataset.revision)
    return dataclasses.replace(dataset, path=str(folder))


@dataclass
class Run:
    """What a training run is made of, built once from a config."""

    config: TrainConfig
    device: torch.device
    model: QLoRAModel
    optimizer: torch.optim.Optimizer
    train_plan: BatchPlan
    eval_plan: BatchPlan | None
    total_steps: int
    notes: list[str]
    dist: Distributed
    loss_module: torch.nn.Module
    graphed: GraphedLoss | None = None

    def packed_doc_ids(self, batch):
        """Document ids matter only in packed rows; a padded single-document row is plain causal."""
        return batch.doc_ids if self.config.sample_packing else None


def _check_output_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise QLoraError(f"output_dir {path} exists and is not a folder")


def cuda_graph_blocker(config: TrainConfig, device: torch.device, world_size: int) -> str | None:
    """Why this run cannot replay its micro-batches as CUDA graphs (qlora_cli/graphs.py), or None."""
    if device.type != "cuda":
        return f"they need a CUDA device and this run trains on {device.type}"
    if world_size > 1:
        return "several processes exchange gradients through DDP's hooks, which a graph does not replay"
    if not config.sample_packing:
        return "without sample_packing a micro-batch's width changes from batch to batch"
    if config.lora_dropout:
        return "lora_dropout draws random numbers"
    return None


def _graphed_loss(config: TrainConfig, run: Run, profiling: bool) -> GraphedLoss | None:
    """`auto` replays graphs where they work; `true` insists; a profile times ops one by one, eagerly."""
    if config.cuda_graphs is False or profiling:
        return None
    blocker = cuda_graph_blocker(config, run.device, run.dist.world_size)
    if blocker is None:
        return GraphedLoss(run.loss_module, run.device, run.model.spec.vocab_size)
    if config.cuda_graphs is True:
        raise QLoraError(f"config key 'cuda_graphs' is true, but {blocker}; set it to auto or false")
    return None


def build_run(config: TrainConfig, dist: Distributed | None = None) -> Run:
    output_dir = Path(config.output_dir)
    _check_output_dir(output_dir)
    dist = dist or Distributed(device=select_device(config.device))
    device = dist.device
    dtype = compute_dtype(config, device)
    folder = resolve_model(config.base_model, config.revision)
    spec = read_spec(folder)
    if config.sequence_len > spec.max_position_embeddings:
        raise QLoraError(
            f"config key 'sequence_len': {config.sequence_len} is above the model's maximum "
            f"of {spec.max_position_embeddings} (max_position_embeddings)"
        )
    tokenizer = ChatTokenizer.from_folder(folder)
    notes: list[str] = []
    examples = []
    for dataset in config.datasets:
        loaded = load_examples(_local_dataset(dataset), tokenizer, config.sequence_len)
        examples.extend(loaded)
        if loaded.truncated:
            notes.append(f"{dataset.path}: {loaded.truncated} examples truncated to sequence_len")
        if loaded.dropped:
            notes.append(f"{dataset.path}: {loaded.dropped} examples dropped (no trained token left)")
    train_examples, eval_examples = split_validation(examples, config.val_set_size, config.seed)
    if not train_examples:
        raise QLoraError("no training examples are left after the validation split")
    plan_args = dict(
        micro_batch_size=config.micro_batch_size,
        sequence_len=config.sequence_len,
        sample_packing=config.sample_packing,
        seed=config.seed,
        pad_token_id=tokenizer.pad_token_id,
    )
    train_plan = BatchPlan(train_examples, **plan_args)
    eval_plan = BatchPlan(eval_examples, **plan_args) if eval_examples else None
    batches_per_step = train_plan.num_batches / (config.gradient_accumulation_steps * dist.world_size)
    total_steps = config.max_steps or max(1, math.ceil(config.num_epochs * batches_per_step))
    lora = lora_config(config)
    tokens_per_micro_batch = config.micro_batch_size * config.sequence_len
    checkpointed = layers_to_checkpoint(
        config.gradient_checkpointing,
        spec,
        tokens_per_micro_batch,
        config.memory_budget_gb,
        config.lora_r,
        config.lora_dropout,
    )
    model = QLoRAModel.from_pretrained(
        folder,
        quantize=config.quantize,
        lora=lora,
        device=device,
        dtype=dtype,
        attention_backend=config.attention,
        checkpoint_layers=checkpointed,
        seed=config.seed,
    )
    model.train()
    optimizer = torch.optim.AdamW(
        model.trainable_parameters(),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",
    )
    return Run(
        config, device, model, optimizer, train_plan, eval_plan, total_steps, notes, dist, dist.wrap(model)
    )


class StopSignals:
    """SIGINT/SIGTERM set a flag; the loop finishes its step, saves, and exits non-zero."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


def evaluate(run: Run) -> tuple[float, float]:
    """Mean token loss and perplexity over the whole validation set, shared among the ranks."""
    model, plan = run.model, run.eval_plan
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for index in run.dist.shard(plan.num_batches):
            batch = plan.batch(0, index).to(run.device)
            total, n = model.loss(
                batch.input_ids, batch.labels, batch.position_ids, run.packed_doc_ids(batch)
            )
            loss_sum += total.double().cpu()
            count += int(n)
    model.train()
    loss_sum, count = run.dist.sum(float(loss_sum), count)
    loss = loss_sum / max(1, count)
    return loss, math.exp(min(loss, 50.0))


def _train_step(run: Run, step: int) -> tuple[float, int, int]:
    """One optimizer step over `gradient_accumulation_steps` micro-batches.

    The loss is normalised by the trained tokens of the whole accumulated batch, so accumulation
    gives the same update as one large batch. Under DDP the batch is every rank's micro-batches and
    DDP averages gradients over ranks, so each rank scales its loss by the world size.
    Returns (this rank's summed loss, trained tokens of all ranks, this rank's input tokens).
    """
    config, plan, dist = run.config, run.train_plan, run.dist
    with region("data"):
        indices = dist.micro_batches(step, config.gradient_accumulation_steps)
        batches = [plan.batch(*divmod(index, plan.num_batches)) for index in indices]
    trained = int(dist.sum(sum(b.n_tokens for b in batches))[0])
    scale = dist.world_size / max(1, trained)
    loss_total = torch.zeros((), dtype=torch.float32, device=run.device)
    for i, batch in enumerate(batches):
        if run.graphed is not None:
            inputs = batch.padded_to(config.micro_batch_size)
            tensors = (inputs.input_ids, inputs.labels, inputs.position_ids, inputs.doc_ids)
            loss_total += run.graphed(tensors, 1, scale)
            continue
        with region("data"):
            batch = batch.to(run.device)
        with dist.accumulating(run.loss_module, last=i == len(batches) - 1):
            loss_sum, _ = run.loss_module(
                batch.input_ids, batch.labels, batch.position_ids, run.packed_doc_ids(batch)
            )
            with region("backward"):
                (loss_sum * scale).backward()
        loss_total += loss_sum.detach()
    return float(loss_total), trained, sum(b.input_ids.numel() for b in batches)


def _optimizer_step(run: Run, step: int) -> float:
    params = run.model.trainable_parameters()
    with region("optimizer", params):
        if run.config.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, run.config.max_grad_norm))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        lr = learning_rate(run.config, step, run.total_steps)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.optimizer.step()
        # A CUDA graph writes into the gradients it was captured with: keep them, zeroed.
        run.optimizer.zero_grad(set_to_none=run.graphed is None)
    return grad_norm


def _save(run: Run, step: int, metrics: list[dict]) -> Path:
    """Rank 0 writes the checkpoint, with every rank's RNG state; the others wait until it is written."""
    plan, dist = run.train_plan, run.dist
    epoch, index = divmod(step * run.config.gradient_accumulation_steps * dist.world_size, plan.num_batches)
    rng = dist.all_gather_json(_rng_state(run.device))
    state = {
        "step": step,
        "total_steps": run.total_steps,
        "epoch": epoch,
        "batch_index": index,
        "world_size": dist.world_size,
        "compute_dtype": str(compute_dtype(run.config, run.device)).removeprefix("torch."),
        "rng": rng,
        "lr": learning_rate(run.config, max(0, step - 1), run.total_steps),
        "metrics": metrics[-100:],
    }
    folder = Path(run.config.output_dir) / f"checkpoint-{step}"
    if dist.is_main:
        folder = save_checkpoint(folder.parent, step, run.model, run.optimizer, state, run.config)
    dist.barrier()
    return folder


def train(
    config: TrainConfig,
    *,
    resume_from: Path | None = None,
    console: Console | None = None,
    profiler: OpProfiler | None = None,
) -> TrainResult:
    """Train LoRA adapters as the config says; with resume_from, continue that checkpoint.

    With a profiler, every optimizer step runs under `profiler.step` (qlora_cli/profiler.py).

    Under torchrun every process calls this and they share the work (distributed.py); rank 0 alone
    prints and writes files.
    """
    with distributed(select_device(config.device)) as dist:
        return _train(config, dist, resume_from, console or Console(stderr=True), profiler)


def _train(
    config: TrainConfig,
    dist: Distributed,
    resume_from: Path | None,
    console: Console,
    profiler: OpProfiler | None = None,
) -> TrainResult:
    if not dist.is_main:
        console = Console(quiet=True)
    if resume_from is not None:
        check_world_size(resume_from, dist.world_size)
    run = build_run(config, dist)
    run.graphed = _graphed_loss(config, run, profiling=profiler is not None)
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    start, metrics = 0, []
    if resume_from is not None:
        state = load_checkpoint(resume_from, run.model, run.optimizer)
        start, metrics = state["step"], list(state.get("metrics", []))
        _set_rng_state(state["rng"][dist.rank], run.device)
        console.print(f"resuming from {resume_from} at step {start}")
    else:
        torch.manual_seed(config.seed + dist.rank)
    for note in run.notes:
        console.print(f"[yellow]note:[/] {note}")
    n_trainable = sum(p.numel() for p in run.model.trainable_parameters())
    console.print(
        f"{run.model.spec.model_type} · {run.model.spec.num_layers} layers · "
        f"{'NF4' if config.quantize else 'unquantized'} base · {n_trainable:,} trainable parameters · "
        f"{run.train_plan.num_batches} micro-batches per epoch · {run.total_steps} steps on {run.device}"
    )
    if dist.active:
        console.print(f"data parallel over {dist.world_size} processes ({dist.device.type})")
    resumed_at = start if resume_from is not None else None
    log = MetricsLog(output_dir / "metrics.jsonl", resumed_at) if dist.is_main else None
    batches_per_step = config.gradient_accumulation_steps * dist.world_size
    last_checkpoint = resume_from
    loss = None
    window_loss, window_tokens, window_inputs, window_start = 0.0, 0, 0, time.perf_counter()
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    with StopSignals() as signals, TrainProgress(console, run.total_steps, start) as progress:
        for step in range(start, run.total_steps):
            with profiler.step(run.device) if profiler else contextlib.nullcontext():
                loss_sum, trained, inputs = _train_step(run, step)
                loss_sum, inputs = dist.sum(loss_sum, inputs)
                stop_signal = int(dist.max(signals.received or 0))
                if not math.isfinite(loss_sum):
                    kept = f"; last good checkpoint: {last_checkpoint}" if last_checkpoint else ""
                    raise TrainingStopped(f"loss is {loss_sum} at step {step + 1}; the run stopped{kept}")
                grad_norm = _optimizer_step(run, step)
            done = step + 1
            window_loss += loss_sum
            window_tokens += trained
            window_inputs += inputs
            loss = loss_sum / max(1, trained)
            record = None
            if done % config.logging_steps == 0 or done == run.total_steps:
                elapsed = max(1e-9, time.perf_counter() - window_start)
                peaks = dist.all_gather_json(memory_gib(run.device))
                record = {
                    "step": done,
                    "loss": window_loss / max(1, window_tokens),
                    "lr": learning_rate(config, step, run.total_steps),
                    "grad_norm": grad_norm,
                    "epoch": round(done * batches_per_step / run.train_plan.num_batches, 4),
                    "trained_tokens": window_tokens,
                    "tokens_per_s": window_inputs / elapsed,
                    "memory_gib": None if peaks[0] is None else max(peaks),
                }
                if dist.active:
                    record["memory_gib_per_rank"] = peaks
                window_loss, window_tokens, window_inputs, window_start = 0.0, 0, 0, time.perf_counter()
            if run.eval_plan is not None and config.eval_steps and done % config.eval_steps == 0:
                eval_loss, eval_ppl = evaluate(run)
                record = record or {"step": done}
                record.update(eval_loss=eval_loss, eval_ppl=eval_ppl)
            if record is not None:
                if log is not None:
                    log.write(record)
                metrics.append(record)
                if "loss" in record:
                    progress.update(done, record)
            progress.advance_to(done)
            stopping = stop_signal != 0
            if (config.save_steps and done % config.save_steps == 0) or stopping or done == run.total_steps:
                last_checkpoint = _save(run, done, metrics)
            if stopping:
                name = signal.Signals(stop_signal).name
                raise RunInterrupted(
                    f"{name} received: stopped after step {done}, checkpoint saved in {last_checkpoint}; "
                    f"continue with `qlora resume {output_dir}{dist.resume_option}`",
                    stop_signal,
                )
    if last_checkpoint is not None and dist.is_main:
        _write_final_adapter(run, last_checkpoint)
    return TrainResult(output_dir, run.total_steps, loss, last_checkpoint)


def _write_final_adapter(run: Run, checkpoint: Path) -> None:
    """The last checkpoint's adapter files, also at the top of output_dir where users look first."""
    output_dir = Path(run.config.output_dir)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        target = output_dir / name
        temp = output_dir / f".{name}.tmp"
        temp.write_bytes((checkpoint / name).read_bytes())
        temp.replace(target)


def resume(output_dir: Path, *, checkpoint: Path | None = None, overrides=(), console=None) -> TrainResult:
    """Continue a run from its newest complete checkpoint (or the one given)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise QLoraError(f"{output_dir} is not a folder with checkpoints")
    checkpoint = Path(checkpoint) if checkpoint else latest_checkpoint(output_dir)
    if checkpoint is None:
        raise QLoraError(f"{output_dir} has no complete checkpoint to resume from")
    if not checkpoint.is_dir():
        raise QLoraError(f"checkpoint {checkpoint} does not exist")
    saved = read_checkpoint_config(checkpoint)
    raw = config_to_dict(saved)
    for text in overrides:
        apply_override(raw, *parse_override(text))
    config = config_from_dict(raw)
    for key in BREAKING_KEYS:
        if getattr(config, key) != getattr(saved, key):
            raise QLoraError(
                f"cannot resume {checkpoint}: '{key}' changed from {getattr(saved, key)!r} to "
                f"{getattr(config, key)!r}, which changes the trained weights"
            )
    if Path(config.output_dir).resolve() != output_dir.resolve():
        config = dataclasses.replace(config, output_dir=str(output_dir))
    return train(config, resume_from=checkpoint, console=console)
