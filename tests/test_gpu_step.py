"""A full QLoRA step at Qwen2.5-7B layer shapes on the GPU: Triton kernels against the reference ops."""

from dataclasses import replace

import pytest
import torch
from checkpoints import QWEN25_7B, draw_lora_b

from qlora_cli.model import LoRAConfig, QLoRAModel

pytestmark = pytest.mark.gpu

# Qwen2.5-7B's layer, two of them: the whole stack is the same layer 28 times.
SPEC = replace(QWEN25_7B, num_layers=2)


def _random_tensors(seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for name, shape in SPEC.expected_tensors().items():
        noise = torch.randn(shape, generator=generator, device="cuda")
        if name.endswith("norm.weight"):
            yield name, (1.0 + 0.1 * noise).to(torch.bfloat16)
        else:
            yield name, (noise * (0.5 / shape[-1] ** 0.5)).to(torch.bfloat16)


def _model(dtype: torch.dtype) -> QLoRAModel:
    model = QLoRAModel.on_device(SPEC, LoRAConfig(r=16), "cuda", seed=1, attention_backend="triton")
    draw_lora_b(model)
    model.load_base(_random_tensors(0), quantize=True, dtype=dtype)
    return model.train()


def _batch(tokens: int = 2048):
    generator = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, SPEC.vocab_size, (1, tokens), generator=generator, device="cuda")
    labels = ids.roll(-1, dims=1)
    labels[:, : tokens // 8] = -100
    bounds = [0, tokens // 3, tokens // 2, tokens]
    doc_ids = torch.zeros(1, tokens, dtype=torch.int32, device="cuda")
    positions = torch.zeros(1, tokens, dtype=torch.int64, device="cuda")
    for doc, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        doc_ids[:, start:end] = doc
        positions[:, start:end] = torch.arange(end - start, device="cuda")
    return ids, labels, positions, doc_ids


def _step(model: QLoRAModel, batch):
    loss_sum, count = model.loss(*batch[:2], batch[2], batch[3])
    loss = loss_sum / count
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def test_full_step_matches_reference_ops(monkeypatch):
    batch = _batch()
    fast = _model(torch.bfloat16)
    fast_loss, fast_grads = _step(fast, batch)
    optimizer = torch.optim.AdamW(fast.trainable_parameters(), lr=1e-3, fused=True)
    before = [p.detach().clone() for p in fast.trainable_parameters()]
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, fast.trainable_parameters(), strict=True))
    del fast, optimizer
    torch.cuda.empty_cache()

    monkeypatch.setenv("QLORA_KERNELS", "reference")
    truth = _model(torch.float32)
    truth_loss, truth_grads = _step(truth, batch)

    assert abs(fast_loss - truth_loss) / truth_loss < 1e-2
    assert fast_grads.keys() == truth_grads.keys() and len(fast_grads) == 2 * 14
    for name, grad in truth_grads.items():
        error = (fast_grads[name] - grad).norm() / grad.norm()
        assert error < 5e-2, f"{name}: relative gradient error {error:.3g}"


@pytest.mark.parametrize("backend", ["auto", "triton", "sdpa", "flex"])
def test_packed_row_loss_is_the_sum_of_its_documents_losses(backend):
    """One 2048-token row of three documents (positions restarting, doc_ids apart) gives the loss and
    LoRA gradients of the three documents trained as rows of their own, at 7B layer shapes."""
    model = _model(torch.bfloat16)
    for layer in model.layers:
        layer.attention_backend = backend
    ids, labels, positions, doc_ids = _batch()
    bounds = [0, 2048 // 3, 2048 // 2, 2048]
    params = model.trainable_parameters()

    def loss_and_grads(rows):
        for p in params:
            p.grad = None
        total = torch.zeros((), device="cuda")
        for row in rows:
            loss_sum, _ = model.loss(*row)
            loss_sum.backward()
            total += loss_sum.detach().float()
        return total, [p.grad.float().clone() for p in params]

    documents = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        doc_labels = labels[:, start:end].clone()
        doc_labels[:, -1] = -100  # the packed row's labels never cross a boundary: ours must not either
        documents.append((ids[:, start:end], doc_labels, positions[:, start:end], None))
    # The batch's labels predict the next token even at a boundary; masking the last token of each
    # document in the packed row too makes both sides train the same tokens.
    packed_labels = labels.clone()
    for end in bounds[1:]:
        packed_labels[:, end - 1] = -100
    packed, packed_grads = loss_and_grads([(ids, packed_labels, positions, doc_ids)])
    separate, separate_grads = loss_and_grads(documents)
    assert float(packed) == pytest.approx(float(separate), rel=3e-3)
    for a, b in zip(packed_grads, separate_grads, strict=True):
        assert (a - b).norm() <= 0.03 * b.norm()
