"""CUDA graphs: when a run can replay them, and that a replay trains exactly as eager calls do."""

import functools
import json
from pathlib import Path

import pytest
import torch
from checkpoints import write_qwen3_5_moe, write_run

import qlora_cli.model.lora as model_module
from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import OutOfMemory
from qlora_cli.data.examples import BatchPlan
from qlora_cli.model.layers import layer_groups
from qlora_cli.rundir.names import LOG_FILE
from qlora_cli.sources.spec import FULL_ATTENTION
from qlora_cli.train.graphs import GraphedLoss, cuda_graph_blocker
from qlora_cli.train.loop import train
from qlora_cli.train.run import build_run
from qlora_cli.train.step import dropout_seed

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# The demo rows a run of these tests takes: at 128 tokens they pack into 14 rows, so micro-batches
# of 3 leave a short last one (the asserts below check that this still holds).
SHORT_LAST_BATCH_ROWS = 47


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="need a CUDA device"):
        GraphedLoss(lambda *inputs: None, torch.device("cpu"), vocab_size=8)


@pytest.mark.parametrize(
    "device, world_size, settings, reason",
    [
        (torch.device("cpu"), 1, {}, "need a CUDA device"),
        (CUDA, 2, {}, "DDP's hooks"),
        (CUDA, 1, {"sample_packing": False}, "width changes"),
        (CUDA, 1, {"lora_dropout": 0.1}, None),
        (CUDA, 1, {}, None),
    ],
    ids=["cpu", "two-processes", "no-packing", "dropout-replayable", "replayable"],
)
def test_what_blocks_cuda_graphs(tmp_path, device, world_size, settings, reason):
    config = load_config(write_run(tmp_path, **{"sample_packing": True, **settings}))
    blocker = cuda_graph_blocker(config, device, world_size)
    if reason is None:
        assert blocker is None
    else:
        assert reason in blocker


def _records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _micro_batch(seed: int, vocab: int, tokens: int = 1024):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, tokens), generator=generator)
    labels = ids.roll(-1, dims=1)
    labels[:, : tokens // 4] = -100
    positions = torch.arange(tokens).repeat(2, 1)
    doc_ids = torch.zeros(2, tokens, dtype=torch.int32)
    doc_ids[:, tokens // 2 :] = 1
    positions[:, tokens // 2 :] -= tokens // 2
    return ids, labels, positions, doc_ids


@pytest.mark.gpu
@needs_cuda
def test_replayed_micro_batches_accumulate_what_eager_ones_do(deterministic_algorithms):
    """Qwen2.5-7B layers, recomputed in backward: two steps of 2 and 1 micro-batches, eager and graphed.

    The graphed sequence covers its three kinds of call: eager, capture and replay, replay.
    Deterministic algorithms make both sum in the same order, so they can agree to fp32 rounding.
    """
    from test_gpu_step import _model

    model = _model(torch.bfloat16)
    model.checkpoint_layers = len(model.layers)
    vocab = model.spec.vocab_size
    steps = [[_micro_batch(0, vocab), _micro_batch(1, vocab)], [_micro_batch(2, vocab)]]
    params = model.trainable_parameters()

    def run(call):
        results = []
        for batches in steps:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
            losses = [float(call(batch, 1 / 3000)) for batch in batches]
            results.append((losses, [p.grad.clone() for p in params]))
        return results

    def eager(batch, scale):
        loss_sum, _ = model.loss(*(t.to(CUDA) for t in batch))
        (loss_sum * scale).backward()
        return loss_sum.detach()

    graphed = GraphedLoss(model.loss, CUDA, vocab)
    expected = run(eager)
    got = run(lambda batch, scale: graphed(batch, 1, scale))
    assert graphed.graph is not None and graphed.calls == 3
    for (eager_losses, eager_grads), (graph_losses, graph_grads) in zip(expected, got, strict=True):
        assert graph_losses == pytest.approx(eager_losses, rel=1e-6)
        for a, b in zip(eager_grads, graph_grads, strict=True):
            assert a.abs().sum() > 0
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


# A Qwen3.5 MoE that trains with the load-balancing loss (config.json's output_router_logits).
BALANCED_MOE = functools.partial(write_qwen3_5_moe, output_router_logits=True, router_aux_loss_coef=0.5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("lora_dropout", "model_writer"),
    [(0.0, None), (0.1, None), (0.0, write_qwen3_5_moe), (0.0, BALANCED_MOE)],
    ids=["qwen3", "qwen3-dropout", "qwen3_5_moe", "qwen3_5_moe-aux_loss"],
)
def test_train_with_graphs_follows_the_eager_run(
    tmp_path, lora_dropout, model_writer, deterministic_algorithms
):
    """Packed rows with an epoch's short last micro-batch (padded for the graph), accumulation and
    recompute, with and without LoRA dropout, and on a mixture of experts (its routing read on the
    device alone), with its load-balancing loss too: cuda_graphs auto on the GPU gives the losses,
    aux losses (the rows the graph pads with counted in none) and gradient norms of cuda_graphs false
    (dropout masks come from the step's seeds either way).

    Deterministic algorithms: SwiGLU's backward otherwise adds LoRA's t gradient with fp32 atomics,
    whose order changes from run to run; eight AdamW steps grow that last-bit noise past the bound
    in some runs and not in others. With fixed-order sums two runs differ only where the graph's
    padded micro-batch sums over more rows, the same way every time."""
    settings = dict(
        lora_dropout=lora_dropout,
        device="cuda",
        sample_packing=True,
        micro_batch_size=3,
        gradient_accumulation_steps=2,
        gradient_checkpointing=True,
        max_steps=8,
    )
    graphed_config = load_config(
        write_run(tmp_path / "graphs", SHORT_LAST_BATCH_ROWS, model_writer, **settings)
    )
    plan = build_run(graphed_config).train_plan
    assert len(plan.batch_rows(0, plan.num_batches - 1)) < 3 and plan.num_batches < 16
    graphed = train(graphed_config)
    eager = train(
        load_config(
            write_run(tmp_path / "eager", SHORT_LAST_BATCH_ROWS, model_writer, cuda_graphs=False, **settings)
        )
    )
    got, expected = _records(graphed.output_dir), _records(eager.output_dir)
    assert [r["step"] for r in got] == list(range(1, 9))
    curves = [
        (a["loss"], b["loss"], a["grad_norm"], b["grad_norm"]) for a, b in zip(expected, got, strict=True)
    ]
    for eager_loss, graph_loss, eager_norm, graph_norm in curves:
        assert graph_loss == pytest.approx(eager_loss, rel=1e-5), curves
        assert graph_norm == pytest.approx(eager_norm, rel=1e-4), curves
    aux = [(a.get("aux_loss"), b.get("aux_loss")) for a, b in zip(expected, got, strict=True)]
    assert all((a is None) == (model_writer is not BALANCED_MOE) for a, _ in aux)
    for eager_aux, graph_aux in aux:
        assert graph_aux == pytest.approx(eager_aux, rel=1e-5), aux


def test_a_padded_batch_trains_as_the_short_one(tmp_path, reference_ops):
    """The rows a graph's fixed shape adds carry no trained token and change no loss."""
    config = write_run(tmp_path, rows=SHORT_LAST_BATCH_ROWS, sample_packing=True, micro_batch_size=3)
    run = build_run(load_config(config))
    plan: BatchPlan = run.train_plan
    short = plan.batch(0, plan.num_batches - 1)
    rows = short.input_ids.shape[0]
    assert rows < 3
    padded = short.padded_to(3)
    assert padded.input_ids.shape == (3, short.input_ids.shape[1]) and padded.n_tokens == short.n_tokens
    assert torch.equal(padded.input_ids[:rows], short.input_ids)
    assert (padded.labels[rows:] == -100).all() and padded.doc_ids.dtype == short.doc_ids.dtype
    assert short.padded_to(rows) is short
    with torch.no_grad():
        losses = [run.model.loss(b.input_ids, b.labels, b.position_ids, b.doc_ids) for b in (short, padded)]
    assert float(losses[1][0]) == pytest.approx(float(losses[0][0]), rel=1e-6)
    assert int(losses[1][1]) == int(losses[0][1]) == short.n_tokens


def test_a_padded_batch_draws_the_short_ones_dropout_masks(tmp_path, monkeypatch, reference_ops):
    """With LoRA dropout, the rows a graph's fixed shape adds (padded_to, as train_step pads for a
    graph) leave every real token's masks as they were: each call site, in forward and in the
    recompute in backward, drops the same elements of the real rows, so loss and gradients agree.
    An element's mask is hashed from its flat index, which rows appended after the real ones do
    not move."""
    settings = dict(sample_packing=True, micro_batch_size=3, lora_dropout=0.3, gradient_checkpointing=True)
    config = load_config(write_run(tmp_path, rows=SHORT_LAST_BATCH_ROWS, **settings))
    run = build_run(config)
    plan: BatchPlan = run.train_plan
    short = plan.batch(0, plan.num_batches - 1)
    rows = short.input_ids.shape[0]
    padded = short.padded_to(3)
    assert rows < 3 and padded.input_ids.shape[0] == 3
    real = model_module.seeded_dropout
    drawn: list[list[tuple[int, torch.Tensor]]] = []

    def recording(x, p, seed, salt, offset=0):
        out = real(x, p, seed, salt, offset)
        drawn[-1].append((salt, out == 0))
        return out

    monkeypatch.setattr(model_module, "seeded_dropout", recording)
    params = run.model.trainable_parameters()
    results = []
    for batch in (short, padded):
        drawn.append([])
        for p in params:
            p.grad = None
        run.model.set_dropout_seed(dropout_seed(config.seed, plan.num_batches - 1))
        loss, _ = run.model.loss(batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids)
        loss.backward()
        results.append((float(loss.detach()), [p.grad.clone() for p in params]))
    assert len(drawn[0]) == len(drawn[1]) == 2 * len(layer_groups(FULL_ATTENTION)) * len(run.model.layers)
    for (salt, mask), (padded_salt, padded_mask) in zip(*drawn, strict=True):
        assert salt == padded_salt and torch.equal(padded_mask[:rows], mask), f"salt {salt}"
    (short_loss, short_grads), (padded_loss, padded_grads) = results
    assert padded_loss == pytest.approx(short_loss, rel=1e-6)
    # The added rows contribute only zero terms; the sums over tokens just run in another order.
    for a, b in zip(short_grads, padded_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def _capture_runs_out_of_memory(weight: torch.Tensor):
    """(loss_fn, its side stream): (weight * values).sum(), with a copy forked to the side stream
    still open when, captured, it runs out of memory (as an offloaded layer's copy would be)."""
    side = torch.cuda.Stream(CUDA)

    def loss_fn(values, labels):
        side.wait_stream(torch.cuda.current_stream(CUDA))
        with torch.cuda.stream(side):
            torch.ones(4, device=CUDA).mul_(2)
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return (weight * values).sum(), labels

    return loss_fn, side


@pytest.mark.gpu
@needs_cuda
def test_running_out_of_memory_mid_capture_is_reported_as_such():
    """An allocation that fails while work forked to a side stream is still open (an offloaded layer's
    copy in flight) leaves the capture unjoined; the error raised is the out-of-memory one, not the
    capture's own "unjoined work" that would otherwise replace it. After the tests that replay graphs,
    as are the two after it: their captures fail."""
    weight = torch.ones(4, device=CUDA, requires_grad=True)
    loss_fn, side = _capture_runs_out_of_memory(weight)
    graphed = GraphedLoss(loss_fn, CUDA, vocab_size=8)
    inputs = [torch.ones(4, device=CUDA), torch.zeros(4, dtype=torch.long, device=CUDA)]
    graphed(inputs, 1, 1.0)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        graphed(inputs, 1, 1.0)
    side.synchronize()
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)
    assert torch.ones(4, device=CUDA).sum().item() == 4
    assert torch.randn(4, device=CUDA).isfinite().all()  # the generator is out of the failed capture


@pytest.mark.gpu
@needs_cuda
def test_a_capture_out_of_memory_goes_on_eagerly_under_auto():
    """With eager_when_out_of_memory (cuda_graphs: auto), the micro-batch whose capture ran out of
    memory and every later one run eagerly and accumulate what eager calls do; the note comes once."""
    weight = torch.ones(4, device=CUDA, requires_grad=True)
    loss_fn, _ = _capture_runs_out_of_memory(weight)
    graphed = GraphedLoss(loss_fn, CUDA, vocab_size=8, eager_when_out_of_memory=True)
    values = torch.arange(4.0, device=CUDA)
    inputs = [values, torch.zeros(4, dtype=torch.long, device=CUDA)]
    losses = [graphed(inputs, 1, 0.5).item() for _ in range(3)]
    assert losses == [6.0, 6.0, 6.0]
    torch.testing.assert_close(weight.grad, 3 * 0.5 * values, rtol=0, atol=0)
    assert graphed.graph is None and graphed.eager_only
    assert "ran out of GPU memory" in graphed.fallback_note()
    assert graphed.fallback_note() is None


@pytest.mark.gpu
@needs_cuda
def test_train_goes_on_without_graphs_when_their_capture_runs_out_of_memory(
    tmp_path, deterministic_algorithms
):
    """`qlora train` with cuda_graphs auto, its capture failing for memory inside a layer: a note, and
    the run trains as cuda_graphs false does (the same losses); cuda_graphs true stops instead.
    Deterministic algorithms: both runs launch op by op, so only atomics' order could tell them apart."""
    settings = dict(device="cuda", sample_packing=True, gradient_checkpointing=True, max_steps=4)

    def capture_fails(module, args):
        if type(module).__name__ == "DecoderLayer" and torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    hook = torch.nn.modules.module.register_module_forward_pre_hook(capture_fails)
    try:
        fallen_back = train(load_config(write_run(tmp_path / "auto", **settings)))
        with pytest.raises(OutOfMemory):
            train(load_config(write_run(tmp_path / "insisted", cuda_graphs=True, **settings)))
    finally:
        hook.remove()
    eager = train(load_config(write_run(tmp_path / "eager", cuda_graphs=False, **settings)))
    log = (fallen_back.output_dir / LOG_FILE).read_text()
    assert log.count("capturing the step's graph ran out of GPU memory") == 1
    got, expected = _records(fallen_back.output_dir), _records(eager.output_dir)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
