"""Offloaded recompute and the sliced MLP change memory, never numbers (CPU: the bookkeeping;
the GPU test runs the side-stream copies and a CUDA graph)."""

import pytest
import torch
from checkpoints import write_qwen2, write_qwen3

import qlora_cli.model.sliced_mlp as chunked_mlp
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.model.offload import HostOffloader
from qlora_cli.model.sliced_mlp import slice_tokens

WRITERS = {"qwen2": write_qwen2, "qwen3": write_qwen3}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request, tmp_path_factory):
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


def _step(folder, lora: LoRAConfig, *, device="cpu", seed=0, **options):
    model = QLoRAModel.from_pretrained(folder, lora=lora, device=device, **options).train()
    for b in (b for layer in model.layers for g in layer.projections.values() for b in g.lora_B.values()):
        torch.nn.init.normal_(b, std=0.05, generator=torch.Generator(device=device).manual_seed(b.numel()))
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(seed)
    loss_sum, _ = model.loss(ids, ids.roll(-1, dims=1))
    loss_sum.backward()
    return loss_sum.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, model


def _assert_same(result, expected):
    loss, grads, _ = result
    want_loss, want_grads, _ = expected
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-5, msg=name)


LORAS = {
    "all": LoRAConfig(r=4, train_norms=True),
    "dropout": LoRAConfig(r=4, dropout=0.2),
    "attention_only": LoRAConfig(r=4, target_modules=("q_proj", "v_proj")),
}


@pytest.mark.parametrize("lora", LORAS.values(), ids=LORAS.keys())
def test_offloaded_layers_match_recomputed_layers(checkpoint, lora, reference_ops):
    recomputed = _step(checkpoint, lora, checkpoint_layers=2)
    offloaded = _step(checkpoint, lora, checkpoint_layers=2, offload_activations=True)
    _assert_same(offloaded, recomputed)
    assert offloaded[2].offloader is not None
    assert all(buffer is not None for buffer in offloaded[2].offloader.host)


def test_offloading_only_some_layers(checkpoint, reference_ops):
    kept = _step(checkpoint, LORAS["all"], checkpoint_layers=0)
    _assert_same(_step(checkpoint, LORAS["all"], checkpoint_layers=1, offload_activations=True), kept)


def test_offloaded_layers_on_the_triton_path(checkpoint):
    """Through the kernels (Triton interpreter on CPU), where a recompute skips down's GEMM."""
    lora = LORAS["all"]
    _assert_same(
        _step(checkpoint, lora, checkpoint_layers=2, offload_activations=True),
        _step(checkpoint, lora, checkpoint_layers=0),
    )


def _storage(t: torch.Tensor) -> range:
    storage = t.untyped_storage()
    return range(storage.data_ptr(), storage.data_ptr() + storage.nbytes())


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def test_layers_never_share_a_host_buffer_and_neighbours_never_share_a_landing_buffer():
    """Every layer's input waits in its own host buffer; on the way back, layer i lands while layer
    i + 1's landed input is still in use, so neighbours land in different buffers. A second step with
    smaller inputs reuses the buffers and keeps them apart."""
    offloader = HostOffloader(torch.device("cpu"), 4)
    for tokens in (5, 3):
        inputs = [torch.randn(tokens, 8 + layer) for layer in range(4)]
        for layer, x in enumerate(inputs):
            offloader.save(layer, x)
        hosts = [_storage(buffer) for buffer in offloader.host]
        assert all(not _overlap(a, b) for i, a in enumerate(hosts) for b in hosts[i + 1 :])
        landed = [_storage(offloader._landing_buffer(layer)) for layer in range(4)]
        assert all(not _overlap(a, b) for a, b in zip(landed, landed[1:], strict=False))
        for layer in reversed(range(4)):
            assert torch.equal(offloader.load(layer), inputs[layer])


def test_slices_cover_a_long_row_in_equal_parts():
    assert slice_tokens(8192, 18944) == 8192
    assert slice_tokens(16384, 18944) == 8192
    assert slice_tokens(131072, 18944) == 13312  # ten slices, each under 1 GiB of gate/up output
    assert slice_tokens(131072, 18944) * 2 * 18944 * 2 <= chunked_mlp.SLICE_BYTES
    assert slice_tokens(100, 18944) == 100


def _slice_every_20_tokens(monkeypatch):
    """At most 20 tokens' gate/up output per slice: the 48 tokens of a batch in 3 slices of 16."""
    monkeypatch.setattr(chunked_mlp, "SLICE_BYTES", 20 * 2 * 96 * 4)
    monkeypatch.setattr(chunked_mlp, "SLICE_MULTIPLE", 1)


@pytest.mark.parametrize("checkpointed", [0, 2])
@pytest.mark.parametrize("lora", [LORAS["all"], LORAS["attention_only"]], ids=["all", "attention_only"])
def test_sliced_mlp_matches_whole_mlp(checkpoint, lora, checkpointed, monkeypatch, reference_ops):
    whole = _step(checkpoint, lora, checkpoint_layers=checkpointed)
    _slice_every_20_tokens(monkeypatch)
    _assert_same(_step(checkpoint, lora, checkpoint_layers=checkpointed), whole)
    _assert_same(_step(checkpoint, lora, checkpoint_layers=checkpointed, offload_activations=True), whole)


@pytest.mark.parametrize(
    "options", [{}, {"checkpoint_layers": 2}, {"checkpoint_layers": 2, "offload_activations": True}]
)
def test_sliced_mlp_with_dropout_draws_the_whole_mlps_masks(checkpoint, options, monkeypatch, reference_ops):
    """A slice's dropout mask is the whole MLP's mask at the slice's tokens (kernels.dropout's offset),
    and every recompute repeats it: sliced, recomputed, offloaded, the step is the plain one."""
    whole = _step(checkpoint, LORAS["dropout"])
    _slice_every_20_tokens(monkeypatch)
    _assert_same(_step(checkpoint, LORAS["dropout"], **options), whole)


def test_sliced_mlp_takes_the_slices(checkpoint, monkeypatch, reference_ops):
    """The slicing really happens: the MLP's first projection sees slice-sized inputs."""
    _slice_every_20_tokens(monkeypatch)
    seen = []
    model = QLoRAModel.from_pretrained(checkpoint, lora=LORAS["all"]).train()
    assert model.spec.intermediate_size == 96
    model.layers[0].projections["gate_up"].register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(1))
    loss_sum, _ = model.loss(ids, ids.roll(-1, dims=1))
    loss_sum.backward()
    assert seen == [16] * 6  # three equal slices in forward, then in backward's rerun


CUDA = torch.device("cuda")


def _gpu_model(layers: int, **options):
    from dataclasses import replace

    from checkpoints import QWEN25_7B
    from test_gpu_step import _random_tensors

    spec = replace(QWEN25_7B, num_layers=layers)
    model = QLoRAModel.on_device(spec, LoRAConfig(r=16), CUDA, seed=1, attention_backend="triton", **options)
    generator = torch.Generator(device=CUDA).manual_seed(1)
    for group in (g for layer in model.layers for g in layer.projections.values()):
        for b in group.lora_B.values():
            with torch.no_grad():
                b.normal_(0, 0.02, generator=generator)
    tensors = ((name, tensor) for name, tensor in _random_tensors(0) if name in spec.expected_tensors())
    model.load_base(_spec_tensors(spec, tensors), quantize=True, dtype=torch.bfloat16)
    return model.train()


def _spec_tensors(spec, tensors):
    """The 2-layer test tensors, repeated for deeper stacks (every layer is the same shape)."""
    by_name = dict(tensors)
    for name in spec.expected_tensors():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers":
            parts[2] = str(int(parts[2]) % 2)
        yield name, by_name[".".join(parts)]


def _gpu_step(model, tokens: int):
    ids = torch.randint(0, model.spec.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(3))
    ids = ids.to(CUDA)
    torch.cuda.reset_peak_memory_stats()
    loss_sum, count = model.loss(ids, ids.roll(-1, dims=1))
    (loss_sum / count).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss_sum.detach() / count), grads, torch.cuda.max_memory_allocated()


@pytest.mark.gpu
def test_offloaded_layers_on_the_gpu_match_and_hold_no_inputs(deterministic_algorithms):
    """Twelve 7B layers at 8K tokens: the side-stream copies give the numbers of plain recompute, and
    at the peak the GPU holds at most three layer inputs (two landing buffers and the copy in
    flight) where plain recompute holds all twelve. On an H200, six layers saved 1.8 inputs, so
    the loss's own working set sits at the peak too; the bound leaves room for it."""
    tokens = 8192
    plain = _gpu_step(_gpu_model(12, checkpoint_layers=12), tokens)
    torch.cuda.empty_cache()
    offloaded = _gpu_step(_gpu_model(12, checkpoint_layers=12, offload_activations=True), tokens)
    assert offloaded[0] == pytest.approx(plain[0], rel=1e-6)
    for name, grad in plain[1].items():
        torch.testing.assert_close(offloaded[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    layer_input = tokens * 3584 * 2
    assert plain[2] - offloaded[2] > 4 * layer_input, (plain[2], offloaded[2])


@pytest.mark.gpu
def test_offloaded_layers_replay_in_a_cuda_graph(deterministic_algorithms):
    """Captured copies and stream waits: replays accumulate what eager offloaded steps do."""
    from qlora_cli.train.graphs import GraphedLoss

    model = _gpu_model(3, checkpoint_layers=3, offload_activations=True)
    params = model.trainable_parameters()
    batches = []
    for seed in range(3):
        ids = torch.randint(
            0, model.spec.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(seed)
        )
        batches.append((ids, ids.roll(-1, dims=1)))

    def run(call):
        results = []
        for batch in batches:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
            results.append((float(call(batch)), [p.grad.clone() for p in params]))
        return results

    def eager(batch):
        loss_sum, _ = model.loss(*(t.to(CUDA) for t in batch))
        (loss_sum / 2048).backward()
        return loss_sum.detach()

    graphed = GraphedLoss(model.loss, CUDA, model.spec.vocab_size)
    expected = run(eager)
    got = run(lambda batch: graphed(batch, 1, 1 / 2048))
    assert graphed.graph is not None
    for (want_loss, want_grads), (loss, grads) in zip(expected, got, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for a, b in zip(want_grads, grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_long_row_runs_the_mlp_in_slices_on_the_gpu(monkeypatch):
    """32K tokens of a 7B layer: slices of the MLP give the whole MLP's numbers at a lower peak."""
    tokens = 32768
    model = _gpu_model(2, checkpoint_layers=2)
    monkeypatch.setattr(chunked_mlp, "SLICE_BYTES", 1 << 60)
    whole = _gpu_step(model, tokens)
    monkeypatch.undo()
    for p in model.trainable_parameters():
        p.grad = None
    sliced = _gpu_step(model, tokens)
    assert sliced[0] == pytest.approx(whole[0], rel=1e-3)
    for name, grad in whole[1].items():
        error = (sliced[1][name] - grad).norm() / grad.norm()
        assert error < 1e-2, f"{name}: {error:.3g}"
    gate_up = tokens * 2 * 18944 * 2
    assert whole[2] - sliced[2] > gate_up, (whole[2], sliced[2])
