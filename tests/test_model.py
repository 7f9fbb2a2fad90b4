"""The decoder against transformers' own models of every family on the same random checkpoints: Qwen2,
Qwen3, Qwen3.5 (text and vision-language layouts, tied and untied), Llama with llama3 RoPE scaling
(tied and untied) and Mistral with a head_dim decoupled from hidden / heads."""

import functools

import pytest
import torch
from checkpoints import load_transformers, write_llama, write_mistral, write_qwen2, write_qwen3, write_qwen3_5

from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.model.lora import ProjectionGroup
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4

WRITERS = {
    "qwen2": write_qwen2,
    "qwen3": write_qwen3,
    "qwen3_5": write_qwen3_5,
    "qwen3_5_vl_tied": functools.partial(write_qwen3_5, layout="vl", tie=True),
    "llama": write_llama,
    "llama_tied": functools.partial(write_llama, tie=True),
    "mistral": write_mistral,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request, tmp_path_factory):
    return request.param, WRITERS[request.param](tmp_path_factory.mktemp(request.param))


def _tokens(vocab: int, batch: int = 2, seq: int = 19) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _three_documents(vocab: int):
    """Three documents of 5, 9 and 4 tokens, and the positions and doc_ids of the row packing them."""
    lengths = [5, 9, 4]
    docs = [_tokens(vocab, batch=1, seq=n).roll(i, dims=1) for i, n in enumerate(lengths)]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    return docs, positions, doc_ids


def test_logits_match_transformers(checkpoint, reference_ops):
    kind, folder = checkpoint
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    theirs = load_transformers(folder)
    ids = _tokens(ours.spec.vocab_size)
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape == (2, 19, ours.spec.vocab_size)
    assert (got - expected).abs().max().item() < 1e-4


def test_logits_match_transformers_through_triton_interpreter(checkpoint):
    """The same check with every op on its Triton kernel (interpreted on the CPU)."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU tests")
    kind, folder = checkpoint
    ours = QLoRAModel.from_pretrained(folder, quantize=False, attention_backend="triton").eval()
    theirs = load_transformers(folder)
    ids = _tokens(ours.spec.vocab_size, batch=1, seq=16)
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_lora_b_zero_leaves_logits_unchanged(checkpoint, reference_ops):
    kind, folder = checkpoint
    plain = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    adapted = QLoRAModel.from_pretrained(folder, quantize=False, lora=LoRAConfig(r=4)).eval()
    ids = _tokens(plain.spec.vocab_size)
    with torch.no_grad():
        assert torch.equal(plain(ids), adapted(ids))


def test_nf4_model_uses_dequantized_weights(checkpoint, reference_ops):
    """Quantized: each projection holds NF4 codes whose dequantization is the NF4 round trip, and the
    logits are those of the plain model with every projection replaced by its round trip (fp32, one
    summation order: 1e-4); the random models' sensitivity to the round trip itself differs by family."""
    kind, folder = checkpoint
    full = QLoRAModel.from_pretrained(folder, quantize=False)
    nf4 = QLoRAModel.from_pretrained(folder, quantize=True)
    round_trip = QLoRAModel.from_pretrained(folder, quantize=False)
    for layer_full, layer_nf4, layer_trip in zip(full.layers, nf4.layers, round_trip.layers, strict=True):
        groups = zip(
            layer_full.projections.values(),
            layer_nf4.projections.values(),
            layer_trip.projections.values(),
            strict=True,
        )
        for group_full, group_nf4, group_trip in groups:
            for i, (weight, quantized) in enumerate(zip(group_full.weights, group_nf4.weights, strict=True)):
                assert torch.equal(dequantize_nf4(quantized), dequantize_nf4(quantize_nf4(weight)))
                group_trip.weights[i] = dequantize_nf4(quantized)
    ids = _tokens(full.spec.vocab_size)
    with torch.no_grad():
        got, expected, unquantized = nf4.eval()(ids), round_trip.eval()(ids), full.eval()(ids)
    assert (got - expected).abs().max().item() < 1e-4
    assert (got - unquantized).abs().max().item() > 1e-3


def test_lora_gradients_reach_every_target(checkpoint, reference_ops):
    kind, folder = checkpoint
    model = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4, train_norms=True))
    for group in (g for layer in model.layers for g in layer.projections.values()):
        for b in group.lora_B.values():
            torch.nn.init.normal_(b, std=0.02)
    ids = _tokens(model.spec.vocab_size)
    loss_sum, count = model.loss(ids, ids.roll(-1, dims=1))
    loss_sum.backward()
    assert int(count) == ids.numel()
    params = model.trainable_parameters()
    # Per layer: A and B of each projection it has, its two norms, and the q/k norms (attention) or
    # the gated norm (Gated DeltaNet); then the final norm.
    expected = 1
    for kind in model.spec.layer_types:
        linear = kind == "linear_attention"
        projections = len(model.spec.projection_shapes(kind))
        expected += 2 * projections + 2 + (1 if linear else 2 if model.spec.qk_norm else 0)
    assert len(params) == expected
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_packed_documents_do_not_see_each_other(checkpoint, backend):
    """A row packing three documents gives each the logits it gets alone: attention and RoPE restart."""
    kind, folder = checkpoint
    model = QLoRAModel.from_pretrained(folder, quantize=False, attention_backend=backend).eval()
    docs, positions, doc_ids = _three_documents(model.spec.vocab_size)
    packed = torch.cat(docs, dim=1)
    with torch.no_grad():
        together = model(packed, positions, doc_ids)
        alone = torch.cat([model(doc) for doc in docs], dim=1)
    assert (together - alone).abs().max().item() < 1e-4


def test_packed_documents_train_as_they_would_alone(checkpoint):
    """A packed row of three documents, every layer recomputed and every op on its Triton kernel: the
    loss and LoRA gradients of the documents trained as rows of their own. Backward sees the documents
    apart as forward does, the Gated DeltaNet's conv rerun for the delta rule included."""
    kind, folder = checkpoint
    model = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4), checkpoint_layers=2).train()
    for b in (b for layer in model.layers for g in layer.projections.values() for b in g.lora_B.values()):
        torch.nn.init.normal_(b, std=0.02, generator=torch.Generator().manual_seed(b.numel()))
    docs, positions, doc_ids = _three_documents(model.spec.vocab_size)
    labels = [doc.roll(-1, dims=1).index_fill(1, torch.tensor([doc.shape[1] - 1]), -100) for doc in docs]
    params = model.trainable_parameters()

    def loss_and_grads(rows):
        for p in params:
            p.grad = None
        total = sum(model.loss(*row)[0] for row in rows)
        total.backward()
        return total.detach(), [p.grad.clone() for p in params]

    packed = loss_and_grads([(torch.cat(docs, 1), torch.cat(labels, 1), positions, doc_ids)])
    alone = loss_and_grads([(doc, label) for doc, label in zip(docs, labels, strict=True)])
    # fp32 throughout: the two sides sum the same terms in another order (a few ulps, 6e-8 each).
    assert torch.allclose(packed[0], alone[0], rtol=1e-5)
    for a, b in zip(packed[1], alone[1], strict=True):
        assert (a - b).norm() <= 1e-5 * b.norm()


@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_recomputed_layers_give_the_same_loss_and_gradients(checkpoint, ops, monkeypatch):
    """Gradient checkpointing changes memory, never numbers; on the fused path the recompute
    skips down_proj's GEMM."""
    if ops == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    kind, folder = checkpoint
    ids = _tokens(160)
    results = []
    for recomputed in (0, 1, 2):
        model = QLoRAModel.from_pretrained(
            folder, lora=LoRAConfig(r=4, train_norms=True), checkpoint_layers=recomputed
        )
        for b in (b for layer in model.layers for g in layer.projections.values() for b in g.lora_B.values()):
            torch.nn.init.normal_(b, std=0.02, generator=torch.Generator().manual_seed(b.numel()))
        loss_sum, _ = model.train().loss(ids, ids.roll(-1, dims=1))
        loss_sum.backward()
        results.append((loss_sum.detach(), [p.grad for p in model.trainable_parameters()]))
    for loss, grads in results[1:]:
        assert torch.allclose(loss, results[0][0], rtol=1e-6)
        assert all(
            torch.allclose(g, g0, rtol=1e-5, atol=1e-7) for g, g0 in zip(grads, results[0][1], strict=True)
        )


def test_the_lm_head_on_trained_rows_only_gives_the_same_loss_and_gradients(checkpoint):
    """Skipping the tokens no loss reads in the lm_head's GEMMs changes their cost, never the numbers:
    a masked prompt and a masked tail around trained tokens, on the Triton path."""
    kind, folder = checkpoint
    ids = _tokens(160)
    labels = ids.roll(-1, dims=1)
    labels[0, :7] = labels[1, 12:] = -100
    results = []
    for trained_rows_only in (False, True):
        model = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4)).train()
        for b in (b for layer in model.layers for g in layer.projections.values() for b in g.lora_B.values()):
            torch.nn.init.normal_(b, std=0.02, generator=torch.Generator().manual_seed(b.numel()))
        model.lm_head_trained_rows_only = trained_rows_only
        loss_sum, count = model.loss(ids, labels)
        loss_sum.backward()
        results.append((loss_sum.detach(), count, [p.grad for p in model.trainable_parameters()]))
    (loss, count, grads), (loss0, count0, grads0) = results[1], results[0]
    assert int(count) == int(count0) == int((labels != -100).sum())
    assert torch.allclose(loss, loss0, rtol=1e-6)
    assert all(torch.allclose(g, g0, rtol=1e-5, atol=1e-7) for g, g0 in zip(grads, grads0, strict=True))


def test_only_the_recompute_skips_down_projs_output(checkpoint, reference_ops, monkeypatch):
    """The rerun in backward asks down_proj for no output, once per recomputed layer; the first
    forward, the other layers and a second model are untouched by it."""
    kind, folder = checkpoint
    calls = []
    project = ProjectionGroup.forward

    def spy(group, x, need_output=True, **kwargs):
        if "down_proj" in group.names:
            calls.append((torch.is_grad_enabled(), need_output))
        return project(group, x, need_output, **kwargs)

    monkeypatch.setattr(ProjectionGroup, "forward", spy)
    model = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4), checkpoint_layers=1).train()
    other = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=4)).train()
    ids = _tokens(model.spec.vocab_size)
    loss_sum, _ = model.loss(ids, ids.roll(-1, dims=1))
    assert calls == [(True, True)] * len(model.layers)
    calls.clear()
    loss_sum.backward()
    assert calls == [(True, False)]
    assert not any(layer.recomputing for layer in [*model.layers, *other.layers])
    calls.clear()
    other.loss(ids, ids.roll(-1, dims=1))[0].backward()
    assert calls == [(True, True)] * len(other.layers)


@pytest.mark.parametrize(
    "lora",
    [
        LoRAConfig(r=4),
        LoRAConfig(r=4, dropout=0.2),
        LoRAConfig(r=4, target_modules=("q_proj", "up_proj", "down_proj")),
        LoRAConfig(r=4, target_modules=("gate_proj", "o_proj")),
    ],
    ids=["all", "dropout", "up_and_down", "gate_only"],
)
def test_triton_training_step_matches_reference_ops(checkpoint, lora, monkeypatch):
    """Loss and every LoRA gradient through the Triton path, where the MLP's LoRA is split
    across gate/up, SwiGLU and down, equal the torch references' (dropout draws the same masks)."""
    kind, folder = checkpoint
    ids = _tokens(160)
    results = []
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        model = QLoRAModel.from_pretrained(folder, lora=lora).train()
        for b in (b for layer in model.layers for g in layer.projections.values() for b in g.lora_B.values()):
            torch.nn.init.normal_(b, std=0.05, generator=torch.Generator().manual_seed(b.numel()))
        torch.manual_seed(0)
        loss_sum, _ = model.loss(ids, ids.roll(-1, dims=1))
        loss_sum.backward()
        results.append((loss_sum.detach(), [p.grad for p in model.trainable_parameters()]))
    (loss, grads), (ref_loss, ref_grads) = results[1], results[0]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-4
