"""The adapter switch (QLoRAModel.adapter_off): a device value that turns LoRA off for a preference
loss's reference model, read by the kernels' callers at run time so a captured graph replays it."""

import functools

import pytest
import torch
from checkpoints import captured_graph, write_qwen3, write_qwen3_5
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_cli.model import LoRAConfig, QLoRAModel

WRITERS = {"qwen3": write_qwen3, "qwen3_5": functools.partial(write_qwen3_5, layout="text")}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def folder(request, tmp_path_factory):
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(params=["reference", "triton"])
def ops(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def adapted(folder, lora=LoRAConfig(r=4), **options) -> QLoRAModel:
    """A model whose adapter changes its logits: every LoRA B drawn nonzero."""
    model = QLoRAModel.from_pretrained(folder, quantize=False, lora=lora, **options)
    for group in (g for layer in model.layers for g in layer.projections.values()):
        for b in group.lora_B.values():
            drawn = torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())) * 0.05
            with torch.no_grad():
                b.copy_(drawn)
    return model


def tokens(model, batch=2, seq=16, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, model.spec.vocab_size, (batch, seq), generator=generator).to(device)


def test_adapter_off_gives_the_base_models_logits_and_on_again_the_adapters(folder, ops):
    model = adapted(folder).eval()
    base = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    ids = tokens(model)
    with torch.no_grad():
        with_adapter = model(ids)
        with model.adapter_off():
            off = model(ids)
        on_again = model(ids)
        without_adapter = base(ids)
    assert not torch.allclose(with_adapter, without_adapter, atol=1e-3)
    assert torch.equal(off, without_adapter)
    assert torch.equal(on_again, with_adapter)


@pytest.mark.parametrize("offload", [False, True])
def test_the_switch_reaches_recomputed_layers_and_their_gradients(folder, reference_ops, offload):
    """In training, with every layer recomputed in backward (kept on the device or in host memory), and
    LoRA dropout on: off, the loss is the base model's and the adapter gets no gradient; on, the recompute
    is the adapter's again."""
    lora = LoRAConfig(r=4, dropout=0.1)
    options = dict(checkpoint_layers=2, offload_activations=offload)
    model = adapted(folder, lora, **options).train()
    base = QLoRAModel.from_pretrained(folder, quantize=False, **options).train()
    ids = tokens(model)
    with model.adapter_off():
        off, _ = model.loss(ids, ids.roll(-1, dims=1))
        off.backward()
    base_loss, _ = base.loss(ids, ids.roll(-1, dims=1))
    torch.testing.assert_close(off, base_loss, rtol=1e-6, atol=1e-6)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.trainable_parameters())

    on, _ = model.loss(ids, ids.roll(-1, dims=1))
    on.backward()
    reference = adapted(folder, lora, **options).train()
    expected, _ = reference.loss(ids, ids.roll(-1, dims=1))
    expected.backward()
    assert torch.equal(on, expected)
    for got, want in zip(model.trainable_parameters(), reference.trainable_parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


class HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value back to the host, which a CUDA graph capture refuses."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_function_built_once_reads_the_switch_flipped_in_place(folder, reference_ops):
    """What a graph replay needs: the same Python objects, the switch flipped in place between two calls,
    and nothing read back to the host by switching; the tensor the layers read is never replaced."""
    model = adapted(folder).eval()
    ids = tokens(model)
    switch = model.adapter_scale
    address = switch.data_ptr()

    def replay():
        with torch.no_grad():
            return model(ids)

    with_adapter = replay()
    switch.zero_()
    off = replay()
    switch.fill_(1.0)
    assert torch.equal(replay(), with_adapter) and not torch.equal(off, with_adapter)

    reads = HostReads()
    with reads, model.adapter_off():
        inside = replay()
    assert reads.seen == []
    assert torch.equal(inside, off)
    assert model.adapter_scale is switch and switch.data_ptr() == address and switch.item() == 1.0


@pytest.mark.gpu
def test_gpu_one_captured_graph_runs_policy_and_reference_and_follows_the_switch(tmp_path):
    """One CUDA graph holds the adapter's forward and, under adapter_off, the base model's; its replays
    give the eager results, and flipping the switch between replays changes the first forward."""
    model = adapted(write_qwen3(tmp_path), device="cuda").eval()
    ids = tokens(model, device="cuda")

    def both():
        policy = model(ids)
        with model.adapter_off():
            reference = model(ids)
        return policy, reference

    with torch.no_grad():
        eager_policy, eager_reference = both()
        graph, (policy, reference) = captured_graph(both)
    graph.replay()
    assert torch.equal(policy, eager_policy) and torch.equal(reference, eager_reference)
    assert model.adapter_scale.item() == 1.0
    model.adapter_scale.zero_()
    graph.replay()
    assert torch.equal(policy, eager_reference) and torch.equal(reference, eager_reference)
    model.adapter_scale.fill_(1.0)
    graph.replay()
    assert torch.equal(policy, eager_policy)
