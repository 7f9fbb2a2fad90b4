"""One training step of a run, in parts that `qlora train`, `qlora profile` and the benchmarks share.

Everything a step depends on is a pure function of the step number (the learning rate, which
micro-batches it reads) or of the run's state, which is what lets `qlora resume` continue bit for
bit and lets the profiler time exactly the step that training runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from qlora_cli.core.ops import Op
from qlora_cli.core.profiling import region
from qlora_cli.train.graphs import GraphedLoss, LossFn
from qlora_cli.train.run import Run
from qlora_cli.train.schedule import learning_rate


class StepLoss(NamedTuple):
    loss_sum: float  # this rank's summed token loss
    trained_tokens: int  # trained tokens of all ranks
    input_tokens: int  # this rank's input tokens, padding included
    # This rank's load-balancing loss (unscaled) times each micro-batch's trained tokens, summed, as it
    # enters loss_sum; None where the model adds none.
    aux_loss_sum: float | None


def dropout_seed(run_seed: int, micro_batch: int) -> int:
    """The LoRA dropout seed of global micro-batch `micro_batch`: a pure function of the run's seed
    and the micro-batch, so masks differ from micro-batch to micro-batch (and rank to rank, which
    read other micro-batches) and a resumed run draws the ones it would have drawn.

    The high 32 bits hash the whole run seed (any int, negative or past 32 bits); the low 32 are the
    micro-batch. The result is that 64-bit word as a signed int64, what the seed tensor holds."""
    digest = hashlib.blake2b(str(run_seed).encode(), digest_size=4).digest()
    word = int.from_bytes(digest, "little") << 32 | (micro_batch % (1 << 32))
    return word - (1 << 64) if word >= 1 << 63 else word


def micro_batch_backward(
    loss_fn: LossFn,
    inputs: Sequence[torch.Tensor | None],
    scale: float,
    graphed: GraphedLoss | None = None,
) -> torch.Tensor:
    """One micro-batch's summed loss, detached, after back-propagating `loss_sum * scale`.

    `inputs` are loss_fn's arguments, labels second. With `graphed`, the forward and backward are
    replayed from its CUDA graph, which copies the inputs onto the device itself.
    """
    if graphed is not None:
        return graphed(inputs, 1, scale)
    loss_sum, _ = loss_fn(*inputs)
    with region(Op.BACKWARD):
        (loss_sum * scale).backward()
    return loss_sum.detach()


def clear_gradients(optimizer: torch.optim.Optimizer, graphed: GraphedLoss | None) -> None:
    """A CUDA graph writes into the gradients it was captured with: keep them, zeroed."""
    optimizer.zero_grad(set_to_none=graphed is None)


def train_step(run: Run, step: int) -> StepLoss:
    """The forward and backward of optimizer step `step` over `gradient_accumulation_steps` micro-batches,
    or over those left in the epoch when it is the epoch's last step.

    The loss is normalised by the trained tokens of the whole accumulated batch, so accumulation
    gives the same update as one large batch, a short last step included. Under DDP the batch is every
    rank's micro-batches and DDP averages gradients over ranks, so each rank scales its loss by the
    world size; a rank left without a micro-batch runs an untrained one to join the exchange.

    A MoE's load-balancing loss enters each micro-batch's sum as coef · aux · its trained tokens
    (QLoRAModel.loss), so a step adds coef times its micro-batches' aux losses averaged by trained
    tokens, as it averages the token losses: one micro-batch's is transformers' loss exactly, while
    under accumulation each micro-batch's aux is its own, not that of the accumulated batch (a product
    of sums over all its tokens). An untrained micro-batch adds none.
    """
    config, plan, dist = run.config, run.train_plan, run.dist
    with region(Op.DATA):
        epoch, step_indices = plan.step_micro_batches(
            step, config.gradient_accumulation_steps * dist.world_size
        )
        indices = dist.micro_batches(step_indices)
        batches = [plan.batch(epoch, index) for index in indices]
        if not batches:
            indices, batches = range(1), [plan.batch(epoch, 0).untrained()]
    trained = int(dist.sum(sum(b.n_tokens for b in batches))[0])
    scale = dist.world_size / max(1, trained)
    loss_total = torch.zeros((), dtype=torch.float32, device=run.device)
    aux_total = torch.zeros_like(loss_total) if run.model.balances_experts else None
    for i, (index, batch) in enumerate(zip(indices, batches, strict=True)):
        run.model.set_dropout_seed(dropout_seed(config.seed, epoch * plan.num_batches + index))
        if run.graphed is None:
            with region(Op.DATA):
                batch = batch.to(run.device)
            exchange = dist.accumulating(run.loss_module, last=i == len(batches) - 1)
            doc_ids = run.packed_doc_ids(batch, plan)
        else:
            batch = batch.padded_to(config.micro_batch_size)
            exchange, doc_ids = contextlib.nullcontext(), batch.doc_ids
        with exchange:
            inputs = (batch.input_ids, batch.labels, batch.position_ids, doc_ids, run.real_tokens(batch))
            loss_total += micro_batch_backward(run.loss_module, inputs, scale, run.graphed)
        if aux_total is not None:
            aux_total += run.model.router_aux_loss * batch.n_tokens
    aux_sum = None if aux_total is None else float(aux_total)
    return StepLoss(float(loss_total), trained, sum(b.input_ids.numel() for b in batches), aux_sum)


def optimizer_step(run: Run, step: int) -> float:
    """Clip, set the step's learning rate, update, clear the gradients; returns the gradient norm."""
    params = run.model.trainable_parameters()
    with region(Op.OPTIMIZER, params):
        if run.config.max_grad_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, run.config.max_grad_norm))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        lr = learning_rate(run.config, step, run.total_steps)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.optimizer.step()
        clear_gradients(run.optimizer, run.graphed)
    return grad_norm


def evaluate(run: Run) -> tuple[float, float]:
    """Mean token loss (the run's objective per trained token) and perplexity over the whole validation
    set, shared among the ranks."""
    model, plan = run.model, run.eval_plan
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for index in run.dist.shard(plan.num_batches):
            batch = plan.batch(0, index).to(run.device)
            doc_ids = run.packed_doc_ids(batch, plan)
            inputs = (batch.input_ids, batch.labels, batch.position_ids, doc_ids, run.real_tokens(batch))
            total, n = run.objective(model, *inputs)
            loss_sum += total.double().cpu()
            count += int(n)
    model.train()
    loss_sum, count = run.dist.sum(float(loss_sum), count)
    loss = loss_sum / max(1, count)
    return loss, math.exp(min(loss, 50.0))
