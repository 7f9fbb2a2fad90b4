"""Mixture-of-experts families (Qwen3 MoE, Qwen3.5 MoE) against transformers on tiny random checkpoints:
logits, greedy generation and LoRA gradients (through PEFT), routed experts stored per expert or fused,
routing ties, NF4 experts, merged exports (fused experts written fused), and the settings qlora refuses
in one line."""

import dataclasses
import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import (
    add_demo_tokenizer,
    load_transformers,
    write_qwen3,
    write_qwen3_5_moe,
    write_qwen3_moe,
    write_run,
)
from safetensors.torch import load_file, save_file
from test_export import stored_tensors

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import ALL_PROJECTIONS, EXPERT_PARAMETERS
from qlora_cli.core.ops import MOE_ROWS, Op
from qlora_cli.data.examples import IGNORE_INDEX, BatchPlan, Example
from qlora_cli.export.command import export, find_checkpoint
from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.generate.sampling import Sampling, generate_ids
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.model.from_config import lora_config
from qlora_cli.model.mlps import DenseMLP, MoEMLP, moe
from qlora_cli.profiler.report import TOTAL, UNATTRIBUTED
from qlora_cli.rundir.adapter import adapter_state_dict, load_adapter_state, trainable_tensors
from qlora_cli.rundir.checkpoint import read_checkpoint_adapter, read_checkpoint_config
from qlora_cli.sources.model_config import read_spec, spec_from_config
from qlora_cli.sources.spec import DENSE_MLP, MOE_MLP, ModelSpec, MoESpec
from qlora_cli.sources.weights import rewrite_checkpoint, stream_tensors
from qlora_cli.train.loop import train
from qlora_cli.train.run import build_run
from qlora_kernels import cross_entropy
from qlora_kernels.formats import DENSE, NF4
from qlora_kernels.grouped_linear import GroupedNF4Weight
from qlora_kernels.nf4 import quantize_nf4

pytestmark = pytest.mark.usefixtures("reference_ops")

WRITERS = {
    "qwen3_moe": write_qwen3_moe,
    "qwen3_5_moe": write_qwen3_5_moe,
    "qwen3_5_moe-vl": functools.partial(write_qwen3_5_moe, layout="vl"),
}


def _ids(vocab: int, shape=(2, 23), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _max_error(ours: QLoRAModel, theirs, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(ids) - theirs(input_ids=ids).logits).abs().max().item()


def _fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with each layer's routed experts in transformers' fused 3-D form: mlp.experts.gate_up_proj
    [E, 2I, H] (each expert's gate rows, then its up rows) and mlp.experts.down_proj [E, H, I]."""
    tensors = dict(tensors)
    prefixes = sorted({name.split(".experts.")[0] for name in tensors if ".mlp.experts." in name})
    for prefix in prefixes:
        experts = len(
            {n for n in tensors if n.startswith(f"{prefix}.experts.") and n.endswith("down_proj.weight")}
        )
        pop = [[tensors.pop(f"{prefix}.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
               for e in range(experts)]  # fmt: skip
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in pop])
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([d for _, _, d in pop])
    return tensors


def _fuse_experts(folder):
    """Rewrite the checkpoint's routed experts fused, as transformers 5 writes them; returns the folder."""
    path = folder / "model.safetensors"
    save_file(_fused(load_file(path)), path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("family", sorted(WRITERS))
@pytest.mark.parametrize("storage", ["per_expert", "fused"])
def test_logits_match_transformers(family, storage, tmp_path):
    """fp32 on the CPU, unquantized: within 1e-4 of transformers, whichever way the experts are stored
    (transformers reads the per-expert checkpoint; ours reads the same weights fused as well)."""
    folder = WRITERS[family](tmp_path / "model")
    theirs = load_transformers(folder)
    if storage == "fused":
        _fuse_experts(folder)
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    spec = ours.spec
    if family == "qwen3_moe":
        assert spec.mlp_types == (MOE_MLP, DENSE_MLP, MOE_MLP) and spec.moe.norm_topk_prob
        assert list(ours.layers[0].projections) == ["qkv", "o"]
        assert list(ours.layers[1].projections) == ["qkv", "o", "gate_up", "down"]
    else:
        assert set(spec.mlp_types) == {MOE_MLP} and spec.moe.shared_expert_intermediate_size == 48
        assert all(list(layer.projections)[-2:] == ["gate_up", "down"] for layer in ours.layers)
    assert _max_error(ours, theirs, _ids(spec.vocab_size)) < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_greedy_generation_equals_transformers(family, tmp_path):
    """Prefill and cached decode steps (the decode-mode projections for the shared expert and the dense
    layers, one token a row through the router) choose transformers' greedy tokens."""
    folder = WRITERS[family](tmp_path / "model")
    theirs = load_transformers(folder)
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    prompts = [_ids(ours.spec.vocab_size, (1, n), seed=n)[0].tolist() for n in (5, 9)]
    new = 12
    got = generate_ids(DecodingEngine(ours), prompts, Sampling(max_new_tokens=new), set())
    for prompt, completion in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt])
        expected = theirs.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        assert completion.ids == expected


def test_routing_ties_go_as_transformers_breaks_them(tmp_path):
    """A router of zeros ties all experts for every token: torch.topk's order picks them, in transformers
    and in ours; picking the other tied experts changes the logits past the bound."""
    folder = write_qwen3_moe(tmp_path / "model")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("mlp.gate.weight"):
            tensors[name].zero_()
    save_file(tensors, path, metadata={"format": "pt"})
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    assert _max_error(ours, load_transformers(folder), _ids(ours.spec.vocab_size)) < 1e-4


def test_a_tokens_routing_does_not_depend_on_the_rows_beside_it():
    """bf16 hidden states at the 35B-A3B's router shape (2048 wide, 256 experts, top 8): the first rows
    of a micro-batch get the same experts alone as among 4096 rows (as a CUDA graph pads a short
    micro-batch), and the router's probabilities within fp32's rounding. The GEMM's kernel changes with the row count, so its sums differ in the last bits: in fp32 that is
    ~1e-7 of a logit of ~2, where a bf16 product rounds a logit to 2^-8 of it (~1e-2), a probability's
    relative error; on the H200 bf16 logits changed a graph-captured MoE run's gradients. rtol 1e-5
    lies between the two."""
    generator = torch.Generator().manual_seed(0)
    router = (0.05 * torch.randn(256, 2048, generator=generator)).bfloat16()
    x = torch.randn(4096, 2048, generator=generator).bfloat16()
    together_probs, _, together_experts = moe.route(x, router, 8, True)
    for rows in (1, 7, 384):
        probs, _, experts = moe.route(x[:rows], router, 8, True)
        assert torch.equal(experts, together_experts[:rows])
        torch.testing.assert_close(probs, together_probs[:rows], rtol=1e-5, atol=0)


def _moe_spec(top_k: int, hidden: int, dtype=torch.float32, renormalise: bool = False) -> ModelSpec:
    """A one-layer MoE of 4 routed experts of intermediate size hidden / 2 alone, no shared expert."""
    return ModelSpec(
        model_type="qwen3_moe", vocab_size=8, hidden_size=hidden, intermediate_size=24, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
        dtype=dtype, mlp_types=(MOE_MLP,), moe=MoESpec(4, top_k, hidden // 2, norm_topk_prob=renormalise),
    )  # fmt: skip


def _moe_mlp(frozen, spec: ModelSpec, generator: torch.Generator, lora: LoRAConfig | None = None):
    """`spec`'s MoE MLP, its weights random, experts in `frozen`, LoRA on its routed experts as `lora`
    says (B random); and the dense matrices it was given, by (expert, projection)."""
    mlp = MoEMLP(spec, lora)
    if mlp.expert_lora is not None:
        mlp.reset_lora(generator)
        for b in mlp.expert_lora.lora_B.values():
            with torch.no_grad():
                b.normal_(0, 0.1, generator=generator)
    hidden, dense = spec.hidden_size, {}
    mlp.load("gate.weight", torch.randn(4, hidden, generator=generator), DENSE, spec.dtype)
    for e in range(4):
        for name, shape in spec.moe.expert_tensors(hidden).items():
            dense[e, name] = (torch.randn(shape, generator=generator) / 4).to(spec.dtype)
            mlp.load(f"experts.{e}.{name}.weight", dense[e, name], frozen, spec.dtype)
    return mlp, dense


def _merge_expert_lora(mlp: MoEMLP, dense: dict, scale: float) -> dict:
    """The dense matrices with `scale` times the routed experts' LoRA deltas added, per expert, from
    PEFT's layout read independently of ours: A's rows e·r to e·r + r, B's columns e, E + e, ..."""
    lora = mlp.expert_lora
    if lora is None:
        return dense
    merged, r, i = dict(dense), lora.lora_A[next(iter(lora.lora_A))].shape[0] // 4, mlp.intermediate_size
    for e in range(4):
        for name in lora.lora_A:
            a = lora.lora_A[name][e * r : (e + 1) * r]
            b = lora.lora_B[name][:, e::4]
            delta = scale * lora.scaling * (b @ a)
            if name == "down_proj":
                merged[e, "down_proj"] = dense[e, "down_proj"] + delta
            else:
                merged[e, "gate_proj"] = dense[e, "gate_proj"] + delta[:i]
                merged[e, "up_proj"] = dense[e, "up_proj"] + delta[i:]
    return merged


@pytest.mark.parametrize("switch", [None, 1.0, 0.0], ids=["no switch", "adapter on", "adapter off"])
@pytest.mark.parametrize("targets", [(), EXPERT_PARAMETERS, ("down_proj",)], ids=["frozen", "both", "down"])
@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "references"])
def test_the_moe_mlp_sums_each_token_k_times_and_once_each(interpret, targets, switch, monkeypatch):
    """The MoE MLP on a few tokens against each token's chosen experts summed one by one (no sort), for
    k = 1, 2 and all experts: no token dropped or counted twice however the experts' loads fall. With
    LoRA on routed experts, each expert's matrices are W_e + scaling · B_e A_e (the adapter switch at
    0: W_e), and the LoRA gradients are those of that sum."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    if switch is not None and not targets:
        pytest.skip("the switch reaches only LoRA")
    generator = torch.Generator().manual_seed(3)
    lora = LoRAConfig(r=4, alpha=8, expert_targets=targets)
    project = SimpleNamespace(adapter_scale=None if switch is None else torch.tensor(switch))
    for top_k in (1, 2, 4):
        mlp, dense = _moe_mlp(DENSE, _moe_spec(top_k, 16), generator, lora)
        h = torch.randn(1, 13, 16, generator=generator, requires_grad=True)
        out = mlp(h, project, None)
        dense = _merge_expert_lora(mlp, dense, 1.0 if switch is None else switch)
        probs = torch.softmax(h[0] @ mlp.router.T, -1)
        expected = []
        for t in range(13):
            weights, chosen = torch.topk(probs[t], top_k)
            row = 0
            for w, e in zip(weights, chosen.tolist(), strict=True):
                g, u = h[0, t] @ dense[e, "gate_proj"].T, h[0, t] @ dense[e, "up_proj"].T
                row = row + w * ((torch.nn.functional.silu(g) * u) @ dense[e, "down_proj"].T)
            expected.append(row)
        expected = torch.stack(expected)[None]
        torch.testing.assert_close(out, expected)
        leaves = [h, *mlp.parameters()]
        grads = torch.autograd.grad(out.square().sum(), leaves)
        expected_grads = torch.autograd.grad(expected.square().sum(), leaves)
        # fp32 sums in another order (the LoRA products' rank-wide t among them): a few ulp of ~1.
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)


def _random_b(model: QLoRAModel, seed: int = 2) -> None:
    """Every LoRA B drawn at random (they start at zero), the routed experts' too, so every A's
    gradient and every delta is nonzero."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        bs = [b for group in layer.projections.values() for b in group.lora_B.values()]
        if layer.mlp.expert_lora is not None:
            bs += list(layer.mlp.expert_lora.lora_B.values())
        for b in bs:
            with torch.no_grad():
                b.normal_(0, 0.05, generator=generator)


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("experts", [False, True], ids=["frozen experts", "expert lora"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_lora_gradients_match_peft(family, experts, tmp_path):
    """LoRA on every projection qlora targets (attention or Gated DeltaNet, dense MLPs, the shared
    expert; the routed experts' fused parameters where asked, as PEFT's target_parameters): loss and
    every LoRA gradient equal transformers + PEFT's, fp32 CPU, so the backward through the router's
    choices and the experts' scatter is right, and our expert adapter is laid out and named as PEFT's."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    # Every Qwen3 MoE layer sparse: PEFT turns the gate_proj/up_proj/down_proj targets into its fused
    # experts' parameters and then leaves a dense layer's (mlp_only_layers) projections unadapted.
    overrides = {"mlp_only_layers": []} if family == "qwen3_moe" else {}
    folder = WRITERS[family](tmp_path / "model", **overrides)
    lora = LoRAConfig(r=4, alpha=8, expert_targets=EXPERT_PARAMETERS if experts else ())
    ours = QLoRAModel.from_pretrained(folder, quantize=False, lora=lora, seed=1).train()
    _random_b(ours)
    targets = sorted({n for layer in ours.layers for g in layer.projections.values() for n in g.lora_A})
    assert ("gate_proj" in targets) == (family == "qwen3_5_moe")
    peft_config = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
        target_parameters=EXPERT_TARGETS if experts else None,
    )  # fmt: skip
    theirs = get_peft_model(load_transformers(folder), peft_config)
    saved = adapter_state_dict(ours)
    assert any(".mlp.experts." in name for name in saved) == experts
    result = set_peft_model_state_dict(theirs, saved)
    # Without target_parameters PEFT takes gate_proj/up_proj/down_proj to adapt transformers' fused
    # experts as well; left at its zero B they add nothing, as our experts take no LoRA then.
    missing = [k for k in result.missing_keys if "lora_" in k and (experts or ".mlp.experts." not in k)]
    assert not missing and not result.unexpected_keys
    ids = _ids(ours.spec.vocab_size, (2, 17), seed=5)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    loss_sum, count = ours.loss(ids, labels)
    (loss_sum / count).backward()
    out = theirs(input_ids=ids, labels=ids)
    out.loss.backward()
    assert abs(float(loss_sum.detach() / count) - float(out.loss.detach())) < 1e-5
    params = dict(theirs.named_parameters())
    # fp32 sums in other orders (the delta rule's chunks above all): 1e-4 of each gradient's scale, as
    # for dense Qwen3.5, whose worst is 1.4e-5 here (Qwen3.5 MoE's 1.8e-5).
    for name, tensor in trainable_tensors(ours).items():
        their_grad = params[name.replace(".weight", ".default.weight")].grad
        assert (tensor.grad - their_grad).abs().max() < 1e-4 * their_grad.abs().max(), name


def test_recomputed_layers_give_the_kept_layers_gradients(tmp_path, monkeypatch):
    """Every layer recomputed in backward gives the gradients of none recomputed: the rerun produces the
    shared expert's output, which its gate's gradient reads (a dense MLP's rerun skips down's GEMM), and
    the routed experts' LoRA repeats its products. On the Triton kernels in the interpreter: the torch
    references always produce it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder = write_qwen3_5_moe(tmp_path / "model", num_hidden_layers=2, full_attention_interval=2)
    grads = []
    for recomputed in (0, 2):
        lora = LoRAConfig(r=4, alpha=8, expert_targets=EXPERT_PARAMETERS)
        model = QLoRAModel.from_pretrained(
            folder, quantize=False, lora=lora, seed=1, checkpoint_layers=recomputed
        ).train()
        _random_b(model)
        ids = _ids(model.spec.vocab_size, (2, 17), seed=5)
        loss_sum, count = model.loss(ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1))
        (loss_sum / count).backward()
        grads.append({name: t.grad for name, t in trainable_tensors(model).items()})
    assert any(".mlp.experts." in name for name in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_the_delta_rules_passes_are_sized_by_the_layers_mixture_of_experts(tmp_path, monkeypatch):
    """A hybrid layer builds its delta-rule tables in passes that fit in what its own MLP holds in
    backward: here the routed experts' copies, far more than a dense MLP of the config's size."""
    from qlora_cli.model.mixers import gated_deltanet

    folder = write_qwen3_5_moe(tmp_path / "model", num_hidden_layers=2, full_attention_interval=2)
    model = QLoRAModel.from_pretrained(folder, quantize=False, lora=LoRAConfig(r=4), seed=1)
    passes, delta_rule = [], gated_deltanet.gated_delta_rule

    def recorded(*args, tokens_per_pass, **kwargs):
        passes.append(tokens_per_pass)
        return delta_rule(*args, tokens_per_pass=tokens_per_pass, **kwargs)

    monkeypatch.setattr(gated_deltanet, "gated_delta_rule", recorded)
    tokens = 512
    ids = _ids(model.spec.vocab_size, (1, tokens))
    model.loss(ids, ids)
    expected = gated_deltanet.delta_rule_tokens_per_pass(model.spec, tokens, MoEMLP.backward_working_bytes)
    dense = gated_deltanet.delta_rule_tokens_per_pass(model.spec, tokens, DenseMLP.backward_working_bytes)
    assert passes == [expected]
    assert expected > dense, (expected, dense)


def _peft_twin(ours: QLoRAModel, folder):
    """transformers' model of `folder` under PEFT, holding our adapter on the projections it targets."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    targets = sorted({n for layer in ours.layers for g in layer.projections.values() for n in g.lora_A})
    theirs = get_peft_model(
        load_transformers(folder), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    result = set_peft_model_state_dict(theirs, adapter_state_dict(ours))
    # PEFT takes gate_proj/up_proj/down_proj to adapt transformers' fused experts as well; left at its
    # zero B they add nothing, as our experts take no LoRA.
    missing = [k for k in result.missing_keys if "lora_" in k and ".mlp.experts." not in k]
    assert not missing and not result.unexpected_keys
    return theirs


def _assert_lora_gradients_match(ours: QLoRAModel, theirs) -> None:
    params = dict(theirs.named_parameters())
    # fp32 sums in other orders (the delta rule's chunks above all): 1e-4 of each gradient's scale, as
    # for dense Qwen3.5, whose worst is 1.4e-5 here (Qwen3.5 MoE's 1.8e-5).
    for name, tensor in trainable_tensors(ours).items():
        their_grad = params[name.replace(".weight", ".default.weight")].grad
        assert (tensor.grad - their_grad).abs().max() < 1e-4 * their_grad.abs().max(), name


# ----- the load-balancing loss (config.json's output_router_logits) -----

# A coefficient far above transformers' default, so that a wrong aux term moves the loss and the
# gradients past their bounds.
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}

# Model -> (writer, config overrides, LoRA targets). A Qwen3 MoE whose layer 1 is dense
# (mlp_only_layers [1], no router) with LoRA on attention only, since PEFT leaves a dense layer's MLP
# unadapted (test_lora_gradients_match_peft); one sparse in every layer; a Qwen3.5 MoE.
BALANCED = {
    "qwen3_moe-dense_layer": (write_qwen3_moe, {}, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "qwen3_moe": (write_qwen3_moe, {"mlp_only_layers": []}, ALL_PROJECTIONS),
    "qwen3_5_moe": (write_qwen3_5_moe, {}, ALL_PROJECTIONS),
}


DOCUMENTS = (11, 7)


def _documents_batch(packed: bool, vocab: int):
    """Two documents of random tokens, every label trained, in a row each, padded (BatchPlan without
    packing), or packed into one row padded to sequence_len."""
    documents = [_ids(vocab, (1, n), seed=n)[0].tolist() for n in DOCUMENTS]
    plan = BatchPlan(
        [Example(d, d[1:] + [IGNORE_INDEX]) for d in documents], micro_batch_size=1 if packed else 2,
        sequence_len=24, sample_packing=packed, seed=0, pad_token_id=0,
    )  # fmt: skip
    batch = plan.batch(0, 0)
    assert plan.num_batches == 1 and not batch.real_tokens().all()
    return batch


def _micro_batch(layout: str, vocab: int):
    """(our loss's arguments, transformers' forward's) for the same tokens: "whole" rows, or
    _documents_batch "padded" or "packed". transformers gets each document in a row of its own,
    padded, with an attention mask."""
    if layout == "whole":
        ids = _ids(vocab, (2, 17), seed=5)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        return (ids, labels), {"input_ids": ids, "labels": ids}
    packed = layout == "packed"
    batch = _documents_batch(packed, vocab)
    ours = (batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids if packed else None)
    documents = [_ids(vocab, (1, n), seed=n)[0] for n in DOCUMENTS]
    ids = torch.nn.utils.rnn.pad_sequence(documents, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(d) for d in documents], batch_first=True)
    theirs = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return (*ours, batch.real_tokens()), theirs


@pytest.mark.parametrize("layout", ["whole", "padded", "packed"])
@pytest.mark.parametrize("model", sorted(BALANCED))
def test_load_balancing_loss_matches_transformers(model, layout, tmp_path):
    """output_router_logits: our loss is transformers + PEFT's out.loss (the mean token loss plus
    router_aux_loss_coef times the aux), with every LoRA gradient theirs, fp32 CPU. The aux is taken
    over every routed layer's rows together, a dense layer's left out, padding left out as their
    attention mask leaves it out (a padded batch's, a packed row's tail)."""
    writer, overrides, targets = BALANCED[model]
    folder = writer(tmp_path / "model", **AUX, **overrides)
    lora = LoRAConfig(r=4, alpha=8, target_modules=targets)
    ours = QLoRAModel.from_pretrained(folder, quantize=False, lora=lora, seed=1).train()
    _random_b(ours)
    theirs = _peft_twin(ours, folder)
    inputs, their_inputs = _micro_batch(layout, ours.spec.vocab_size)
    loss_sum, count = ours.loss(*inputs)
    (loss_sum / count).backward()
    out = theirs(**their_inputs)
    out.loss.backward()
    assert abs(float(ours.router_aux_loss) - float(out.aux_loss.detach())) < 1e-5
    assert abs(float(loss_sum.detach() / count) - float(out.loss.detach())) < 1e-5
    _assert_lora_gradients_match(ours, theirs)


def test_only_a_training_loss_computes_the_aux_loss(tmp_path, monkeypatch):
    """Evaluation's loss is the mean token loss alone (transformers' out.loss less coef · aux), and the
    logits, a training-mode forward and generation tally no routing."""
    folder = write_qwen3_moe(tmp_path / "model", **AUX)
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    inputs, their_inputs = _micro_batch("whole", ours.spec.vocab_size)
    with torch.no_grad():
        out = load_transformers(folder)(**their_inputs)

    def refuse(*args):
        raise AssertionError("the routing was tallied outside a training loss")

    monkeypatch.setattr(moe, "router_tally", refuse)
    with torch.no_grad():
        loss_sum, count = ours.loss(*inputs)
        assert abs(float(loss_sum / count) - float(out.loss - 0.5 * out.aux_loss)) < 1e-5
        ours.train()(inputs[0])
    prompt = inputs[0][0, :5].tolist()
    generate_ids(DecodingEngine(ours.eval()), [prompt], Sampling(max_new_tokens=3), set())


def test_rows_a_graph_adds_are_padding_to_the_aux_loss(tmp_path):
    """The untrained rows that fill a short micro-batch to a CUDA graph's shape (Batch.padded_to) count
    in neither the aux loss nor the loss, which stay the short batch's."""
    folder = write_qwen3_moe(tmp_path / "model", **AUX)
    model = QLoRAModel.from_pretrained(folder, quantize=False).train()
    short = _documents_batch(True, model.spec.vocab_size)
    padded = short.padded_to(3)
    assert padded.input_ids.shape[0] == 3 and not padded.real_tokens()[1:].any()
    results = []
    with torch.no_grad():
        for batch in (short, padded):
            inputs = (batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids, batch.real_tokens())
            loss_sum, count = model.loss(*inputs)
            results.append((float(loss_sum), int(count), float(model.router_aux_loss)))
    assert results[1] == pytest.approx(results[0], rel=1e-6)


@pytest.mark.parametrize("offload", [False, True], ids=["checkpoint", "offload"])
def test_recomputed_layers_give_the_kept_layers_aux_loss_and_gradients(offload, tmp_path, monkeypatch):
    """With the load-balancing loss, every layer recomputed in backward (torch's checkpoint, or with its
    input offloaded to the host) gives the loss and gradients of none recomputed: a routed layer's tally
    is one of its outputs, so its gradient runs through the rerun as the layer's others do. A Qwen3 MoE
    with a dense layer, a packed row with padding, on the Triton kernels in the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder = write_qwen3_moe(tmp_path / "model", **AUX)
    results = []
    for recomputed in (0, 3):
        model = QLoRAModel.from_pretrained(
            folder, quantize=False, lora=LoRAConfig(r=4, alpha=8), seed=1, checkpoint_layers=recomputed,
            offload_activations=offload,
        ).train()  # fmt: skip
        _random_b(model)
        loss_sum, count = model.loss(*_micro_batch("packed", model.spec.vocab_size)[0])
        (loss_sum / count).backward()
        grads = {name: t.grad for name, t in trainable_tensors(model).items()}
        results.append((loss_sum.detach(), model.router_aux_loss.clone(), grads))
    (loss, aux, grads), (recomputed_loss, recomputed_aux, recomputed_grads) = results
    torch.testing.assert_close(recomputed_loss, loss)
    torch.testing.assert_close(recomputed_aux, aux)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, msg=name)


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "references"])
def test_the_load_balancing_loss_reads_nothing_on_the_host(interpret, tmp_path, monkeypatch):
    """A training loss with the load-balancing loss, forward and backward, its layers kept or
    recomputed, never brings a device value to the host, so the step's CUDA graph captures it. The
    label check is left out: the graph runs it on the host before the capture and skips it inside."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(cross_entropy, "check_labels_in_vocab", lambda *args: None)
    folder = write_qwen3_moe(tmp_path / "model", **AUX)
    for recomputed in (0, 3):
        model = QLoRAModel.from_pretrained(
            folder, quantize=False, lora=LoRAConfig(r=4, alpha=8), seed=1, checkpoint_layers=recomputed
        ).train()
        inputs = _micro_batch("packed", model.spec.vocab_size)[0]
        with _HostReads():
            loss_sum, _ = model.loss(*inputs)
            loss_sum.backward()


def test_experts_are_quantized_one_by_one_to_nf4_and_the_router_is_not(tmp_path):
    folder = write_qwen3_moe(tmp_path / "model")
    ours = QLoRAModel.from_pretrained(folder, quantize=True).eval()
    mlp = ours.layers[0].mlp
    assert sorted(mlp.experts) == ["down_proj", "gate_proj", "up_proj"]
    for projection, stacked in mlp.experts.items():
        assert isinstance(stacked, GroupedNF4Weight) and stacked.experts == ours.spec.moe.num_experts
        shape = ours.spec.moe.expert_tensors(ours.spec.hidden_size)[projection]
        for expert in range(stacked.experts):
            alone = quantize_nf4(
                load_file(folder / "model.safetensors")[
                    f"model.layers.0.mlp.experts.{expert}.{projection}.weight"
                ]
            )
            assert stacked.expert(expert).shape == shape and torch.equal(
                stacked.expert(expert).packed, alone.packed
            )
    assert mlp.router.dtype == torch.float32 and not NF4.recognises(mlp.router)
    # NF4's error on the experts and the rest, not a routing mistake: near transformers' logits.
    theirs = load_transformers(folder)
    ids = _ids(ours.spec.vocab_size)
    with torch.no_grad():
        logits = theirs(input_ids=ids).logits
        assert (ours(ids) - logits).abs().max().item() < 0.5 * logits.abs().max().item()


QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
}  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        ({"scoring_func": "sigmoid"}, 'scoring_func "sigmoid" is not supported for qwen3_moe'),
        ({"router_type": "noisy"}, 'router_type "noisy" is not supported for qwen3_moe'),
        ({"ep_size": 4}, "ep_size 4 is not supported for qwen3_moe"),
        ({"n_group": 8}, "n_group 8 is not supported"),
        ({"output_router_logits": "yes"}, 'output_router_logits must be true or false, got "yes"'),
        (
            {"output_router_logits": True, "router_aux_loss_coef": None},
            "router_aux_loss_coef must be a number, got null",
        ),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and num_experts 4"),
        ({"mlp_only_layers": [2]}, "mlp_only_layers must list layer indices below 2"),
    ],
)
def test_unsupported_moe_settings_are_one_line_naming_the_key(keys, line):
    with pytest.raises(QLoraError) as refused:
        spec_from_config({**QWEN3_MOE, **keys})
    message = str(refused.value)
    assert line in message and "\n" not in message


def test_the_aux_loss_coefficient_is_read_where_output_router_logits_asks_for_the_loss():
    """router_aux_loss_coef, else transformers' default for the family; None where training adds no aux."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig

    from qlora_cli.sources.families import family

    def coef(**keys):
        return spec_from_config({**QWEN3_MOE, **keys}).moe.router_aux_loss_coef

    assert coef() is None and coef(output_router_logits=False, router_aux_loss_coef=0.5) is None
    assert coef(output_router_logits=True, router_aux_loss_coef=0.5) == 0.5
    assert coef(output_router_logits=True) == Qwen3MoeConfig().router_aux_loss_coef
    qwen3_5_moe = family("qwen3_5_moe", "config.json")
    assert qwen3_5_moe.router_aux_loss_coef == Qwen3_5MoeTextConfig().router_aux_loss_coef


def test_num_local_experts_and_the_sparse_step_are_read():
    spec = spec_from_config({**QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "num_experts": None,
                             "num_local_experts": 4})  # fmt: skip
    assert spec.mlp_types == (DENSE_MLP, MOE_MLP, DENSE_MLP, MOE_MLP) and spec.moe.num_experts == 4
    assert not spec.moe.norm_topk_prob
    assert json.dumps(spec.projection_names()) == json.dumps(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


TRAIN_WRITERS = {
    "qwen3_moe": lambda folder: add_demo_tokenizer(write_qwen3_moe(folder, vocab_size=1024)),
    "qwen3_5_moe": write_qwen3_5_moe,
}


@pytest.mark.parametrize("family", sorted(TRAIN_WRITERS))
def test_trains_with_packing_and_recompute(family, tmp_path):
    """qlora train on NF4 experts, LoRA on every projection the model has, every layer recomputed (the
    shared expert's output is produced in the rerun, since its gate reads it): the loss falls and the
    adapter holds no routed expert."""
    path = write_run(
        tmp_path / "run", model_writer=TRAIN_WRITERS[family], rows=12, sequence_len=96, sample_packing=True,
        learning_rate=3e-3, max_steps=6, gradient_checkpointing=True, lora_target_linear=True,
    )  # fmt: skip
    result = train(load_config(path))
    lines = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    losses = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
    assert len(losses) == 6 and max(losses[-2:]) < min(losses[:2])
    assert not [line for line in lines if "aux_loss" in line]
    adapter = load_file(result.output_dir / "adapter_model.safetensors")
    assert adapter and not [name for name in adapter if ".experts." in name]
    assert any(".mlp.shared_expert." in name for name in adapter) == (family == "qwen3_5_moe")


def _balanced_run(folder, **config) -> Path:
    """A run of a Qwen3 MoE that asks for the load-balancing loss, rows padded, two micro-batches a step."""

    def writer(model):
        return add_demo_tokenizer(write_qwen3_moe(model, vocab_size=1024, **AUX))

    return write_run(
        folder, model_writer=writer, rows=12, sequence_len=96, gradient_accumulation_steps=2, **config
    )


def test_trains_with_the_load_balancing_loss_and_logs_it(tmp_path):
    """qlora train with output_router_logits, every layer recomputed: the loss falls and every
    metrics.jsonl record has the aux loss, unscaled (the logged loss holds it times the coefficient)."""
    path = _balanced_run(tmp_path / "run", learning_rate=3e-3, max_steps=6, gradient_checkpointing=True)
    result = train(load_config(path))
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert len(records) == 6 and max(r["loss"] for r in records[-2:]) < min(r["loss"] for r in records[:2])
    assert all(math.isfinite(r["aux_loss"]) and 0 < 0.5 * r["aux_loss"] < r["loss"] for r in records)


def test_a_step_adds_each_micro_batchs_aux_loss_weighed_by_its_trained_tokens(tmp_path):
    """Two padded micro-batches a step: the step's summed loss is transformers' out.loss of each
    micro-batch (its padding masked) times its trained tokens, summed, and its aux the same of out.aux_loss,
    as QLoRAModel.loss and train_step document for accumulation."""
    from qlora_cli.train.run import build_run
    from qlora_cli.train.step import train_step

    config = load_config(_balanced_run(tmp_path / "run", adapter="lora", load_in_4bit=False))
    run = build_run(config)
    theirs = load_transformers(Path(config.base_model))
    epoch, indices = run.train_plan.step_micro_batches(0, 2)
    batches = [run.train_plan.batch(epoch, index) for index in indices]
    loss_sum = aux_sum = 0.0
    for batch in batches:
        assert not batch.real_tokens().all()
        # Our labels are shifted already; transformers shifts its own.
        labels = torch.cat([torch.full_like(batch.labels[:, :1], -100), batch.labels[:, :-1]], dim=1)
        with torch.no_grad():
            out = theirs(input_ids=batch.input_ids, attention_mask=batch.real_tokens().long(), labels=labels)
        loss_sum += float(out.loss) * batch.n_tokens
        aux_sum += float(out.aux_loss) * batch.n_tokens
    step = train_step(run, 0)
    assert len(batches) == 2 and step.trained_tokens == sum(batch.n_tokens for batch in batches)
    assert step.loss_sum == pytest.approx(loss_sum, rel=1e-5)
    assert step.aux_loss_sum == pytest.approx(aux_sum, rel=1e-5)


def test_profile_has_the_routed_experts_rows(tmp_path, run_cli):
    """A MoE layer's router, sort, rows, grouped GEMMs, SwiGLU and expert LoRA have rows of their own,
    forward and backward, with their work; the rest of the step stays under half unattributed."""
    path = write_run(
        tmp_path / "run", model_writer=TRAIN_WRITERS["qwen3_5_moe"], rows=8, sequence_len=96,
        max_steps=2, lora_dropout=0.0, lora_target_parameters=EXPERT_TARGETS, gradient_checkpointing=True,
    )  # fmt: skip
    report = tmp_path / "profile.json"
    code, out, err = run_cli("profile", path, "--steps", 1, "--warmup", 0, "--json", report)
    assert code == 0, err
    rows = {row["name"]: row for row in json.loads(report.read_text())["rows"]}
    assert all(rows[op]["calls"] > 0 and rows[op]["ms"] > 0 for op in MOE_ROWS), rows
    assert all(f" {op.value} " in out or f"\n{op.value} " in out for op in MOE_ROWS)
    for op in (Op.EXPERT_GATE_UP, Op.EXPERT_DOWN, Op.EXPERT_GATE_UP_BWD, Op.ROUTER):
        assert rows[op]["tflops"] > 0, op
    assert rows[Op.EXPERT_ROWS]["calls"] == 2 * rows[Op.ROUTER]["calls"]
    # Every layer recomputed: half the forward calls are the reruns in backward.
    assert rows[Op.ROUTER]["recomputed"] == rows[Op.ROUTER]["calls"] / 2 > 0
    assert rows[UNATTRIBUTED]["ms"] < 0.5 * rows[TOTAL]["ms"]


def _write_dense(folder):
    return add_demo_tokenizer(write_qwen3(folder, vocab_size=1024))


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        (
            {"lora_target_modules": ["q_proj", "experts"]},
            "config key 'lora_target_modules': 'experts' names a MoE model's routed experts, which take "
            "LoRA through lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]",
        ),
        (
            {"lora_target_modules": ["experts"], "lora_target_linear": True},
            "config key 'lora_target_modules': 'experts' names a MoE model's routed experts",
        ),
        (
            {"lora_target_parameters": ["experts.gate_up_proj", "mlp.experts.gate_proj"]},
            "config key 'lora_target_parameters': 'mlp.experts.gate_proj' is not a routed experts' parameter "
            "(expected mlp.experts.gate_up_proj or mlp.experts.down_proj)",
        ),
        (
            {"lora_target_parameters": ["model.layers.0.mlp.experts.down_proj"]},
            "config key 'lora_target_parameters': 'model.layers.0.mlp.experts.down_proj' is not a routed "
            "experts' parameter",
        ),
        (
            {"lora_target_parameters": ["down_proj"], "lora_dropout": 0.1},
            "PEFT's LoRA on routed experts takes no dropout; set lora_dropout: 0",
        ),
        (
            {"lora_target_parameters": ["mlp.experts.down_proj"], "model": "dense"},
            "config key 'lora_target_parameters': this qwen3 model has no routed experts",
        ),
    ],
)
def test_asking_lora_for_the_routed_experts_wrongly_is_one_line(keys, line, tmp_path, run_cli):
    writer = _write_dense if keys.pop("model", None) else TRAIN_WRITERS["qwen3_moe"]
    path = write_run(tmp_path / "run", model_writer=writer, rows=4, **keys)
    for command in ("train", "data"):
        code, _, err = run_cli(command, path)
        lines = [text for text in err.splitlines() if text.strip()]
        assert code == 2 and len(lines) == 1 and line in lines[0], (command, err)


def _write_all_sparse(folder):
    """Qwen3 MoE with routed experts in every layer. (With a dense layer's gate_proj/up_proj among
    target_modules, PEFT converts those names, as for a transformers 4 adapter, into LoRA on the fused
    gate_up_proj at rank 2r, which then clashes with target_parameters' rank-r one.)"""
    return add_demo_tokenizer(write_qwen3_moe(folder, vocab_size=1024, mlp_only_layers=[]))


@pytest.mark.parametrize(
    ("writer", "targets", "note"),
    [
        (
            "sparse",
            ["q_proj", "gate_proj"],
            "lora_target_modules: gate_proj names no projection of this qwen3_moe model; its MLPs are routed "
            "experts, frozen unless lora_target_parameters names them (mlp.experts.gate_up_proj, "
            "mlp.experts.down_proj)",
        ),
        (
            "dense",
            ["q_proj", "in_proj_z"],
            "lora_target_modules: in_proj_z names no projection of this qwen3 model",
        ),
        (
            "dense",
            ["q_proj", "in_proj_z", "out_proj"],
            "lora_target_modules: in_proj_z, out_proj name no projection of this qwen3 model",
        ),
        ("dense", ["q_proj", "gate_proj"], None),
        ("dense", list(ALL_PROJECTIONS), None),
    ],
)
def test_targets_the_model_lacks_are_named_where_others_match(writer, targets, note, tmp_path):
    """PEFT would put an all-MoE model's gate_proj on its routed experts; qlora trains q_proj alone, and
    says so."""
    write = {"sparse": _write_all_sparse, "dense": _write_dense}[writer]
    path = write_run(tmp_path / "run", model_writer=write, rows=4, lora_target_modules=targets)
    notes = [text for text in build_run(load_config(path)).notes if text.startswith("lora_target_modules")]
    assert notes == ([note] if note else [])


def test_routed_expert_lora_trains_saves_as_peft_and_resumes(tmp_path, run_cli):
    """lora_target_parameters with lora_target_linear: the start says what the experts' LoRA adds, the
    adapter holds it under PEFT's names with target_parameters in its config, PEFT loads the folder as
    saved onto transformers' model and gives our logits, and `qlora resume` reloads it and trains on."""
    from peft import PeftModel

    path = write_run(
        tmp_path / "run", model_writer=_write_all_sparse, rows=8, sequence_len=96, max_steps=2,
        learning_rate=3e-3, lora_target_linear=True, lora_target_parameters=EXPERT_TARGETS,
    )  # fmt: skip
    code, out, err = run_cli("train", path)
    assert code == 0, err
    spec = read_spec(tmp_path / "run" / "model")
    weights = 3 * LoRAConfig(r=4, expert_targets=EXPERT_PARAMETERS).expert_weights_per_layer(spec)
    assert f"routed experts' LoRA (gate_up_proj, down_proj): {weights:,} weights" in out + err
    output = tmp_path / "run" / "out"
    adapter = load_file(output / "adapter_model.safetensors")
    assert sum(t.numel() for n, t in adapter.items() if ".mlp.experts." in n) == weights
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in adapter
    config = json.loads((output / "adapter_config.json").read_text())
    assert config["target_parameters"] == EXPERT_TARGETS
    theirs = PeftModel.from_pretrained(load_transformers(tmp_path / "run" / "model"), output).eval()
    ours = _with_adapter(output, quantize=False)
    assert any(b.abs().max() > 0 for b in ours.layers[0].mlp.expert_lora.lora_B.values())
    assert _max_error(ours, theirs, _ids(spec.vocab_size)) < 1e-4
    code, _, err = run_cli("resume", output, "--set", "max_steps=3")
    assert code == 0, err
    resumed = load_file(output / "adapter_model.safetensors")
    changed = [n for n in adapter if ".mlp.experts." in n and not torch.equal(adapter[n], resumed[n])]
    assert changed


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory):
    """A run of each MoE family, 2 steps of LoRA on every projection it has, NF4 base."""
    return _train_each(tmp_path_factory, TRAIN_WRITERS)


@pytest.fixture(scope="module")
def fused_runs(tmp_path_factory):
    """The runs of trained_runs again, on their bases with the routed experts stored fused."""
    writers = {
        family: lambda folder, write=write: _fuse_experts(write(folder))
        for family, write in TRAIN_WRITERS.items()
    }
    return _train_each(tmp_path_factory, writers)


def _train_each(tmp_path_factory, writers):
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")  # module-scoped: set up before the reference_ops fixture
        for family, writer in writers.items():
            runs[family] = _train_briefly(tmp_path_factory.mktemp(family), writer)
    return runs


def _train_briefly(folder, writer):
    path = write_run(
        folder / "run", model_writer=writer, rows=8, sequence_len=96, learning_rate=3e-3, max_steps=2,
        lora_target_linear=True,
    )  # fmt: skip
    return train(load_config(path)).output_dir


@pytest.mark.parametrize("family", sorted(TRAIN_WRITERS))
def test_merged_nf4_export_loads_in_transformers_as_our_quantized_model(family, trained_runs, tmp_path):
    """--merged --base nf4: the routed experts round-trip NF4 as every projection does (expert by expert,
    as stored), the router and shared expert gate stay as they are, LoRA merges into the shared expert
    and attention; transformers' logits on it equal our quantized model's with the adapter."""
    from checkpoints import load_transformers as load

    from qlora_cli.generate.source import load_source

    run = trained_runs[family]
    out = export(run, tmp_path / "merged", merged=True, base="nf4", dtype="float32").out
    ours = load_source(run, device="cpu").model.eval()
    ids = _ids(ours.spec.vocab_size)
    assert any(
        group.lora_B[n].abs().max() > 0 for group in ours.layers[0].projections.values() for n in group.lora_B
    )
    assert _max_error(ours, load(out), ids) < 1e-4


def _with_adapter(run, *, quantize: bool) -> QLoRAModel:
    """Our model of the run's base, NF4 as it trained or as stored, with its newest checkpoint's adapter."""
    checkpoint = find_checkpoint(run)
    config = read_checkpoint_config(checkpoint)
    model = QLoRAModel.from_pretrained(config.base_model, quantize=quantize, lora=lora_config(config))
    load_adapter_state(model, read_checkpoint_adapter(checkpoint), "test")
    return model.eval()


def test_a_fused_checkpoint_rewrites_as_stored_one_expert_matrix_at_a_time(tmp_path):
    """Unchanged, the rewrite is the checkpoint as stored, fused experts included; the change sees each
    expert's matrix alone, as stream_tensors reads it for training."""
    folder = _fuse_experts(write_qwen3_5_moe(tmp_path / "model"))
    spec = read_spec(folder)
    seen = {}

    def unchanged(name, tensor):
        seen[name] = tensor
        return tensor

    rewritten = dict(rewrite_checkpoint(folder, spec, unchanged))
    stored = stored_tensors(folder)
    assert sorted(rewritten) == sorted(stored) and "model.layers.0.mlp.experts.gate_up_proj" in stored
    for name, tensor in stored.items():
        assert torch.equal(rewritten[name], tensor), name
    streamed = dict(stream_tensors(folder, spec))
    assert list(seen) == list(streamed)
    for name, tensor in streamed.items():
        assert torch.equal(seen[name], tensor), name


@pytest.mark.parametrize("base", ["original", "nf4"])
@pytest.mark.parametrize("family", sorted(TRAIN_WRITERS))
def test_a_merged_export_keeps_fused_experts_fused(family, base, fused_runs, trained_runs, tmp_path):
    """--merged of a run trained on routed experts stored fused (transformers 5's form) writes them fused:
    the base's tensor names and shapes, transformers' logits on it our model's with the adapter, and its
    experts those of the same base stored per expert, exported, fused: bit for bit (routed experts take no
    LoRA, so another run on that base has the same; under --base nf4 each expert's gate, up and down
    round-trip NF4 alone, as training quantized them)."""
    run = fused_runs[family]
    out = export(run, tmp_path / "fused", merged=True, base=base, dtype="float32").out
    merged, stored = stored_tensors(out), stored_tensors(run.parent / "model")
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in stored.items()}
    ours = _with_adapter(run, quantize=base == "nf4")
    assert _max_error(ours, load_transformers(out), _ids(ours.spec.vocab_size)) < 1e-4
    per_expert = export(
        trained_runs[family], tmp_path / "per_expert", merged=True, base=base, dtype="float32"
    )
    expected = _fused(stored_tensors(per_expert.out))
    experts = [name for name in stored if name.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(experts) == 2 * ours.spec.mlp_types.count(MOE_MLP)
    for name in experts:
        assert torch.equal(merged[name], expected[name]), name
    assert any(not torch.equal(merged[name], stored[name]) for name in experts) == (base == "nf4")


def test_gguf_of_a_qwen3_moe_with_dense_layers_is_refused_in_one_line(trained_runs, tmp_path, run_cli):
    """llama.cpp's qwen3moe has routed experts in every layer; mlp_only_layers [1] makes layer 1 dense."""
    code, _, err = run_cli("export", trained_runs["qwen3_moe"], "--out", tmp_path / "gguf", "--gguf")
    lines = [text for text in err.splitlines() if text.strip()]
    assert code == 2 and len(lines) == 1, err
    assert (
        "llama.cpp's qwen3moe has routed experts in every layer, and this model's layers [1] are dense MLPs "
        "(config.json's mlp_only_layers and decoder_sparse_step)" in lines[0]
    )
    assert list(tmp_path.iterdir()) == []


def test_gguf_of_an_nf4_run_holds_the_nf4_round_trip_of_its_experts(trained_runs, tmp_path):
    """--gguf --base nf4: each routed expert's matrices are the NF4 round trip of the base's in the run's
    compute dtype (the weights it trained against, no LoRA), stacked in expert order; bf16 holds them
    exactly, as it holds the --merged bf16 export's."""
    from qlora_cli.rundir.trainer_state import read_trainer_state
    from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4

    gguf = pytest.importorskip("gguf")
    run = trained_runs["qwen3_5_moe"]
    result = export(run, tmp_path / "gguf", gguf=True, base="nf4")
    reader = gguf.GGUFReader(result.out / result.gguf_file)
    got = torch.from_numpy(
        next(t for t in reader.tensors if t.name == "blk.2.ffn_down_exps.weight").data.copy()
    )
    checkpoint = sorted(run.glob("checkpoint-*"))[-1]
    dtype = getattr(torch, read_trainer_state(checkpoint).compute_dtype)
    base = load_file(run.parent / "model" / "model.safetensors")
    experts = [base[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] for e in range(8)]
    expected = torch.stack([dequantize_nf4(quantize_nf4(w.to(dtype))) for w in experts])
    assert torch.equal(got.view(torch.bfloat16), expected.to(torch.bfloat16))
    assert not torch.equal(expected.to(torch.bfloat16), torch.stack(experts).to(torch.bfloat16))


class _HostReads:
    """Makes every read of a tensor's values on the host fail: what a captured CUDA graph cannot replay."""

    READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name in self.READS:
            setattr(torch.Tensor, name, self._refuse(name))

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)

    @staticmethod
    def _refuse(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a device value on the host")

        return refuse


@pytest.mark.parametrize("frozen", [NF4, DENSE], ids=["nf4", "dense"])
def test_the_moe_mlp_reads_no_routing_on_the_host(frozen, monkeypatch):
    """The forward and backward of a MoE layer, its routed experts' LoRA included, on the Triton kernels
    (in the interpreter) and on the references, never bring a device value to the host, so a CUDA graph captures it as it does a dense
    layer: training's graphs and decoding's captured step take MoE models too."""
    generator = torch.Generator().manual_seed(4)
    lora = LoRAConfig(r=4, expert_targets=EXPERT_PARAMETERS)
    mlp, _ = _moe_mlp(frozen, _moe_spec(2, 64, renormalise=True), generator, lora)
    h = torch.randn(1, 9, 64, generator=generator, requires_grad=True)
    project = SimpleNamespace(adapter_scale=torch.tensor(1.0))
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        with _HostReads():
            out = mlp(h, project, None)
            torch.autograd.grad(out.square().sum(), [h, *mlp.parameters()])


@pytest.mark.parametrize("targets", [(), EXPERT_PARAMETERS], ids=["frozen", "expert lora"])
@pytest.mark.parametrize("renormalise", [True, False])
def test_the_planner_counts_what_a_moe_mlp_keeps_for_backward(renormalise, targets, monkeypatch):
    """The bytes autograd keeps per token through a MoE MLP (bf16, on the Triton kernels in the
    interpreter), measured as the difference between two token counts so the frozen weights cancel, are
    MoEMLP.kept_activations' bf16 values, exactly: a routed copy or a router tensor the planner misses
    fails this."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    generator = torch.Generator().manual_seed(6)
    spec = _moe_spec(2, 64, torch.bfloat16, renormalise)
    lora = LoRAConfig(r=4, expert_targets=targets)
    mlp, _ = _moe_mlp(NF4, spec, generator, lora)
    project = SimpleNamespace(adapter_scale=None)

    def kept_bytes(tokens: int) -> int:
        storages = {}

        def pack(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        h = torch.randn(1, tokens, 64, generator=generator).bfloat16().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            mlp(h, project, None)
        return sum(storages.values())

    expected = MoEMLP.kept_activations(spec) + MoEMLP.lora_kept_activations(spec, lora)
    assert (kept_bytes(48) - kept_bytes(16)) / 32 == 2 * expected


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_the_planners_counts_are_the_models(family, tmp_path):
    """What the optimizer and the free-space check count (LoRAConfig.trained_weights) is what the model
    trains, per (mixer, MLP) kind; the frozen bytes count every routed expert at NF4's rate."""
    from qlora_cli.model.planner import frozen_weight_bytes

    folder = WRITERS[family](tmp_path / "model")
    lora = LoRAConfig(r=4, train_norms=True, expert_targets=EXPERT_PARAMETERS)
    model = QLoRAModel.from_pretrained(folder, quantize=True, lora=lora)
    assert any(layer.mlp.expert_lora is not None for layer in model.layers)
    assert lora.trained_weights(model.spec) == sum(p.numel() for p in model.trainable_parameters())
    experts = sum(w.shape.numel() for layer in model.layers if isinstance(layer.mlp, MoEMLP)
                  for w in layer.mlp.experts.values())  # fmt: skip
    spec = model.spec
    expertless = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, num_experts=0))
    assert frozen_weight_bytes(spec) - frozen_weight_bytes(expertless) >= experts * NF4.bytes_per_weight


EXPERT_WRITERS = {"qwen3_moe": _write_all_sparse, "qwen3_5_moe": write_qwen3_5_moe}


@pytest.mark.parametrize("storage", ["per_expert", "fused"])
@pytest.mark.parametrize("family", sorted(EXPERT_WRITERS))
def test_a_merged_export_folds_the_routed_experts_lora_in(family, storage, tmp_path):
    """--merged, both bases, of a run with LoRA on the routed experts, stored per expert or fused: each
    expert's matrices take their share of its fused parameter's delta, and transformers' logits on the
    merged model equal ours with the adapter (NF4 as it trained, or the original weights)."""
    write = EXPERT_WRITERS[family]
    writer = write if storage == "per_expert" else (lambda folder: _fuse_experts(write(folder)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        path = write_run(
            tmp_path / "run", model_writer=writer, rows=8, sequence_len=96, learning_rate=3e-3, max_steps=2,
            lora_target_linear=True, lora_target_parameters=EXPERT_TARGETS,
        )  # fmt: skip
        run = train(load_config(path)).output_dir
    for base in ("original", "nf4"):
        out = export(run, tmp_path / base, merged=True, base=base, dtype="float32").out
        ours = _with_adapter(run, quantize=base == "nf4")
        assert any(b.abs().max() > 0 for b in ours.layers[0].mlp.expert_lora.lora_B.values())
        assert _max_error(ours, load_transformers(out), _ids(ours.spec.vocab_size)) < 1e-4, base
