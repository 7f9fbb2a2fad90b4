"""Offloaded recompute and the sliced MLP change memory, never numbers (CPU: the bookkeeping;
the GPU test runs the side-stream copies and a CUDA graph)."""

import pytest
import torch
from checkpoints import write_qwen2, write_qwen3

import qlora_cli.chunked_mlp as chunked_mlp
from qlora_cli.chunked_mlp import slice_tokens
from qlora_cli.model import LoRAConfig, QLoRAModel

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


@pytest.mark.parametrize("options", [{}, {"checkpoint_layers": 2}, {"checkpoint_layers": 2, "offload_activations": True}])
def test_sliced_mlp_with_dropout_replays_its_masks(checkpoint, options, monkeypatch, reference_ops):
    """Slices draw other masks than the whole MLP would, so the check is the gradient itself: along a
    random direction it matches the loss's central difference under the same masks."""
    _slice_every_20_tokens(monkeypatch)
    _, grads, model = _step(checkpoint, LORAS["dropout"], **options)
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(2)
    direction = {name: torch.randn(grad.shape, generator=generator) for name, grad in grads.items()}
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for sign in (1, -1):
        with torch.no_grad():
            for name, v in direction.items():
                params[name].add_(sign * 1e-3 * v)
            torch.manual_seed(0)
            losses.append(model.loss(ids, ids.roll(-1, dims=1))[0].double())
            for name, v in direction.items():
                params[name].sub_(sign * 1e-3 * v)
    numeric = (losses[0] - losses[1]) / 2e-3
    analytic = sum((grads[name].double() * v.double()).sum() for name, v in direction.items())
    assert abs(numeric - analytic) < 2e-2 * abs(analytic), (numeric, analytic)


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
