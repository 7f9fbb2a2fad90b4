"""Training runs on tiny checkpoints: falling loss, accumulation, exact resume, signals and faults."""

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import (
    add_demo_tokenizer,
    as_written_before_manifests,
    subprocess_env,
    suggested,
    write_qwen3,
    write_run,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from qlora_cli.config.loading import config_from_dict, load_config
from qlora_cli.core.errors import QLoraError, TrainingStopped
from qlora_cli.data.examples import Example
from qlora_cli.model import QLoRAModel, lora_config
from qlora_cli.model.planner import RunShape, estimated_peak_bytes
from qlora_cli.rundir.checkpoint import read_checkpoint_config
from qlora_cli.rundir.folder import latest_checkpoint
from qlora_cli.rundir.trainer_state import read_trainer_state
from qlora_cli.sources.model_config import read_spec
from qlora_cli.train.loop import resume, train
from qlora_cli.train.run import UNTRAINED_SHARE_TO_SKIP, build_run, untrained_share
from qlora_cli.train.schedule import learning_rate
from qlora_cli.train.step import evaluate, optimizer_step, train_step

pytestmark = pytest.mark.usefixtures("reference_ops")
ROOT = Path(__file__).resolve().parent.parent


def _losses(output_dir: Path) -> list[tuple[int, float]]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _run(tmp_path, name, *overrides, **config):
    path = write_run(tmp_path / name, **config)
    return train(load_config(path, overrides))


def test_demo_loss_falls_and_files_are_written(tmp_path, monkeypatch):
    """The shipped demo, shortened: loss falls clearly, metrics, evals, checkpoints and the adapter land."""
    monkeypatch.chdir(ROOT)
    overrides = [
        f"output_dir={tmp_path / 'demo'}",
        "max_steps=20",
        "save_steps=10",
        "eval_steps=10",
        "logging_steps=5",
    ]
    result = train(load_config(ROOT / "configs" / "demo.yaml", overrides))
    losses = [loss for _, loss in _losses(result.output_dir)]
    assert len(losses) == 4
    assert losses[-1] < 0.6 * losses[0]
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[0])
    # The start-up (load, quantize, tokenize, pack) is counted once, in the first record and train.log.
    assert 0 < records[0]["startup_s"] == result.startup_s < result.seconds
    assert all("startup_s" not in r for r in records[1:])
    assert records[0]["tokens_per_s"] == pytest.approx(records[0]["input_tokens"] / records[0]["seconds"])
    log = (result.output_dir / "train.log").read_text()
    assert "start-up" in log and "(read, tokenize, pack)" in log and "(load, quantize)" in log
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[1]["eval_ppl"] > 1
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (result.output_dir / name).is_file()
    assert sorted(p.name for p in result.output_dir.glob("checkpoint-*")) == [
        "checkpoint-10",
        "checkpoint-20",
    ]


def _is_switch(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


class _WeightProducts(TorchFunctionMode):
    """Every product `x @ w` whose 2-D `w` requires grad: on the CPU references, LoRA's A and B
    (the frozen weights and the lm_head need none). Keeps x and, once backward reaches the product,
    the gradient g of its output: w's gradient is x^T g, a sum over tokens of x[t] g[t]."""

    MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
    MULTIPLIES = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__)

    def __init__(self):
        super().__init__()
        self.products: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MULTIPLIES and _is_switch(args[1]) and args[0].requires_grad:
            # LoRA's A times the adapter switch (QLoRAModel.adapter_scale), on here: A itself. The
            # product would save the switch, which the step's backward frees; a view of A saves
            # nothing, so the magnitudes below can differentiate the graph from A again.
            assert args[1].item() == 1.0
            return args[0].view_as(args[0])
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS and args[1].dim() == 2 and args[1].requires_grad:
            product = {"x": args[0].detach().clone(), "w": args[1]}
            out.register_hook(lambda g, product=product: product.update(g=g.detach().clone()))
            self.products.append(product)
        return out


def test_accumulation_matches_one_large_batch(tmp_path):
    """2 micro-batches of 2 rows give the gradient of 1 micro-batch of 4 rows: the loss is normalised
    over the whole accumulated batch. Four steps, each from the same adapter (the big run's).

    Exact, and compared exactly: the rows a step reads, its trained-token count (the normaliser),
    the adapter both runs start from, and every per-token term of the adapter's gradient. The CPU
    references act on each row alone, so the input x and output gradient g of every LoRA product
    are, token for token, the same numbers whichever rows share their micro-batch.

    Only the order of the sums over tokens differs. An adapter gradient element is
    dW[i, j] = sum_t g[t, i] x[t, j] over the step's tokens: one GEMM over 4 rows in the big run, in
    the small one a GEMM per micro-batch and their sum in .grad. Any order of summing n products in
    fp32 lands within gamma_n * sum_t |g[t, i] x[t, j]| of the exact sum, gamma_n = n u / (1 - n u),
    u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so the runs differ by
    at most twice that; the sums of |terms| are computed here in float64 from the recorded terms,
    and n counts every token of the step plus the micro-batches. The summed loss likewise: its
    terms are the token losses, all >= 0, so the bound is 2 gamma_n times the loss itself.

    A real accumulation bug (a micro-batch left out, normalised by its own token count, or its
    gradient overwritten by the next) moves elements by about their size; the bound is 2 gamma_n,
    about 6e-5, of sum |terms|. The weights after AdamW are not compared: its first update is
    lr * g / (|g| + eps), lr * sign(g) to within eps, and later ones divide by sqrt(v) too, so for
    an element whose g is near 0 a rounding-sized change of g is no longer small in the update
    (what made an atol=1e-6 comparison of the trained adapters miss on 1 value of 256)."""
    common = dict(sample_packing=True, max_steps=4)
    big = build_run(load_config(write_run(tmp_path / "big", micro_batch_size=4, **common)))
    small = build_run(
        load_config(
            write_run(tmp_path / "small", micro_batch_size=2, gradient_accumulation_steps=2, **common)
        )
    )
    big_params, small_params = big.model.trainable_parameters(), small.model.trainable_parameters()
    assert all(torch.equal(a, b) for a, b in zip(big_params, small_params, strict=True))
    u = 2.0**-24
    for step in range(4):
        with torch.no_grad():
            for a, b in zip(big_params, small_params, strict=True):
                b.copy_(a)
        assert big.train_plan.step_micro_batches(step, 1) == (0, range(step, step + 1))
        assert small.train_plan.step_micro_batches(step, 2) == (0, range(2 * step, 2 * step + 2))
        halves = [small.train_plan.batch(0, 2 * step + i) for i in range(2)]
        whole = big.train_plan.batch(0, step)
        for field in ("input_ids", "labels", "position_ids", "doc_ids"):
            assert torch.equal(getattr(whole, field), torch.cat([getattr(h, field) for h in halves]))
        losses, products = {}, {}
        for name, run in (("big", big), ("small", small)):
            with _WeightProducts() as recorder:
                losses[name] = train_step(run, step)
            products[name] = recorder.products
        assert losses["small"].trained_tokens == losses["big"].trained_tokens == whole.n_tokens
        assert losses["small"].input_tokens == losses["big"].input_tokens == whole.input_ids.numel()
        count = len(products["big"])
        assert count > 0 and len(products["small"]) == 2 * count
        per_micro_batch = (products["small"][:count], products["small"][count:])
        for one, first, second in zip(products["big"], *per_micro_batch, strict=True):
            for key in ("x", "g"):
                assert torch.equal(one[key], torch.cat([first[key], second[key]])), f"step {step}: {key}"

        n = whole.input_ids.numel() + 2
        gamma = n * u / (1 - n * u)
        loss_error = abs(losses["small"].loss_sum - losses["big"].loss_sum)
        assert loss_error <= 2 * gamma * losses["big"].loss_sum, f"step {step}: loss off by {loss_error}"
        # sum_t |g[t]| |x[t]| for each adapter element, and how many products each one enters.
        magnitudes = [torch.zeros_like(p, dtype=torch.float64) for p in big_params]
        uses = [0] * len(big_params)
        for product in products["big"]:
            absolute = (
                product["x"].double().abs() @ product["w"].double() * product["g"].double().abs()
            ).sum()
            for i, part in enumerate(torch.autograd.grad(absolute, big_params, allow_unused=True)):
                if part is not None:
                    magnitudes[i] += part
                    uses[i] += 1
        for param, other, magnitude, used in zip(big_params, small_params, magnitudes, uses, strict=True):
            assert used > 0, "an adapter tensor enters no recorded product"
            n = used * whole.input_ids.numel() + 2
            bound = 2 * n * u / (1 - n * u) * magnitude
            error = (other.grad.double() - param.grad.double()).abs()
            assert (error <= bound).all(), f"step {step}: {tuple(param.shape)} off by {(error - bound).max()}"
        optimizer_step(big, step)
        small.optimizer.zero_grad()


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "rows, epochs, micro_batches", [(6, 1, 3), (6, 2, 3), (2, 1, 1), (10, 3, 5)], ids=str
)
def test_num_epochs_shows_every_row_that_many_times(tmp_path, rows, epochs, micro_batches):
    """An epoch ends where its data ends: its last step takes the micro-batches left (accumulation 2), so
    `num_epochs: N` trains N times the dataset's trained tokens in N x ceil(micro-batches / 2) steps."""
    config = load_config(
        write_run(
            tmp_path / "run", rows=rows, max_steps=None, num_epochs=epochs, gradient_accumulation_steps=2
        )
    )
    plan = build_run(config).train_plan
    assert plan.num_batches == micro_batches
    dataset_tokens = sum(label != -100 for example in plan.examples for label in example.labels)
    result = train(config)
    records = _records(result.output_dir)
    assert result.step == len(records) == epochs * -(-micro_batches // 2)
    assert sum(r["trained_tokens"] for r in records) == epochs * dataset_tokens
    assert records[-1]["epoch"] == epochs
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert (state["epoch"], state["batch_index"]) == (epochs, 0)


def test_the_lm_head_skips_untrained_tokens_where_the_data_masks_many(tmp_path):
    """Chats whose user turns train nothing (most of the demo rows' tokens) have the lm_head skip those
    tokens; rows that train nearly every token keep the plain GEMMs."""
    run = build_run(load_config(write_run(tmp_path / "run")))
    assert untrained_share(run.train_plan.examples) > 0.5 and run.model.lm_head_trained_rows_only
    nearly_all = [Example(input_ids=[1] * 20, labels=[2] * 19 + [-100]) for _ in range(3)]
    assert untrained_share(nearly_all) == 0.05 < UNTRAINED_SHARE_TO_SKIP


def test_a_short_last_step_is_normalised_over_what_it_holds(tmp_path):
    """The last step of an epoch of 3 micro-batches (accumulation 2) holds one: its loss and gradient are
    those of that micro-batch's mean token loss."""
    config = load_config(write_run(tmp_path / "run", rows=6, gradient_accumulation_steps=2))
    run = build_run(config)
    params = run.model.trainable_parameters()
    (last,) = [run.train_plan.batch(0, 2)]
    logits = run.model(last.input_ids, last.position_ids).flatten(0, 1)
    total = torch.nn.functional.cross_entropy(logits, last.labels.flatten(), reduction="sum")
    expected = torch.autograd.grad(total / last.n_tokens, params)
    loss_sum, trained, _, _ = train_step(run, 1)
    assert trained == last.n_tokens
    assert loss_sum == pytest.approx(float(total.detach()), rel=1e-5)
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-7)


def test_a_step_gradient_is_that_of_the_mean_token_loss(tmp_path):
    """An accumulated step's gradient equals autograd's gradient of the mean loss per trained token,
    computed from the logits with torch's cross entropy: the loss is divided once, by the right count."""
    config = load_config(write_run(tmp_path / "run", micro_batch_size=2, gradient_accumulation_steps=2))
    run = build_run(config)
    params = run.model.trainable_parameters()
    batches = [run.train_plan.batch(0, index) for index in range(2)]
    total = sum(
        torch.nn.functional.cross_entropy(
            run.model(b.input_ids, b.position_ids).flatten(0, 1), b.labels.flatten(), reduction="sum"
        )
        for b in batches
    )
    expected = torch.autograd.grad(total / sum(b.n_tokens for b in batches), params)
    train_step(run, 0)
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-7)


def first_documents_nll(model, input_ids, labels, position_ids, doc_ids, real_tokens):
    """A test-only objective: minus the summed log-probs of each row's first document alone, counted
    over that document's trained tokens (a dense model: real_tokens is None)."""
    logprobs = model.document_log_probs(input_ids, labels, position_ids, doc_ids)
    first = (doc_ids != doc_ids[:, :1]).cumsum(1) == 0
    return -logprobs[:, 0].sum(), ((labels != -100) & first).sum()


def test_an_objective_plugged_in_through_the_seam_is_what_the_step_and_evaluation_minimise(tmp_path):
    """build_run's objective alone decides the loss: the step's loss and gradient, and the evaluation,
    are those of first_documents_nll computed here from the logits, not the causal LM loss."""
    config = load_config(
        write_run(
            tmp_path / "run",
            micro_batch_size=2,
            gradient_accumulation_steps=2,
            sample_packing=True,
            val_set_size=0.25,
            eval_steps=1,
        )
    )
    run = build_run(config, objective=first_documents_nll)
    params = run.model.trainable_parameters()

    def by_hand(batch):
        logits = run.model(batch.input_ids, batch.position_ids, batch.doc_ids)
        trained = batch.labels != -100
        first = (batch.doc_ids != batch.doc_ids[:, :1]).cumsum(1) == 0
        logprobs = torch.log_softmax(logits, -1).gather(2, batch.labels.where(trained, 0)[..., None])[..., 0]
        return -logprobs[trained & first].sum(), int((trained & first).sum())

    batches = [run.train_plan.batch(0, index) for index in range(2)]
    total = sum(by_hand(b)[0] for b in batches)
    trained = sum(b.n_tokens for b in batches)
    assert sum(by_hand(b)[1] for b in batches) < trained, "rows must hold documents after their first"
    expected = torch.autograd.grad(total / trained, params)
    run.model.eval()
    with torch.no_grad():
        evaluated = [by_hand(run.eval_plan.batch(0, i)) for i in range(run.eval_plan.num_batches)]
    run.model.train()
    expected_eval = sum(float(t) for t, _ in evaluated) / sum(n for _, n in evaluated)

    loss_sum, step_trained, _, _ = train_step(run, 0)
    assert step_trained == trained
    assert loss_sum == pytest.approx(float(total.detach()), rel=1e-5)
    for param, grad in zip(params, expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-7)
    assert evaluate(run)[0] == pytest.approx(expected_eval, rel=1e-5)


# Learning rate 1e-3 over 10 optimizer steps (0-based): warmup step s of W runs at (s + 1) / (W + 1);
# after it, progress p = (s - W) / (10 - W): linear 1 - p, cosine (1 + cos(pi p)) / 2, constant 1.
COSINE = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [
        ("linear", {"warmup_steps": 2}, {0: 1 / 3, 1: 2 / 3, 2: 1.0, 5: 1 - 3 / 8, 9: 1 - 7 / 8}),
        ("linear", {"warmup_ratio": 0.2}, {0: 1 / 3, 1: 2 / 3, 2: 1.0, 5: 1 - 3 / 8, 9: 1 - 7 / 8}),
        ("constant", {"warmup_steps": 2}, {0: 1 / 3, 1: 2 / 3, 2: 1.0, 9: 1.0}),
        ("constant", {}, {0: 1.0, 9: 1.0}),
        ("cosine", {}, {0: 1.0, 5: 0.5, 9: COSINE(9 / 10)}),
        # ceil(0.25 * 10) = 3 warmup steps
        ("cosine", {"warmup_ratio": 0.25}, {0: 1 / 4, 2: 3 / 4, 3: 1.0, 6: COSINE(3 / 7), 9: COSINE(6 / 7)}),
    ],
)
def test_schedules(schedule, warmup, expected):
    config = config_from_dict(
        {
            "base_model": "Qwen/Qwen2.5-0.5B",
            "datasets": [{"path": "data.jsonl", "type": "alpaca"}],
            "learning_rate": 1e-3,
            "lr_scheduler": schedule,
            **warmup,
        }
    )
    got = {step: learning_rate(config, step, 10) for step in expected}
    assert got == pytest.approx({step: 1e-3 * factor for step, factor in expected.items()}, rel=1e-12)


def test_the_logged_lr_is_the_one_each_step_applied(tmp_path):
    """Linear over 4 steps after 2 of warmup: 1/3, 2/3, 1, 1/2 of the rate, in the optimizer when it
    steps, in metrics.jsonl and in the checkpoint of the last step."""
    applied = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append(optimizer.param_groups[0]["lr"])
    )
    try:
        result = _run(tmp_path, "run", lr_scheduler="linear", warmup_steps=2, max_steps=4, save_steps=4)
    finally:
        hook.remove()
    expected = pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.5e-3], rel=1e-12)
    assert applied == expected
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == applied
    state = json.loads((result.output_dir / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["lr"] == applied[-1]


@pytest.mark.parametrize("warmup, noted", [(6, True), (4, True), (3, False)])
def test_a_warmup_as_long_as_the_run_is_a_note(tmp_path, warmup, noted):
    """As in Hugging Face, every step then warms up: the note says how high the rate gets, the last step's
    lr * 4 / (warmup + 1)."""
    config = load_config(write_run(tmp_path / "run", max_steps=4, warmup_steps=warmup, learning_rate=1e-3))
    note = (
        f"warmup_steps gives {warmup} warmup steps and the run has 4: every step warms up, and the learning "
        f"rate rises only to {1e-3 * 4 / (warmup + 1):.3g} of learning_rate 0.001"
    )
    notes = build_run(config).notes
    assert (note in notes) == noted
    assert noted or not any("warmup" in n for n in notes)


def test_resume_with_a_new_max_steps_or_learning_rate_says_how_the_schedule_changes(tmp_path, run_cli):
    path = write_run(tmp_path / "run", max_steps=4, save_steps=2, lr_scheduler="cosine", learning_rate=1e-3)
    assert run_cli("train", path)[0] == 0
    out = tmp_path / "run" / "out"
    code, _, err = run_cli("resume", out, "--checkpoint", out / "checkpoint-2")
    assert code == 0 and "schedule" not in err, err
    code, _, err = run_cli(
        "resume",
        out,
        "--checkpoint",
        out / "checkpoint-2",
        "--set",
        "max_steps=8",
        "--set",
        "learning_rate=2e-3",
    )
    saved = load_config(path)
    now = dataclasses.replace(saved, max_steps=8, learning_rate=2e-3)
    assert code == 0, err
    assert (
        "note: the learning-rate schedule changes: learning_rate 0.002 (was 0.001); the cosine decay now ends "
        f"at step 8 (was 4); step 3 trains at {learning_rate(now, 2, 8):.3g} (the saved schedule: "
        f"{learning_rate(saved, 2, 4):.3g})"
    ) in " ".join(err.split())


def test_resume_with_other_training_settings_says_so(tmp_path, run_cli):
    """LoRA dropout or the optimizer's settings changed at a resume change how the steps left train."""
    path = write_run(tmp_path / "run", max_steps=4, save_steps=2, lora_dropout=0.05)
    assert run_cli("train", path)[0] == 0
    out = tmp_path / "run" / "out"
    code, _, err = run_cli("resume", out, "--checkpoint", out / "checkpoint-2", "--set", "max_steps=4")
    assert code == 0 and "changed settings" not in err, err
    code, _, err = run_cli(
        "resume", out, "--checkpoint", out / "checkpoint-2", "--set", "lora_dropout=0.2",
        "--set", "weight_decay=0.01",
    )  # fmt: skip
    assert code == 0, err
    assert (
        "note: resumed with changed settings: lora_dropout 0.2 (was 0.05), weight_decay 0.01 (was 0.0); "
        "steps from 3 train with them"
    ) in " ".join(err.split())


@pytest.mark.parametrize("packing, rows", [(False, 48), (True, 48), (False, 10)], ids=str)
def test_resume_is_exact(tmp_path, packing, rows, one_thread):
    """N steps in one go equal N/2 steps, then `qlora resume` to N: the same losses and adapter, bit for
    bit; with 10 rows an epoch is 3 steps, the last of one micro-batch, and the resumed half crosses it."""
    common = dict(
        rows=rows,
        sample_packing=packing,
        gradient_accumulation_steps=2,
        lora_dropout=0.1,
        lr_scheduler="constant",
        warmup_steps=0,
    )
    whole = _run(tmp_path, "whole", max_steps=6, **common)
    half = _run(tmp_path, "half", max_steps=3, **common)
    # A fresh process: nothing of the first run survives but the checkpoint (dropout masks included:
    # they come from the run's seed and the micro-batch, not from state carried over).
    proc = _cli("resume", str(half.output_dir), "--set", "max_steps=6")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert _losses(half.output_dir) == _losses(whole.output_dir)
    adapter = "adapter_model.safetensors"
    assert (half.output_dir / adapter).read_bytes() == (whole.output_dir / adapter).read_bytes()


def test_a_tokenizer_past_the_models_vocab_size_is_one_line_before_training(tmp_path, run_cli, monkeypatch):
    """The demo's tokenizer (1,024 tokens) on a model of 160 embedding rows: every chat row ends its
    turns with <|im_end|>, id 1,023, which would stop the first forward in the embedding lookup
    (IndexError). Training and `qlora data` refuse before any weights load; generate refuses the prompt."""
    model = add_demo_tokenizer(write_qwen3(tmp_path / "run" / "model", vocab_size=160))
    config = write_run(tmp_path / "run", model_writer=lambda folder: model)
    past = (
        "past the model's vocab_size of 160 (config.json), while its tokenizer in "
        f"{model} has 1,024 tokens: the embedding has no row for that id; give the model the tokenizer "
        "it was trained with"
    )
    generated = run_cli("generate", config, "--base-only", "--prompt", "hi", "--device", "cpu")

    def loaded(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(QLoRAModel, "from_pretrained", loaded)
    for command, line in [
        (run_cli("train", config), f"error: the largest token id in the data is 1,023, {past}"),
        (run_cli("data", config), f"error: the largest token id in the data is 1,023, {past}"),
        (generated, f"error: --prompt 1: its token id 1,023, {past}"),
    ]:
        code, _, err = command
        lines = [text for text in err.splitlines() if text.strip()]
        assert code == 2 and lines == [line] and "Traceback" not in err, err


def test_a_pad_token_past_the_models_vocab_size_is_refused_though_the_data_fits(tmp_path):
    """Plain segments (input_output adds no token) tokenize below id 1,021 of the demo's tokenizer; a model
    of 1,022 rows holds them, but not the pad token the config picks, <|im_start|> (1,022)."""
    data = tmp_path / "segments.jsonl"
    data.write_text(
        json.dumps({"segments": [{"text": "The capital of Peru is Lima.", "label": True}]}) + "\n"
    )
    config = load_config(
        write_run(
            tmp_path / "run",
            model_writer=lambda folder: add_demo_tokenizer(write_qwen3(folder, vocab_size=1022)),
            datasets=[{"path": str(data), "type": "input_output"}],
            special_tokens={"pad_token": "<|im_start|>"},
        )
    )
    with pytest.raises(
        QLoraError,
        match=r"^the pad_token '<\|im_start\|>' is token id 1,022, past the model's vocab_size of 1,022 ",
    ):
        build_run(config)


def test_resume_refuses_a_changed_lora_shape(tmp_path):
    result = _run(tmp_path, "run", max_steps=2)
    with pytest.raises(QLoraError, match="'lora_r' changed from 4 to 8"):
        resume(result.output_dir, overrides=["lora_r=8"])


def test_resume_refuses_a_changed_data_file_unless_accepted(tmp_path, run_cli):
    """The checkpoint records each local data file's size and hash; a touched file that reads the same
    resumes, a changed one is refused in one line, and --accept-changed-data continues with a note."""
    result = _run(tmp_path, "run", max_steps=2)
    data = (tmp_path / "run" / "train.jsonl").resolve()
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    assert state["data_files"] == [{"path": str(data), "size": data.stat().st_size, "sha256": digest}]
    os.utime(data, (1, 1))
    code, _, err = run_cli("resume", result.output_dir, "--set", "max_steps=3")
    assert code == 0, err
    rows = data.read_text().splitlines(keepends=True)
    data.write_text("".join([rows[1], rows[0], *rows[2:]]))  # the same size, other bytes
    line = error_line(run_cli("resume", result.output_dir, "--set", "max_steps=4"))
    assert line == (
        f"error: cannot resume {result.output_dir / 'checkpoint-3'}: {data} changed since the checkpoint was "
        "written; step 3 continues at micro-batch 3 of epoch 0 of the changed data, so rows of this epoch "
        f"may be skipped or seen twice; continue anyway with `qlora resume {result.output_dir} "
        "--set max_steps=4 --accept-changed-data`"
    )
    code, _, err = run_cli(*suggested(line))
    assert code == 0, err
    assert read_trainer_state(result.output_dir / "checkpoint-4").step == 4
    assert (
        f"note: {data} changed since {result.output_dir / 'checkpoint-3'} (--accept-changed-data)"
        in " ".join(err.split())
    )


def error_line(result) -> str:
    """The one line a refused command prints, checked to be all it printed, with exit code 2."""
    code, _, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_resume_follows_a_data_file_that_moved_with_the_same_bytes(tmp_path, run_cli, monkeypatch):
    """The same bytes at a new path are the same rows: resume reads them there with a note that the file
    moved, and later checkpoints name the new path. Other bytes there are refused, and the command the
    refusal suggests runs as written."""
    result = _run(tmp_path, "run", max_steps=2)
    out = result.output_dir
    data = (tmp_path / "run" / "train.jsonl").resolve()
    moved = data.with_name("moved.jsonl")
    data.rename(moved)
    monkeypatch.chdir(data.parent)
    code, _, err = run_cli("resume", out, "--set", "datasets.0.path=moved.jsonl", "--set", "max_steps=3")
    assert code == 0, err
    assert (
        f"note: data file {data} moved to {moved} since {out / 'checkpoint-2'}: the same bytes, so the same rows"
        in " ".join(err.split())
    )
    assert "--accept-changed-data" not in err
    assert read_checkpoint_config(out / "checkpoint-3").datasets[0].path == str(moved)
    rows = moved.read_text().splitlines(keepends=True)
    other = data.with_name("other.jsonl")
    other.write_text("".join([rows[1], rows[0], *rows[2:]]))
    line = error_line(run_cli("resume", out, "--set", "datasets.0.path=other.jsonl", "--set", "max_steps=4"))
    assert line.startswith(
        f"error: cannot resume {out / 'checkpoint-3'}: {moved} is no longer read (and 1 other file) since the "
        "checkpoint was written;"
    )
    command = suggested(line)
    assert command == [
        *("resume", str(out), "--set", "datasets.0.path=other.jsonl", "--set", "max_steps=4"),
        "--accept-changed-data",
    ]
    code, _, err = run_cli(*command)
    assert code == 0, err
    assert read_checkpoint_config(out / "checkpoint-4").datasets[0].path == str(other)


def test_resume_refuses_a_file_added_to_or_removed_from_a_dataset_folder(tmp_path, run_cli):
    """A dataset folder reads every data file in it: one added since the checkpoint, or one gone, moves the
    rows under the data cursor as much as a file changed in place, and is named as added or gone."""
    folder = (tmp_path / "run" / "data").resolve()
    path = write_run(tmp_path / "run", max_steps=2, datasets=[{"path": str(folder), "type": "chat_template"}])
    rows = (tmp_path / "run" / "train.jsonl").read_text().splitlines(keepends=True)
    folder.mkdir()
    (folder / "first.jsonl").write_text("".join(rows[:24]))
    (folder / "second.jsonl").write_text("".join(rows[24:40]))
    assert run_cli("train", path)[0] == 0
    out = tmp_path / "run" / "out"
    refused = f"error: cannot resume {out / 'checkpoint-2'}: "
    (folder / "third.jsonl").write_text("".join(rows[40:]))
    line = error_line(run_cli("resume", out, "--set", "max_steps=3"))
    assert line.startswith(f"{refused}{folder / 'third.jsonl'} was added since the checkpoint was written;")
    (folder / "third.jsonl").unlink()
    (folder / "second.jsonl").unlink()
    line = error_line(run_cli("resume", out, "--set", "max_steps=3"))
    assert line.startswith(
        f"{refused}{folder / 'second.jsonl'} is no longer read since the checkpoint was written;"
    )


def test_a_dataset_that_moved_is_asked_for_by_its_key(tmp_path, run_cli):
    result = _run(tmp_path, "run", max_steps=2)
    data = (tmp_path / "run" / "train.jsonl").resolve()
    data.rename(data.with_name("moved.jsonl"))
    assert error_line(run_cli("resume", result.output_dir)) == (
        f"error: cannot resume {result.output_dir / 'checkpoint-2'}: its dataset datasets.0, {data}, does not "
        "exist; if it moved, give its new place with --set datasets.0.path=NEW_PATH"
    )


def test_train_resuming_its_checkpoint_suggests_itself_with_accept_changed_data(tmp_path, run_cli):
    """`qlora train` with auto_resume_from_checkpoints continues under its own config: the command it
    suggests for changed data is itself, and runs."""
    path = write_run(tmp_path / "run", max_steps=2, auto_resume_from_checkpoints=True)
    assert run_cli("train", path)[0] == 0
    data = tmp_path / "run" / "train.jsonl"
    rows = data.read_text().splitlines(keepends=True)
    data.write_text("".join([rows[1], rows[0], *rows[2:]]))
    line = error_line(run_cli("train", path, "--set", "max_steps=3"))
    command = suggested(line)
    assert command == ["train", str(path), "--set", "max_steps=3", "--accept-changed-data"]
    code, _, err = run_cli(*command)
    assert code == 0, err
    assert read_trainer_state(tmp_path / "run" / "out" / "checkpoint-3").step == 3


def test_resume_refuses_a_key_that_changes_the_batch_plan_unless_accepted(tmp_path, run_cli):
    """Each of these keys makes another batch plan, in which the checkpoint's step would continue among
    other rows: refused in one line naming the key and both values, before the run's folder is touched;
    the same value is no change, and accepted, a note says the remaining steps draw a new plan."""
    result = _run(tmp_path, "run", max_steps=2)
    out, checkpoint = result.output_dir, result.output_dir / "checkpoint-2"
    files = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    for change, old, new in [
        ("seed=7", "3", "7"),
        ("sample_packing=true", "False", "True"),
        ("micro_batch_size=4", "2", "4"),
        ("val_set_size=0.2", "0.0", "0.2"),
        ("sequence_len=64", "128", "64"),
        ("gradient_accumulation_steps=2", "1", "2"),
        ("train_on_inputs=true", "False", "True"),
        ("datasets.0.split=train[:50%]", "'train'", "'train[:50%]'"),
    ]:
        key = change.split("=")[0]
        line = error_line(run_cli("resume", out, "--set", change, "--set", "max_steps=3"))
        again = shlex.join(
            ["resume", str(out), "--set", change, "--set", "max_steps=3", "--accept-changed-data"]
        )
        assert line == (
            f"error: cannot resume {checkpoint}: '{key}' changed from {old} to {new}, which changes the batch "
            "plan the checkpoint's step 2 places the run in (at micro-batch 2 of epoch 0), so the remaining "
            "steps would skip or repeat rows of this epoch; keep the checkpoint's value, or continue on the "
            f"new batch plan with `qlora {again}`"
        )
    line = error_line(run_cli("resume", out, "--set", f"output_dir={tmp_path / 'elsewhere'}"))
    assert line.startswith(f"error: resume trains on in the folder it resumes, {out}, so --set output_dir")
    line = error_line(run_cli("resume", out, "--set", "seed=7", "--set", "micro_batch_size=4"))
    assert "'seed' changed from 3 to 7, 'micro_batch_size' changed from 2 to 4, which" in line
    assert "keep the checkpoint's values" in line
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == files
    code, _, err = run_cli("resume", out, "--set", "seed=3", "--set", "max_steps=3")
    assert code == 0 and "batch plan" not in err, err
    line = error_line(run_cli("resume", out, "--set", "seed=7", "--set", "max_steps=4"))
    code, _, err = run_cli(*suggested(line))
    assert code == 0, err
    assert (
        "note: 'seed' changed from 3 to 7 (--accept-changed-data): the remaining steps, from step 4, draw a "
        "new batch plan, from its micro-batch 3 of epoch 0, so rows of this epoch may be skipped or seen twice"
    ) in " ".join(err.split())
    assert read_checkpoint_config(out / "checkpoint-4").seed == 7


def test_resume_chooses_a_given_checkpoint(tmp_path):
    result = _run(tmp_path, "run", max_steps=4, save_steps=2)
    resumed = resume(result.output_dir, checkpoint=result.output_dir / "checkpoint-2")
    assert resumed.step == 4
    assert [s for s, _ in _losses(result.output_dir)] == [1, 2, 3, 4]


def test_resume_of_a_finished_run_trains_nothing_and_says_so(tmp_path, run_cli):
    """A run's last checkpoint leaves no step to train: said in a note and the done line, the adapter
    kept; one past a shortened run (max_steps lowered) is refused, the folder untouched."""
    result = _run(tmp_path, "run", max_steps=2)
    out = result.output_dir
    adapter = (out / "adapter_model.safetensors").read_bytes()
    code, stdout, err = run_cli("resume", out)
    assert code == 0, err
    text = " ".join((stdout + err).split())
    assert (
        f"note: {out / 'checkpoint-2'} is this run's last step (2 of 2): nothing left to train; to train "
        "further, raise num_epochs or max_steps with --set"
    ) in text
    assert f"done: nothing left to train at step 2, adapter in {out}" in text
    assert (out / "adapter_model.safetensors").read_bytes() == adapter
    files = {
        path: path.read_bytes() for path in out.rglob("*") if path.is_file() and path.name != "train.log"
    }
    assert error_line(run_cli("resume", out, "--set", "max_steps=1")) == (
        f"error: {out / 'checkpoint-2'} is at step 2, past this run's 1 step: its adapter is that of a longer "
        "run; to train further, raise num_epochs or max_steps with --set"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "train.log"} == files
    assert run_cli("resume", out, "--set", "max_steps=3")[0] == 0
    assert [step for step, _ in _losses(out)] == [1, 2, 3]


def test_resume_reads_an_older_checkpoint_that_holds_rng_state(tmp_path):
    """Checkpoints written before training stopped saving RNG state carry an "rng" entry; resume ignores it."""
    result = _run(tmp_path, "run", max_steps=4, save_steps=2)
    state_file = result.output_dir / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert "rng" not in state
    state["rng"] = [{"cpu": [0] * 8}]
    state_file.write_text(json.dumps(state))
    as_written_before_manifests(state_file.parent)  # those checkpoints had no manifest either
    assert resume(result.output_dir, checkpoint=result.output_dir / "checkpoint-2").step == 4


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    path = write_run(tmp_path / "run", max_steps=8, save_steps=1, learning_rate=1e30, max_grad_norm=0)
    with pytest.raises(
        TrainingStopped, match=r"loss is (nan|inf) at step \d+; the run stopped; last good checkpoint"
    ):
        train(load_config(path))
    assert latest_checkpoint(tmp_path / "run" / "out") is not None


@pytest.mark.parametrize("checkpointing", ["auto", False])
def test_a_plan_over_the_memory_budget_is_a_note_saying_what_to_change(tmp_path, checkpointing):
    """Every layer recomputed and still over: only a smaller micro-batch helps; none recomputed: that first."""
    folder = tmp_path / "run"
    config = load_config(write_run(folder, memory_budget_gb=0.001, gradient_checkpointing=checkpointing))
    layers = json.loads((folder / "model" / "config.json").read_text())["num_hidden_layers"]
    advice = "lower micro_batch_size or sequence_len"
    if checkpointing is False:
        advice = f"set gradient_checkpointing: true (0 of {layers} layers recompute), or {advice}"
    notes = [note for note in build_run(config).notes if note.startswith("memory:")]
    pattern = r"memory: the planner puts this run's peak at ([\d.e-]+) GiB, over memory_budget_gb 0.001; "
    pattern += re.escape(f"it may run out of GPU memory: {advice} (")
    pattern += r"even a micro-batch of one token comes to ([\d.e-]+) GiB\)"
    match = re.fullmatch(pattern, notes[0])
    assert len(notes) == 1 and match, notes
    assert float(match.group(1)) > float(match.group(2)) > 0.001
    roomy = load_config(
        write_run(tmp_path / "roomy", memory_budget_gb=1000, gradient_checkpointing=checkpointing)
    )
    assert not any(note.startswith("memory:") for note in build_run(roomy).notes)


@pytest.mark.parametrize("offloading", [True, False], ids=["offloading", "no-offloading"])
def test_a_plan_over_the_memory_budget_names_the_longest_micro_batch_that_fits(tmp_path, offloading):
    """A budget just above the planner's peak for 128-token micro-batches with every layer recomputed
    (the run asks for 256 and recomputes none): the note names 128 tokens, the most that fit, counted
    with the offloading that recomputing would bring (here none recomputes, so none is offloaded yet)."""
    folder = tmp_path / "run"

    def six_layers(model: Path) -> Path:
        # Offloading trades each recomputed layer's kept input for two buffers: with two layers that
        # would cost the same, so the count could not tell whether offloading was counted.
        return add_demo_tokenizer(write_qwen3(model, vocab_size=1024, num_hidden_layers=6))

    config = load_config(
        write_run(
            folder, model_writer=six_layers, gradient_checkpointing=False, activation_offloading=offloading
        )
    )
    spec = read_spec(folder / "model")

    def recomputed_peak(tokens: int) -> int:
        shape = RunShape(tokens, lora_config(config))
        return estimated_peak_bytes(spec, shape, spec.num_layers, offload=offloading)

    assert config.micro_batch_size * config.sequence_len == 256
    budget = (recomputed_peak(128) + recomputed_peak(129)) / 2 / 2**30
    notes = build_run(dataclasses.replace(config, memory_budget_gb=budget)).notes
    [note] = [note for note in notes if note.startswith("memory:")]
    assert note.endswith("(with every layer recomputed, micro-batches of up to 128 tokens fit)"), note


def _train_running_out(run_cli, path: Path, fails) -> tuple[int, list[str]]:
    """`qlora train path` with an allocation failing inside each DecoderLayer for which `fails(layer)`
    says so, raised where the GPU's allocator raises it; the exit code and the error lines."""

    def allocation_fails(module, args):
        if type(module).__name__ == "DecoderLayer" and fails(module):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = torch.nn.modules.module.register_module_forward_pre_hook(allocation_fails)
    try:
        code, out, err = run_cli("train", path)
    finally:
        hook.remove()
    assert "Traceback" not in out + err
    return code, [line for line in (out + err).splitlines() if line.startswith("error:")]


def test_running_out_of_gpu_memory_is_one_line_and_keeps_the_last_checkpoint(tmp_path, run_cli):
    """An allocation that fails in step 3's forward ends the run in one line saying what to change, with
    exit code 1 and checkpoint 2 kept."""
    path = write_run(tmp_path / "run", max_steps=6, save_steps=2)
    layers = json.loads((tmp_path / "run" / "model" / "config.json").read_text())["num_hidden_layers"]
    calls = []
    code, lines = _train_running_out(
        run_cli, path, lambda layer: calls.append(layer) or len(calls) == 2 * layers + 1
    )
    assert code == 1
    assert lines == [
        "error: out of GPU memory in step 3 (2 x 128 tokens a micro-batch): set gradient_checkpointing: "
        f"true (0 of {layers} layers recompute), or lower micro_batch_size or sequence_len; the run "
        f"stopped; last good checkpoint: {tmp_path / 'run' / 'out' / 'checkpoint-2'}"
    ]
    assert latest_checkpoint(tmp_path / "run" / "out") == tmp_path / "run" / "out" / "checkpoint-2"


def test_running_out_of_gpu_memory_evaluating_is_one_line_too(tmp_path, run_cli):
    """The evaluation after step 4 fails to allocate (in eval mode): one line naming it, exit code 1,
    checkpoint 2 named and kept."""
    path = write_run(tmp_path / "run", max_steps=6, save_steps=2, val_set_size=0.1, eval_steps=4)
    code, lines = _train_running_out(run_cli, path, lambda layer: not layer.training)
    checkpoint = tmp_path / "run" / "out" / "checkpoint-2"
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: out of GPU memory evaluating after step 4 (2 x 128 ")
    assert lines[0].endswith(f"; the run stopped; last good checkpoint: {checkpoint}")
    assert latest_checkpoint(tmp_path / "run" / "out") == checkpoint


def _cli(*args, env_extra=None):
    env = subprocess_env(**(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "qlora_cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(output_dir: Path, step: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(r[0] >= step for r in _losses(output_dir)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("training did not reach the step in time")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path, signum, one_thread):
    settings = dict(max_steps=40, logging_steps=1, lora_dropout=0.1, sample_packing=True)
    whole = _run(tmp_path, "whole", **settings)
    path = write_run(tmp_path / "stopped", **settings)
    out = tmp_path / "stopped" / "out"
    proc = _cli("train", str(path))
    _wait_for_step(out, 2, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum
    assert f"{signal.Signals(signum).name} received" in stderr and "Traceback" not in stderr
    stopped_at = latest_checkpoint(out)
    assert stopped_at is not None and int(stopped_at.name.split("-")[1]) < 40
    resumed = resume(out)
    assert _losses(resumed.output_dir) == _losses(whole.output_dir)


KILL_DURING_SAVE = """
import os, sys, time
from qlora_cli.rundir import checkpoint
real = checkpoint.save_tensors
def slow(tensors, path, *a, **k):
    real(tensors, path, *a, **k)
    if "-4-" in path.parent.name:
        open(os.environ["QLORA_TEST_MARKER"], "w").close()
        time.sleep(60)
checkpoint.save_tensors = slow
sys.argv = ["qlora", "train", sys.argv[1]]
from qlora_cli.cli import main
main()
"""


def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path):
    path = write_run(tmp_path / "run", max_steps=6, save_steps=2)
    out = tmp_path / "run" / "out"
    marker = tmp_path / "saving"
    script = tmp_path / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    env = subprocess_env(QLORA_TEST_MARKER=str(marker))
    proc = subprocess.Popen([sys.executable, str(script), str(path)], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert any(p.name.startswith(".tmp-checkpoint-4") for p in out.iterdir())
    assert latest_checkpoint(out).name == "checkpoint-2"
    resumed = resume(out)
    assert resumed.step == 6
    assert not any(p.name.startswith(".tmp-checkpoint") for p in out.iterdir())
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4, 5, 6]


def test_trains_from_a_hub_model_and_a_hub_dataset(tmp_path, monkeypatch):
    """base_model and the dataset as repo ids: downloaded through huggingface_hub from a local fake hub."""
    from fake_hub import FakeHub, FakeRepo, use_fake_hub

    local = write_run(tmp_path / "local")
    model_files = {p.name: p.read_bytes() for p in (tmp_path / "local" / "model").iterdir()}
    data = {"data/train.jsonl": (tmp_path / "local" / "train.jsonl").read_bytes()}
    repos = {
        "org/tiny-qwen3": FakeRepo({"main": model_files}),
        "org/chats": FakeRepo({"main": data}, "dataset"),
    }
    with FakeHub(repos) as hub:
        use_fake_hub(monkeypatch, hub, tmp_path / "hf_home")
        config = load_config(
            local,
            [
                "base_model=org/tiny-qwen3",
                "datasets.0.path=org/chats",
                f"output_dir={tmp_path / 'out'}",
                "max_steps=2",
            ],
        )
        result = train(config)
        assert hub.fetched_files("org/tiny-qwen3") == set(model_files)
        assert hub.fetched_files("org/chats") == set(data)
    assert result.step == 2 and (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_a_resumed_run_reads_the_hub_dataset_at_the_commit_it_started_with(tmp_path, monkeypatch):
    """A push to the dataset repo after the run started does not change what the run trains on: the
    saved config pins the commit (here the new commit's file would not even parse)."""
    from fake_hub import FakeHub, FakeRepo, use_fake_hub

    local = write_run(tmp_path / "local")
    data = {"data/train.jsonl": (tmp_path / "local" / "train.jsonl").read_bytes()}
    with FakeHub({"org/chats": FakeRepo({"main": data}, "dataset")}) as hub:
        use_fake_hub(monkeypatch, hub, tmp_path / "hf_home")
        out = tmp_path / "out"
        config = load_config(local, ["datasets.0.path=org/chats", f"output_dir={out}", "max_steps=2"])
        train(config)
        started_at = hub.commit("org/chats")
        assert read_checkpoint_config(out / "checkpoint-2").datasets[0].revision == started_at
        hub.push("org/chats", {"data/train.jsonl": b"{not json"})
        assert resume(out, overrides=["max_steps=4"]).step == 4
        assert read_checkpoint_config(out / "checkpoint-4").datasets[0].revision == started_at
        with pytest.raises(QLoraError, match="train.jsonl"):
            train(load_config(local, ["datasets.0.path=org/chats", f"output_dir={tmp_path / 'new'}"]))
