"""LoRA dropout in training: masks drawn from a seed per micro-batch, repeated by every recompute,
and read on the device, so a CUDA graph replays a new mask each micro-batch."""

from dataclasses import replace

import pytest
import torch
from checkpoints import QWEN25_7B, write_run

import qlora_cli.model.lora as lora_module
from qlora_cli.config.loading import load_config
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.train.graphs import GraphedLoss
from qlora_cli.train.loop import train
from qlora_cli.train.run import build_run
from qlora_cli.train.step import dropout_seed, train_step

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_seeds_differ_between_micro_batches_and_runs():
    """Run seeds that agree in their low 31 or 32 bits still draw other masks."""
    run_seeds = (0, 3, -1, 2**31, 3 + 2**31, 2**32, 2**32 - 1, 2**40)
    seeds = {dropout_seed(run_seed, index) for run_seed in run_seeds for index in range(50)}
    assert len(seeds) == 50 * len(run_seeds)
    assert all(-(2**63) <= seed < 2**63 for seed in seeds)
    torch.tensor(sorted(seeds), dtype=torch.int64)  # every seed fits the seed tensor


def test_dropout_seed_moves_with_the_model_and_stays_out_of_its_state():
    """A buffer, so `to()` moves it; not persistent, so no state dict or checkpoint holds it."""
    spec = replace(
        QWEN25_7B,
        num_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    model = QLoRAModel.on_device(spec, LoRAConfig(r=2, alpha=4), "cpu")
    assert model.dropout_seed.item() == 0
    model.set_dropout_seed(dropout_seed(7, 1))
    assert model.dropout_seed.item() == dropout_seed(7, 1)
    assert "dropout_seed" not in model.state_dict()
    model.to("meta")
    assert model.dropout_seed.is_meta


def test_masks_differ_between_micro_batches_and_recompute_repeats_them(tmp_path, monkeypatch, reference_ops):
    """Two optimizer steps of two micro-batches each, every layer recomputed in backward: each call
    site draws four different masks, and its recompute draws its forward's mask again."""
    config = load_config(
        write_run(
            tmp_path,
            lora_dropout=0.3,
            sample_packing=True,
            gradient_accumulation_steps=2,
            gradient_checkpointing=True,
        )
    )
    run = build_run(config)
    drawn: dict[tuple[int, int], list[torch.Tensor]] = {}
    real = lora_module.seeded_dropout

    def recording(x, p, seed, salt, offset=0):
        out = real(x, p, seed, salt, offset)
        drawn.setdefault((int(seed), salt), []).append((out == 0).flatten().clone())
        return out

    monkeypatch.setattr(lora_module, "seeded_dropout", recording)
    for step in range(2):
        train_step(run, step)
        run.optimizer.zero_grad()
    seeds = {seed for seed, _ in drawn}
    salts = {salt for _, salt in drawn}
    assert len(seeds) == 4 and len(salts) == 4 * len(run.model.layers)
    for masks in drawn.values():
        assert len(masks) == 2  # forward, then the recompute in backward
        assert torch.equal(masks[0], masks[1])
        assert 0.2 < masks[0].float().mean() < 0.4
    for salt in salts:
        per_seed = [drawn[(seed, salt)][0] for seed in sorted(seeds)]
        assert all(not torch.equal(a, b) for i, a in enumerate(per_seed) for b in per_seed[i + 1 :])


def test_an_evaluation_leaves_the_model_training_so_the_next_steps_draw_masks(
    tmp_path, monkeypatch, reference_ops
):
    """An evaluation after every step: it draws no mask itself, the model is back in train mode after
    it, and each of the three steps draws its micro-batch's mask at every call site."""
    import qlora_cli.train.loop as loop_module

    config = load_config(write_run(tmp_path, lora_dropout=0.3, val_set_size=8, eval_steps=1, max_steps=3))
    drawn: list[int] = []
    after_eval: list[bool] = []
    real_dropout, real_evaluate = lora_module.seeded_dropout, loop_module.evaluate

    def recording(x, p, seed, salt, offset=0):
        drawn.append(int(seed))
        return real_dropout(x, p, seed, salt, offset)

    def evaluate(run):
        before = len(drawn)
        result = real_evaluate(run)
        assert len(drawn) == before
        after_eval.append(run.model.training)
        return result

    monkeypatch.setattr(lora_module, "seeded_dropout", recording)
    monkeypatch.setattr(loop_module, "evaluate", evaluate)
    assert train(config).step == 3
    assert after_eval == [True, True, True]
    sites = len(drawn) // 3
    assert sites > 0 and drawn == [seed for i in range(3) for seed in [dropout_seed(config.seed, i)] * sites]


def test_training_with_dropout_keeps_cuda_graphs_on_the_table(tmp_path):
    from qlora_cli.train.graphs import cuda_graph_blocker

    config = load_config(write_run(tmp_path, lora_dropout=0.05, sample_packing=True))
    assert cuda_graph_blocker(config, CUDA, 1) is None


@pytest.mark.gpu
@needs_cuda
def test_a_replayed_graph_draws_the_mask_of_the_seed_it_finds(deterministic_algorithms):
    """The same micro-batch replayed under two seeds: other gradients; under the first seed again:
    the first gradients, bit for bit, and those of an eager call with that seed."""
    from test_gpu_step import _batch, _model

    model = _model(torch.bfloat16)
    for layer in model.layers:
        for group in layer.projections.values():
            group.dropout = 0.1
    model.checkpoint_layers = len(model.layers)
    params = model.trainable_parameters()
    batch = _batch()
    graphed = GraphedLoss(model.loss, CUDA, model.spec.vocab_size)

    def grads(seed, call):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        model.set_dropout_seed(seed)
        call(batch)
        return [p.grad.clone() for p in params]

    def eager(b):
        loss_sum, _ = model.loss(*b)
        (loss_sum * 1e-3).backward()

    def replay(b):
        graphed(b, 1, 1e-3)

    grads(1, replay)  # the eager first call
    grads(1, replay)  # the capture
    first = grads(1, replay)
    second = grads(2, replay)
    again = grads(1, replay)
    reference = grads(1, eager)
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))
    for a, b, c in zip(first, again, reference, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-7)
