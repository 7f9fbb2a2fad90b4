"""A training run built from a config: the model, its optimizer, the batch plans, the processes.

`qlora train`, `qlora profile` and the tests build a run the same way, through `build_run`, and
step it through qlora_cli/train/step.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.wording import count
from qlora_cli.data.examples import (
    IGNORE_INDEX,
    BatchPlan,
    Example,
    check_sequence_len,
    check_token_ids,
    prepare_data,
)
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import compute_dtype, fp8_problem, lora_config, select_device
from qlora_cli.model.layers import shape_problem
from qlora_cli.model.planner import (
    RunShape,
    estimated_peak_bytes,
    layers_to_checkpoint,
    longest_micro_batch,
    offloads_activations,
)
from qlora_cli.rundir.adapter import adopt_adapter_shape, load_adapter_state, read_peft_adapter
from qlora_cli.rundir.base_model import is_local_base
from qlora_cli.rundir.folder import check_free_space, space_needed
from qlora_cli.sources.fingerprint import base_fingerprint
from qlora_cli.sources.hub import model_reference, resolve_model
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.run_tokenizer import run_tokenizer
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.weights import locate_tensors
from qlora_cli.train.distributed import Distributed
from qlora_cli.train.graphs import GraphedLoss, graphed_loss_for
from qlora_cli.train.objectives import Objective, causal_lm
from qlora_cli.train.schedule import warmup_note


@dataclass(kw_only=True)
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
    objective: Objective  # what the step minimises (qlora_cli/train/objectives.py)
    loss_module: torch.nn.Module
    graphed: GraphedLoss | None = None
    eval_every: int | None = None  # optimizer steps between evaluations
    save_every: int | None = None  # optimizer steps between checkpoints
    run_id: str | None = None  # what its checkpoints record (qlora_cli/rundir/folder.py)
    data_files: list[dict] = dataclasses.field(default_factory=list)  # the local data files it read
    base_fingerprint: dict | None = (
        None  # a local base's weights, config and tokenizer (rundir/base_model.py)
    )
    startup_s: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per start-up part

    @staticmethod
    def packed_doc_ids(batch, plan: BatchPlan):
        """Document ids matter only in packed rows; a padded single-document row is plain causal."""
        return batch.doc_ids if plan.sample_packing else None

    def real_tokens(self, batch):
        """The padding mask, for a model that adds the load-balancing loss (QLoRAModel.loss); None for
        the others, which read none, so none is made or copied."""
        return batch.real_tokens() if self.model.balances_experts else None


def _absolute(value):
    """Local paths (alone, in lists or in mappings) made absolute; anything else (a hub id, a glob) as is."""
    if isinstance(value, list):
        return [_absolute(item) for item in value]
    if isinstance(value, dict):
        return {key: _absolute(item) for key, item in value.items()}
    if isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def portable_config(config: TrainConfig, model_folder: Path) -> TrainConfig:
    """The config as checkpoints save it: local paths absolute and a hub model pinned to the commit it
    was downloaded at, so that the run resumes and exports the same from any directory (build_run
    pins hub datasets once they are downloaded: qlora_cli/data/examples.py, pinned_dataset)."""
    base_model, revision = model_reference(config.base_model, config.revision, model_folder)
    datasets = [
        dataclasses.replace(d, path=_absolute(d.path), data_files=_absolute(d.data_files))
        for d in config.datasets
    ]
    return dataclasses.replace(
        config,
        base_model=base_model,
        revision=revision,
        datasets=datasets,
        output_dir=str(Path(config.output_dir).expanduser().resolve()),
    )


def build_run(
    config: TrainConfig,
    dist: Distributed | None = None,
    *,
    eager: bool = False,
    check_space: bool = False,
    objective: Objective = causal_lm,
) -> Run:
    """The run a config describes. eager: launch op by op even where CUDA graphs could replay the
    micro-batches (a profile times ops one by one). check_space: before any weights load, make sure
    output_dir has room for the checkpoints and adapter of this model. objective: what its steps
    minimise."""
    dist = dist or Distributed(device=select_device(config.device))
    if config.fp8 and (problem := fp8_problem(dist.device)):
        raise QLoraError(problem)
    # The base's shape comes first and alone: the space and length checks need it, and must refuse
    # before anything heavy is read.
    folder = resolve_model(config.base_model, config.revision)
    spec = read_spec(folder)
    if check_space:
        check_free_space(Path(config.output_dir), space_needed(spec, config))
    config = portable_config(config, folder)
    check_sequence_len(config, spec)
    if problem := shape_problem(spec):
        raise QLoraError(problem)
    tokenizer = run_tokenizer(folder, config)
    notes = list(config.notes)
    if (skipped := locate_tensors(folder, spec).note()) is not None:
        notes.append(skipped)
    fingerprint = base_fingerprint(folder) if is_local_base(config.base_model) else None
    # A starting adapter sets the LoRA shape, which the memory plan and the model are built with.
    config, start_adapter = _start_adapter(config, notes)
    if problem := spec.lora_target_problem(config.target_modules, config.lora_target_parameters):
        raise QLoraError(problem)
    if (unmatched := spec.lora_target_note(config.target_modules)) is not None:
        notes.append(unmatched)
    data_start = time.perf_counter()
    config, train_plan, eval_plan, data_files = _setup_data(config, tokenizer, notes)
    data_s = time.perf_counter() - data_start
    evaluated = eval_plan.examples if eval_plan else []
    check_token_ids([*train_plan.examples, *evaluated], tokenizer, spec.vocab_size)
    # The schedule counts the train plan's batches; the memory plan decides how the model is built.
    total_steps, eval_every, save_every = _schedule(config, train_plan, eval_plan, dist.world_size, notes)
    plan = _plan_memory(config, spec, dist.world_size, dist.device, notes)
    model_start = time.perf_counter()
    model = _setup_model(config, folder, dist.device, plan, start_adapter)
    model_s = time.perf_counter() - model_start
    model.lm_head_trained_rows_only = untrained_share(train_plan.examples) >= UNTRAINED_SHARE_TO_SKIP
    # The optimizer holds the model's trainable parameters; graphs replay the wrapped objective.
    optimizer = _setup_optimizer(config, model)
    loss_module = dist.wrap(model, objective)
    graphed = None
    if not eager:
        graphed = graphed_loss_for(config, loss_module, dist.device, spec.vocab_size, dist.world_size)
    return Run(
        config=config,
        device=dist.device,
        model=model,
        optimizer=optimizer,
        train_plan=train_plan,
        eval_plan=eval_plan,
        total_steps=total_steps,
        notes=notes,
        dist=dist,
        objective=objective,
        loss_module=loss_module,
        graphed=graphed,
        eval_every=eval_every,
        save_every=save_every,
        startup_s={"data": data_s, "model": model_s},
        data_files=data_files,
        base_fingerprint=fingerprint,
    )


def _start_adapter(
    config: TrainConfig, notes: list[str]
) -> tuple[TrainConfig, dict[str, torch.Tensor] | None]:
    """The tensors of the adapter lora_model_dir names (None without one), and the config in its shape."""
    if config.lora_model_dir is None:
        return config, None
    saved, tensors = read_peft_adapter(resolve_model(config.lora_model_dir))
    config, adopted = adopt_adapter_shape(config, saved, config.lora_model_dir)
    notes += adopted
    return config, tensors


def _setup_data(
    config: TrainConfig, tokenizer: ChatTokenizer, notes: list[str]
) -> tuple[TrainConfig, BatchPlan, BatchPlan | None, list[dict]]:
    """The examples planned into micro-batches, the config naming the datasets as they were pinned, and
    the local files read (path, size, hash), which resume checks."""
    data = prepare_data(config, tokenizer)
    config = dataclasses.replace(config, datasets=data.datasets, test_datasets=data.test_datasets)
    notes += data.notes()
    train_plan = BatchPlan.from_config(data.train, config, tokenizer.pad_token_id)
    eval_packing = config.sample_packing if config.eval_sample_packing is None else config.eval_sample_packing
    eval_plan = (
        BatchPlan.from_config(data.validation, config, tokenizer.pad_token_id, sample_packing=eval_packing)
        if data.validation
        else None
    )
    return config, train_plan, eval_plan, data.files


def _schedule(
    config: TrainConfig, train_plan: BatchPlan, eval_plan: BatchPlan | None, world_size: int, notes: list[str]
) -> tuple[int, int | None, int | None]:
    """(total optimizer steps, steps between evaluations, steps between saves)."""
    # An epoch's last step takes the micro-batches left, so no step spans two epochs.
    steps_per_epoch = train_plan.steps_per_epoch(config.gradient_accumulation_steps * world_size)
    total_steps = config.max_steps or max(1, math.ceil(config.num_epochs * steps_per_epoch))
    if (long_warmup := warmup_note(config, total_steps)) is not None:
        notes.append(long_warmup)
    eval_every = _every(config.eval_steps, config.evals_per_epoch, steps_per_epoch)
    if eval_every and eval_plan is None:
        notes.append("no validation set (val_set_size is 0): nothing to evaluate")
    if eval_every is None and eval_plan is not None:
        # Rows held out to be evaluated are evaluated: at each epoch's end, or the run's if sooner.
        eval_every = min(steps_per_epoch, total_steps)
        notes.append(
            f"a validation set and neither eval_steps nor evals_per_epoch: evaluating every "
            f"{count(eval_every, 'step')} (each epoch's end, or the run's); set either to choose"
        )
    return total_steps, eval_every, _every(config.save_steps, config.saves_per_epoch, steps_per_epoch)


@dataclass(frozen=True)
class MemoryPlan:
    checkpoint_layers: int  # layers, from the first, that recompute in backward
    offload_activations: bool  # whether their inputs wait in host memory


def _plan_memory(
    config: TrainConfig, spec: ModelSpec, world_size: int, device: torch.device, notes: list[str]
) -> MemoryPlan:
    """How the model keeps its activations, from the config's settings and memory budget."""
    shape = RunShape(
        config.micro_batch_size * config.sequence_len, lora_config(config), config.memory_budget_gb
    )
    offload_setting = config.activation_offloading
    if world_size > 1 and offload_setting:
        if offload_setting is True:
            notes.append(
                "activation_offloading: not with several processes yet (DDP's gradient hooks do not "
                "follow an offloaded layer's own backward); recomputed layers keep their input on the GPU"
            )
        offload_setting = False
    offload = offloads_activations(offload_setting, config.gradient_checkpointing, spec, shape, device.type)
    checkpointed = layers_to_checkpoint(config.gradient_checkpointing, spec, shape, offload=offload)
    if offload and not checkpointed:
        notes.append("activation_offloading: no layer recomputes in backward, so nothing is offloaded")
        offload = False
    if note := _over_memory_note(spec, shape, checkpointed, offload, offload_setting, device):
        notes.append(note)
    return MemoryPlan(checkpointed, offload)


def _over_memory_note(
    spec: ModelSpec,
    shape: RunShape,
    checkpointed: int,
    offload: bool,
    offload_setting: bool | str,
    device: torch.device,
) -> str | None:
    """Where the planner's peak is over the budget, or without one over the GPU's memory: said before the
    weights load, with what to change (the micro-batch that fits with every layer recomputed, offloaded
    as `offload_setting` would then have it), though the estimate may be a few percent off either way."""
    if shape.budget_gb is not None:
        limit, what = shape.budget_gb * 2**30, f"memory_budget_gb {shape.budget_gb:g}"
    elif device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).total_memory
        what = f"the GPU's {limit / 2**30:.1f} GiB"
    else:
        return None
    estimate = estimated_peak_bytes(spec, shape, checkpointed, offload=offload)
    if estimate <= limit:
        return None
    offload_recomputed = offloads_activations(offload_setting, True, spec, shape, device.type)
    longest = longest_micro_batch(spec, shape, limit, offload=offload_recomputed)
    if longest:
        fitting = f"with every layer recomputed, micro-batches of up to {longest} tokens fit"
    else:
        one_token = estimated_peak_bytes(
            spec, dataclasses.replace(shape, tokens=1), spec.num_layers, offload=offload_recomputed
        )
        fitting = f"even a micro-batch of one token comes to {one_token / 2**30:.3g} GiB"
    return (
        f"memory: the planner puts this run's peak at {estimate / 2**30:.3g} GiB, over {what}; it may run "
        f"out of GPU memory: {memory_advice(checkpointed, spec.num_layers)} ({fitting})"
    )


def memory_advice(checkpointed: int, layers: int) -> str:
    """What to change when a run needs more GPU memory: recompute every layer if some keep their
    activations, else a smaller micro-batch."""
    advice = "lower micro_batch_size or sequence_len"
    if checkpointed < layers:
        return f"set gradient_checkpointing: true ({checkpointed} of {layers} layers recompute), or {advice}"
    return advice


# Where at least this share of the training tokens is read by no loss (a prompt under train_on_inputs:
# false, the user turns of chats), the lm_head's GEMMs skip those tokens: with a vocabulary of 150-250K
# the head is a quarter of the step's products at 8 layers of a 9B. Below it the skip costs more than
# it saves: on an H100 (benchmarks.kernels --only lm_head, Qwen2.5's head, 8192 tokens) the grouped
# GEMMs take 34.4 ms with nothing masked against the plain 30.2, and 21.5 against 28.8 with 40 %
# masked; the two lines, 2.1 + 32.2 (1 - s) and 30.2 - 3.6 s, cross at s = 0.14.
UNTRAINED_SHARE_TO_SKIP = 0.15


def untrained_share(examples: list[Example], sampled: int = 4096) -> float:
    """The share of the examples' positions whose label no loss reads, over `sampled` of them spread
    evenly: enough to set against a threshold, without counting every token of a large dataset at start-up."""
    examples = examples[:: max(1, len(examples) // sampled)]
    positions = sum(len(e.labels) for e in examples)
    return sum(e.labels.count(IGNORE_INDEX) for e in examples) / max(1, positions)


def _setup_model(
    config: TrainConfig,
    folder: Path,
    device: torch.device,
    plan: MemoryPlan,
    start_adapter: dict[str, torch.Tensor] | None,
) -> QLoRAModel:
    """The base loaded (quantized unless the config says not) with a fresh adapter or the starting one."""
    model = QLoRAModel.from_pretrained(
        folder,
        quantize=config.quantize,
        lora=lora_config(config),
        device=device,
        dtype=compute_dtype(config, device),
        attention_backend=config.attention,
        checkpoint_layers=plan.checkpoint_layers,
        offload_activations=plan.offload_activations,
        seed=config.seed,
    )
    if start_adapter is not None:
        load_adapter_state(model, start_adapter, config.lora_model_dir)
    if config.fp8:
        try:
            model.use_fp8()
        except ValueError as err:
            raise QLoraError(f"config key 'fp8': {err}") from None
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model


def _setup_optimizer(config: TrainConfig, model: QLoRAModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.trainable_parameters(),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
        fused=config.optimizer == "adamw_torch_fused",
    )


def _every(steps: int | None, per_epoch: int | None, steps_per_epoch: int) -> int | None:
    """Optimizer steps between evaluations or saves: given as steps, or as a count per epoch."""
    if per_epoch is None:
        return steps
    return max(1, math.ceil(steps_per_epoch / per_epoch))
