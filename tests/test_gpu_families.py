"""A QLoRA step of a Qwen3.5-shaped model (one Gated DeltaNet layer, one gated attention layer), of a
Llama-3.1-shaped one (two layers) and of a Qwen3.5-35B-A3B-shaped mixture of experts (Qwen3.5's two layers,
each MLP 256 routed experts and a shared one), against transformers + PEFT + bitsandbytes on the same NF4
bytes and the same LoRA weights: the loss, the logits and every LoRA gradient agree. bitsandbytes leaves
transformers' fused experts in the compute dtype, so the MoE checkpoint holds experts that are already
their NF4 round trip: transformers multiplies by the values our NF4 experts decode to.

transformers runs its torch paths throughout (for Qwen3.5 its own delta rule and conv1d, even where
flash-linear-attention is importable: that package refuses Hopper's backward on triton 3.6), once in
bf16 as users train and once in fp32. The fp32 run is the truth both bf16 steps are measured against,
and transformers' own bf16 distance from it says what bf16 rounding alone costs on that shape."""

import inspect
import sys

import pytest
import torch
from checkpoints import draw_lora_b
from safetensors.torch import load_file, save_file

from benchmarks.bnb import load_nf4_model
from benchmarks.random_checkpoint import write_config_checkpoint
from benchmarks.shapes import model_config
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.rundir.adapter import adapter_state_dict, trainable_tensors
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4

pytestmark = pytest.mark.gpu

SHAPES = {
    # Layer 0 Gated DeltaNet, layer 1 gated attention.
    "qwen3.5-9b": {"full_attention_interval": 2},
    "llama-3.1-8b": {},
    "qwen3.5-35b-a3b": {"full_attention_interval": 2},
}
TOKENS = 2048
# Against the fp32 truth: the loss within 1 %, the logits within 2 % and each LoRA gradient within 5 %
# (relative norms), or within 1.5x of what transformers' own bf16 step is off by there: two bf16
# implementations round differently, not less.
LOSS_TOLERANCE, LOGITS_TOLERANCE, GRADIENT_TOLERANCE, BF16_SPREAD = 1e-2, 2e-2, 5e-2, 1.5
# transformers' Qwen3.5 kernels chosen at import (flash-linear-attention or causal-conv1d where
# importable), each wrapping its torch path.
HF_KERNELS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    config = {**model_config(request.param, layers=2), **SHAPES[request.param], "vocab_size": 32768}
    folder = write_config_checkpoint(config, tmp_path_factory.mktemp(request.param), device="cuda")
    _round_trip_routed_experts(folder)
    return folder


def _round_trip_routed_experts(folder) -> None:
    """Each routed expert's matrix replaced by its NF4 round trip (bf16, as training quantizes it), and so
    is the shared expert's gate, which ours keeps in bf16 and bitsandbytes quantizes as a Linear: both
    then multiply by the same values."""
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        experts = [name for name in tensors if ".mlp.experts." in name or "shared_expert_gate" in name]
        for name in experts:
            tensors[name] = dequantize_nf4(quantize_nf4(tensors[name].cuda())).cpu()
        if experts:
            save_file(tensors, path, metadata={"format": "pt"})


def _batch(vocab_size: int):
    generator = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, vocab_size, (1, TOKENS), generator=generator, device="cuda")
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _ours(folder) -> QLoRAModel:
    model = QLoRAModel.from_pretrained(folder, lora=LoRAConfig(r=16, alpha=32), device="cuda", seed=1)
    draw_lora_b(model)
    return model.train()


def _torch_paths(monkeypatch) -> None:
    """transformers' Qwen3.5 modules (dense and MoE) call their torch delta rule and conv1d, whatever is
    installed."""
    for family in ("qwen3_5", "qwen3_5_moe"):
        modeling = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
        if modeling is None:
            continue
        for name in HF_KERNELS:
            monkeypatch.setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))


def _theirs(folder, ours: QLoRAModel, dtype: torch.dtype, monkeypatch):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    model = load_nf4_model(folder, "cuda", dtype)
    _torch_paths(monkeypatch)
    targets = sorted({name for layer in ours.layers for g in layer.projections.values() for name in g.lora_A})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    state = {name: tensor.to(dtype) for name, tensor in adapter_state_dict(ours).items()}
    result = set_peft_model_state_dict(model, state)
    # PEFT takes gate_proj/up_proj/down_proj to adapt transformers' fused routed experts as well; left at
    # their zero B they add nothing, as our routed experts take no LoRA.
    missing = [k for k in result.missing_keys if "lora_" in k and ".mlp.experts." not in k]
    assert not missing and not result.unexpected_keys
    return model.train()


def _same_nf4_bytes(ours: QLoRAModel, theirs) -> int:
    """Every adapted projection of theirs holds the packed NF4 codes and absmax codes ours holds."""
    checked = 0
    for name in trainable_tensors(ours):
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removesuffix(".lora_A.weight")
        index, proj = int(module.split(".layers.")[1].split(".")[0]), module.rsplit(".", 1)[1]
        group = ours.layers[index].projections[ours.layers[index].group_of[proj]]
        weight = group.weights[group.names.index(proj)]
        packed = theirs.get_submodule(module).base_layer.weight
        assert torch.equal(packed.data.reshape(-1), weight.packed), module
        assert torch.equal(packed.quant_state.absmax, weight.absmax), module
        checked += 1
    return checked


def _our_step(model: QLoRAModel, batch) -> dict:
    ids, labels = batch
    loss_sum, count = model.loss(ids, labels)
    (loss_sum / count).backward()
    with torch.no_grad():
        logits = model(ids).float()
    grads = {name: param.grad.float() for name, param in trainable_tensors(model).items()}
    return {"loss": float(loss_sum.detach() / count), "logits": logits, "grads": grads}


def _their_step(model, batch, names) -> dict:
    ids, _ = batch
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {name: params[name.replace(".weight", ".default.weight")].grad.float() for name in names}
    return {"loss": float(out.loss.detach()), "logits": out.logits.detach().float(), "grads": grads}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def steps(checkpoint):
    """Our bf16 step, transformers' bf16 and fp32 steps on one batch, each model freed after its step."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        ours = _ours(checkpoint)
        expected = sum(len(ours.spec.projection_shapes(k)) for k in ours.spec.layer_types)
        names = list(trainable_tensors(ours))
        batch = _batch(ours.spec.vocab_size)
        results = {"ours": _our_step(ours, batch)}
        for label, dtype in (("hf bf16", torch.bfloat16), ("hf fp32", torch.float32)):
            theirs = _theirs(checkpoint, ours, dtype, monkeypatch)
            if dtype == torch.bfloat16:
                assert _same_nf4_bytes(ours, theirs) == expected
            results[label] = _their_step(theirs, batch, names)
            del theirs
            torch.cuda.empty_cache()
        adapted = {name.split(".lora_")[0].rsplit(".", 1)[1] for name in names}
        assert adapted == {p for kind in ours.spec.layer_types for p in ours.spec.projection_shapes(kind)}
    return results


def test_loss_logits_and_lora_gradients_match_hf_peft_bitsandbytes(steps, checkpoint):
    truth = steps["hf fp32"]
    report = [f"{checkpoint.name}: distance from transformers fp32 (relative norms)"]
    spreads = {}
    for label in ("ours", "hf bf16"):
        step = steps[label]
        spreads[label] = {
            "loss": abs(step["loss"] / truth["loss"] - 1),
            "logits": _relative(step["logits"], truth["logits"]),
            **{name: _relative(grad, truth["grads"][name]) for name, grad in step["grads"].items()},
        }
    worst = {
        label: max((k for k in s if k not in ("loss", "logits")), key=s.get) for label, s in spreads.items()
    }
    for label, spread in spreads.items():
        report.append(
            f"  {label:<8} loss {spread['loss']:.2e}  logits {spread['logits']:.4f}  worst gradient "
            f"{spread[worst[label]]:.4f} ({worst[label]})"
        )
    ours_vs_hf = steps["ours"]
    report.append(
        f"  ours against hf bf16: logits {_relative(ours_vs_hf['logits'], steps['hf bf16']['logits']):.4f}, "
        f"worst gradient {max(_relative(g, steps['hf bf16']['grads'][n]) for n, g in ours_vs_hf['grads'].items()):.4f}"
    )
    print("\n".join(report))
    ours, hf = spreads["ours"], spreads["hf bf16"]
    assert ours["loss"] < LOSS_TOLERANCE, report
    assert ours["logits"] < max(LOGITS_TOLERANCE, BF16_SPREAD * hf["logits"]), report
    for name in steps["ours"]["grads"]:
        bound = max(GRADIENT_TOLERANCE, BF16_SPREAD * hf[name])
        assert ours[name] < bound, f"{name}: {ours[name]:.4f} from fp32, bound {bound:.4f}\n" + "\n".join(
            report
        )
