"""Export: PEFT loads the adapter, transformers loads the merged model, and both match our model."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import (
    add_demo_tokenizer,
    as_written_before_manifests,
    load_transformers,
    write_llama,
    write_mistral,
    write_qwen2,
    write_qwen3,
    write_qwen3_5,
    write_run,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qlora_cli.config.loading import config_from_dict, load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.export import command
from qlora_cli.export.command import export
from qlora_cli.export.merge import training_dtype
from qlora_cli.export.shards import parse_size
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import compute_dtype, lora_config
from qlora_cli.rundir.adapter import load_adapter_state
from qlora_cli.rundir.checkpoint import read_checkpoint_config, save_checkpoint
from qlora_cli.rundir.trainer_state import TrainerState, read_trainer_state
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.train.loop import train
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4

pytestmark = pytest.mark.usefixtures("reference_ops")
WRITERS = {
    "qwen2": write_qwen2,
    "qwen3": write_qwen3,
    "qwen3_5": lambda folder: write_qwen3_5(folder, tie=True),
    "qwen3_5vl": lambda folder: write_qwen3_5(folder, layout="vl", mtp=True),
    "llama": write_llama,
    "mistral": write_mistral,
}
# Qwen2 (q/k/v bias, tied embeddings): some targets, rsLoRA. Qwen3 (QK-norm, untied): all targets, norms
# trained. Qwen3.5 text (tied) and vision-language (untied, with an MTP head): every projection of both
# layer kinds, the gated q_proj included, and every norm. Llama (llama3 RoPE) and Mistral (head_dim
# decoupled from hidden / heads): all targets.
CASES = {
    "qwen2": dict(lora_target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], peft_use_rslora=True),
    "qwen3-norms": dict(train_norms=True),
    "qwen3_5-norms": dict(train_norms=True),
    "qwen3_5vl-norms": dict(train_norms=True),
    "llama": {},
    "mistral": {},
}
STEPS = 3


def make_run(folder: Path, kind: str, *, writer=None, **settings) -> Path:
    """A base model (written by `writer`, else the tiny model of `kind`; with its family's tokenizer, or
    the demo's where the writer gives none) and one checkpoint with random LoRA A and B (and norms, if
    trained); returns output_dir."""
    base = (writer or WRITERS[kind])(folder / "model")
    if not (base / "tokenizer.json").is_file():
        add_demo_tokenizer(base)
    raw = {
        "base_model": str(base),
        "datasets": [{"path": "data/train.jsonl", "type": "alpaca"}],
        "lora_r": 4,
        "lora_alpha": 8,
        "device": "cpu",
        "output_dir": str(folder / "out"),
    }
    config = config_from_dict({**raw, **settings})
    model = QLoRAModel.from_pretrained(base, quantize=False, lora=lora_config(config))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.trainable_parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    optimizer = torch.optim.AdamW(model.trainable_parameters())
    metrics = [{"step": STEPS, "loss": 2.5, "eval_loss": 2.75}]
    dtype = str(compute_dtype(config, torch.device("cpu"))).removeprefix("torch.")
    state = TrainerState(STEPS, total_steps=STEPS, metrics=metrics, compute_dtype=dtype)
    save_checkpoint(Path(config.output_dir), STEPS, model, optimizer, state, config)
    return Path(config.output_dir)


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    return make_run(tmp_path_factory.mktemp(request.param), kind, **CASES[request.param])


def transformers_classes(folder: Path) -> list:
    """The transformers classes that load `folder` as a causal LM: AutoModelForCausalLM always, and
    for a vision-language checkpoint also the class its config.json names."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    layout = read_spec(folder).layout
    return [AutoModelForCausalLM] + ([Qwen3_5ForConditionalGeneration] if layout == "vl" else [])


def load_as(cls, folder: Path):
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def trained_model(output_dir: Path, *, quantize: bool) -> QLoRAModel:
    """Our model with the checkpoint's adapter, the way training computed with it."""
    checkpoint = output_dir / f"checkpoint-{STEPS}"
    config = read_checkpoint_config(checkpoint)
    model = QLoRAModel.from_pretrained(config.base_model, quantize=quantize, lora=lora_config(config))
    load_adapter_state(model, load_file(checkpoint / "adapter_model.safetensors"), "test")
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_adapter_loads_in_peft_and_matches_our_model(run, tmp_path, reference_ops):
    from peft import PeftModel

    out = export(run, tmp_path / "adapter").out
    base = run.parent / "model"
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file()
    assert not (out / "config.json").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(base) and config["revision"] is None
    ours = trained_model(run, quantize=False)
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    present = {name for kind in set(ours.spec.layer_types) for name in ours.spec.projection_shapes(kind)}
    assert sorted(config["target_modules"]) == sorted(set(ours.lora.target_modules) & present)
    assert config["use_rslora"] == ours.lora.use_rslora

    # The class whose module names the adapter's fit: the one config.json names (PEFT would only warn
    # about keys it cannot place, and run without them).
    cls = transformers_classes(base)[-1]
    peft_model = PeftModel.from_pretrained(load_as(cls, base), out).eval()
    ids = tokens(ours.spec.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
        got = peft_model(input_ids=ids).logits
        plain = load_as(cls, base)(input_ids=ids).logits
    assert max_error(got, expected) < 1e-4
    assert max_error(plain, expected) > 1e-2
    if ours.lora.train_norms:
        decoder = f"base_model.model.{ours.spec.decoder_prefix}"
        full = ours.spec.layer_types.index("full_attention")
        loaded = peft_model.get_submodule(f"{decoder}layers.{full}.self_attn.k_norm").weight
        assert torch.equal(loaded, ours.layers[full].mixer.k_norm.detach())
        assert torch.equal(peft_model.get_submodule(f"{decoder}norm").weight, ours.norm.detach())
        if ours.spec.linear_attention is not None:
            loaded = peft_model.get_submodule(f"{decoder}layers.0.linear_attn.norm").weight
            assert torch.equal(loaded, ours.layers[0].mixer.norm.detach())


CHAT = [  # no system turn: qwen_25 then writes its default one, which the base's template lacks
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
]


@pytest.mark.parametrize("merged, template_file", [(False, True), (True, False)])
def test_exported_tokenizer_renders_chats_as_training_did(tmp_path, merged, template_file):
    """A config's chat_template and special_tokens travel with the export: transformers' tokenizer
    of the exported folder renders a chat exactly as our training tokenizer did, and pads with the
    configured token; also where the base keeps its template in chat_template.jinja, which
    transformers reads first."""
    from transformers import AutoTokenizer

    run = make_run(tmp_path, "qwen3", chat_template="qwen_25", special_tokens={"pad_token": "<|im_end|>"})
    base = ChatTokenizer.from_folder(run.parent / "model")
    if template_file:
        (run.parent / "model" / "chat_template.jinja").write_text(base.chat_template)
    trained = choose_template(base, "qwen_25", None)
    assert trained.render_chat(CHAT) != base.render_chat(CHAT)
    out = export(run, tmp_path / "export", merged=merged).out
    assert (out / "chat_template.jinja").is_file() == template_file
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.apply_chat_template(CHAT, tokenize=False) == trained.render_chat(CHAT)
    assert loaded.pad_token == "<|im_end|>" and loaded.eos_token == base.eos_token


def test_exported_tokenizer_is_the_base_tokenizer_without_chat_settings(run, tmp_path):
    out = export(run, tmp_path / "adapter").out
    base = run.parent / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()


def test_merged_original_base_matches_our_unquantized_model(run, tmp_path, reference_ops):
    out = export(run, tmp_path / "merged", merged=True, dtype="float32").out
    ours = trained_model(run, quantize=False)
    ids = tokens(ours.spec.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
        for cls in transformers_classes(run.parent / "model"):
            assert max_error(load_as(cls, out)(input_ids=ids).logits, expected) < 1e-4, cls
    assert (out / "tokenizer.json").is_file() and not (out / "adapter_config.json").exists()


def test_merged_nf4_base_matches_our_quantized_model(run, tmp_path, reference_ops):
    out = export(run, tmp_path / "nf4", merged=True, base="nf4", dtype="float32").out
    ours = trained_model(run, quantize=True)
    ids = tokens(ours.spec.vocab_size)
    with torch.no_grad():
        expected = ours(ids)
        unquantized = trained_model(run, quantize=False)(ids)
        for cls in transformers_classes(run.parent / "model"):
            assert max_error(load_as(cls, out)(input_ids=ids).logits, expected) < 1e-4, cls
    assert max_error(unquantized, expected) > 1e-3
    assert "NF4 round trip" in (tmp_path / "nf4" / "README.md").read_text()


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


def test_merged_model_keeps_the_checkpoints_layout(tmp_path, reference_ops):
    """A vision-language base merges into a vision-language checkpoint: the same tensor names, the
    vision tower and the MTP head as they were, the decoder's projections merged (every adapted one:
    the gated q_proj and the linear-attention ones too), and its config."""
    output_dir = make_run(tmp_path, "qwen3_5vl")
    base = output_dir.parent / "model"
    out = export(output_dir, tmp_path / "merged", merged=True, dtype="float32").out
    before, after = stored_tensors(base), stored_tensors(out)
    assert sorted(after) == sorted(before)
    passed = [name for name in before if name.startswith(("model.visual.", "mtp."))]
    assert any(name.startswith("mtp.") for name in passed) and len(passed) > 4
    for name in passed:
        assert torch.equal(after[name], before[name]), name
    adapter = load_file(output_dir / f"checkpoint-{STEPS}" / "adapter_model.safetensors")
    scaling = lora_config(read_checkpoint_config(output_dir / f"checkpoint-{STEPS}")).scaling
    merged = [name for name in adapter if name.endswith(".lora_A.weight")]
    assert {name.split(".")[-3] for name in merged} == set(ALL_PROJECTIONS)
    for name in merged:
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        delta = scaling * adapter[name.replace("lora_A", "lora_B")] @ adapter[name]
        assert max_error(after[f"{module}.weight"], before[f"{module}.weight"] + delta) < 1e-6, module
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    card = (export(output_dir, tmp_path / "adapter").out / "README.md").read_text()
    assert "PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(" in card


@pytest.mark.parametrize("bf16", [True, False])
def test_nf4_base_is_the_round_trip_in_the_training_dtype(tmp_path, reference_ops, bf16):
    """The merged weight minus the LoRA delta is, up to fp32 rounding, the weight the run computed with
    (bf16 compute: the round trip in bf16), and not the round trip in the other dtype."""
    output_dir = make_run(tmp_path, "qwen3", bf16=bf16)
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = export(output_dir, tmp_path / "nf4", merged=True, base="nf4", dtype="float32").out
    model = QLoRAModel.from_pretrained(output_dir.parent / "model", quantize=True, dtype=dtype)
    merged = load_transformers(out).state_dict()
    checkpoint = output_dir / f"checkpoint-{STEPS}"
    scaling = lora_config(read_checkpoint_config(checkpoint)).scaling
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    prefix = "model.layers.0.mlp.gate_proj"
    delta = (
        scaling
        * adapter[f"base_model.model.{prefix}.lora_B.weight"]
        @ adapter[f"base_model.model.{prefix}.lora_A.weight"]
    )
    trained_against = dequantize_nf4(model.layers[0].projections["gate_up"].weights[0]).float()
    assert max_error(merged[f"{prefix}.weight"] - delta, trained_against) < 1e-6
    original = load_file(output_dir.parent / "model" / "model.safetensors")[f"{prefix}.weight"]
    other = torch.float32 if bf16 else torch.bfloat16
    assert max_error(dequantize_nf4(quantize_nf4(original.to(other))).float(), trained_against) > 1e-4


def test_training_dtype_is_what_the_run_recorded(tmp_path):
    result = train(load_config(write_run(tmp_path / "run", max_steps=1, bf16=True)))
    state = read_trainer_state(result.checkpoint)
    assert state.compute_dtype == "bfloat16" and training_dtype(state) == torch.bfloat16
    with pytest.raises(QLoraError, match="does not record the run's compute dtype"):
        training_dtype(TrainerState(1))


def test_small_shards_hold_every_tensor_once(tmp_path):
    output_dir = make_run(tmp_path, "qwen2")
    base = output_dir.parent / "model"
    config_path = base / "config.json"
    quantized = json.loads(config_path.read_text())
    quantized["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    config_path.write_text(json.dumps(quantized))
    out = export(output_dir, tmp_path / "sharded", merged=True, max_shard_size="40KB").out

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    seen, total = [], 0
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            sizes = [f.get_tensor(name).numel() * 2 for name in f.keys()]  # noqa: SIM118
            assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in f.keys())  # noqa: SIM118
            assert sum(sizes) <= 40_000 or len(sizes) == 1
            seen += [name for name in f.keys() if index["weight_map"][name] == shard]  # noqa: SIM118
            total += sum(sizes)
    assert sorted(seen) == sorted(index["weight_map"]) == sorted(read_spec(base).expected_tensors())
    assert "lm_head.weight" not in seen
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed.to(torch.bfloat16))


def test_model_card_says_what_was_trained_and_how_it_was_merged(run, tmp_path, reference_ops):
    card = (export(run, tmp_path / "m", merged=True, base="nf4").out / "README.md").read_text()
    for text in (
        str(run.parent / "model"),
        "`data/train.jsonl` (alpaca)",
        f"{STEPS} of {STEPS}",
        "2.5000",
        "2.7500",
    ):
        assert text in card
    assert "r=4, alpha=8" in card and "NF4 round trip" in card and "bfloat16" in card
    # The projections that carry LoRA in this model, as adapter_config.json lists them.
    targets = json.loads((export(run, tmp_path / "t").out / "adapter_config.json").read_text())[
        "target_modules"
    ]
    assert f"targets {', '.join(targets)}; norms" in card
    adapter_card = (export(run, tmp_path / "a").out / "README.md").read_text()
    assert "PeftModel.from_pretrained" in adapter_card and "merged onto" not in adapter_card


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5 kb", 1500)]
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "", "0GB", "GB", "-1MB"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(QLoraError, match="--max-shard-size"):
        parse_size(text)


def error_line(result, exit_code: int = 2) -> str:
    code, _, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == exit_code and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ")
    return lines[0]


def test_cli_exports_the_newest_checkpoint(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen3")
    code, _, err = run_cli("export", output_dir, "--out", tmp_path / "adapter")
    assert code == 0 and "PEFT adapter" in err and f"checkpoint-{STEPS}" in err
    code, _, err = run_cli("export", output_dir / f"checkpoint-{STEPS}", "--out", tmp_path / "m", "--merged")
    assert code == 0 and "merged model (original base, bfloat16, 1 shard)" in err


def test_cli_errors_without_a_checkpoint(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    assert "holds no complete checkpoint" in error_line(
        run_cli("export", tmp_path / "empty", "--out", tmp_path / "o")
    )
    assert "does not exist" in error_line(run_cli("export", tmp_path / "missing", "--out", tmp_path / "o"))
    (tmp_path / "config.yaml").write_text("base_model: m\n")
    assert "config.yaml is a file; give a checkpoint-<step> folder or a run's output_dir" in error_line(
        run_cli("export", tmp_path / "config.yaml", "--out", tmp_path / "o")
    )


def test_cli_errors_when_the_base_is_gone(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    shutil.rmtree(output_dir.parent / "model")
    line = error_line(run_cli("export", output_dir, "--out", tmp_path / "o", "--merged"))
    assert "cannot find the base model" in line and "does not exist" in line
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_non_empty_out_unless_forced(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    assert "exists and is not empty" in error_line(run_cli("export", output_dir, "--out", out))
    assert (out / "old.txt").read_text() == "keep me"
    assert run_cli("export", output_dir, "--out", out, "--force")[0] == 0
    assert not (out / "old.txt").exists() and (out / "adapter_model.safetensors").is_file()
    line = error_line(run_cli("export", output_dir, "--out", output_dir, "--force"))
    assert "which the export reads" in line and (output_dir / f"checkpoint-{STEPS}").is_dir()


def test_cli_refuses_adapter_tensors_that_do_not_fit_the_base(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen3")
    path = output_dir / f"checkpoint-{STEPS}" / "adapter_model.safetensors"
    tensors = load_file(path)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[name] = tensors[name][:, :50].clone()
    save_file(tensors, path)
    as_written_before_manifests(path.parent)  # a manifest would refuse the checkpoint first
    line = error_line(run_cli("export", output_dir, "--out", tmp_path / "o", "--merged"))
    assert f"{name} has shape [4, 50], the model needs [4, 96]" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--merged", "--base", "bf16"], "--base: expected one of original, nf4"),
        (["--merged", "--dtype", "int8"], "--dtype: expected one of bfloat16"),
        (["--merged", "--max-shard-size", "big"], "--max-shard-size: expected a size"),
        (["--dtype", "float16"], "apply to merged exports only"),
    ],
)
def test_cli_refuses_bad_options(tmp_path, run_cli, args, message):
    assert message in error_line(run_cli("export", tmp_path / "run", "--out", tmp_path / "o", *args))


def test_nf4_base_needs_a_quantized_run(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2", load_in_4bit=False, adapter="lora")
    line = error_line(run_cli("export", output_dir, "--out", tmp_path / "o", "--merged", "--base", "nf4"))
    assert "trained on an unquantized base" in line


def test_cli_help_names_every_option(run_cli):
    code, out, _ = run_cli("export", "--help")
    assert code == 0
    for option in ("--out", "--merged", "--base", "--dtype", "--max-shard-size", "--force"):
        assert option in out


def test_a_base_that_breaks_midway_leaves_nothing_behind(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    weights = output_dir.parent / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "truncated or corrupt" in error_line(
        run_cli("export", output_dir, "--out", tmp_path / "o", "--merged")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def hidden_beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_files_put_in_out_during_the_export_are_kept(tmp_path, run_cli, monkeypatch):
    output_dir = make_run(tmp_path, "qwen2")
    out = tmp_path / "o"
    write_tokenizer = command.write_tokenizer

    def another_writer(config, base_folder, folder):
        write_tokenizer(config, base_folder, folder)
        out.mkdir(exist_ok=True)
        (out / "theirs.txt").write_text("keep me")

    monkeypatch.setattr(command, "write_tokenizer", another_writer)
    assert "was filled while the export ran" in error_line(run_cli("export", output_dir, "--out", out))
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and not hidden_beside(out)


def out_with_old_files(tmp_path: Path) -> Path:
    out = tmp_path / "o"
    (out / "locked").mkdir(parents=True)
    (out / "locked" / "old.bin").write_text("old")
    (out / "old.txt").write_text("old")
    return out


def test_force_keeps_the_export_when_the_old_out_cannot_be_deleted_whole(tmp_path, run_cli, monkeypatch):
    output_dir = make_run(tmp_path, "qwen2")
    out = out_with_old_files(tmp_path)
    rmtree = shutil.rmtree

    def refusing_rmtree(path, *args, **kwargs):  # stands for a subfolder the filesystem will not delete
        if (Path(path) / "locked").exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "locked" / "old.bin"))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refusing_rmtree)
    code, _, err = run_cli("export", output_dir, "--out", out, "--force")
    aside = tmp_path / f".o.old-export-{os.getpid()}"
    assert code == 0 and f"what is left of it is in {aside}" in " ".join(err.split()), err
    assert (out / "adapter_model.safetensors").is_file() and not (out / "old.txt").exists()
    assert (aside / "old.txt").read_text() == "old" and hidden_beside(out) == [aside.name]


def test_force_leaves_out_as_it_was_when_it_cannot_be_moved_aside(tmp_path, run_cli, monkeypatch):
    output_dir = make_run(tmp_path, "qwen2")
    out = out_with_old_files(tmp_path)
    rename = Path.rename

    def busy_out(path, target):  # stands for a mount point, which cannot be renamed
        if path == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return rename(path, target)

    monkeypatch.setattr(Path, "rename", busy_out)
    line = error_line(run_cli("export", output_dir, "--out", out, "--force"), exit_code=1)
    assert f"--out {out} could not be moved aside to be replaced (Device or resource busy)" in line
    assert sorted(p.name for p in out.iterdir()) == ["locked", "old.txt"] and not hidden_beside(out)


def test_a_symlink_out_is_refused_before_the_export(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    (tmp_path / "real").mkdir()
    for target in (tmp_path / "real", tmp_path / "gone"):
        link = tmp_path / "link"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        line = error_line(run_cli("export", output_dir, "--out", link))
        assert f"--out {link} is a symbolic link to {target}; give the folder's own path, {target}" in line
        assert not any((tmp_path / "real").iterdir()) and not (tmp_path / "gone").exists()
        assert not hidden_beside(link)


def test_an_export_removes_what_killed_exports_to_its_out_left(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead = int(gone.stdout)
    stale = [tmp_path / f".o.tmp-export-{dead}", tmp_path / f".o.old-export-{dead}"]
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        running = tmp_path / f".o.tmp-export-{live.pid}"
        for folder in (*stale, running, tmp_path / f".other.tmp-export-{dead}"):
            folder.mkdir()
            (folder / "model.bin").write_bytes(bytes(3000))
        code, _, err = run_cli("export", output_dir, "--out", tmp_path / "o")
        live.kill()
    err = " ".join(err.split())
    assert code == 0 and err.count("note:") == 2, err
    for folder in stale:
        assert f"removed {folder} (2.9 KiB), left by an export to the same --out killed midway" in err
    assert hidden_beside(tmp_path / "o") == [running.name]
    assert (tmp_path / f".other.tmp-export-{dead}" / "model.bin").is_file()


def test_an_out_inside_a_file_is_refused_naming_the_file(tmp_path, run_cli):
    output_dir = make_run(tmp_path, "qwen2")
    (tmp_path / "afile").write_text("mine")
    for out in (tmp_path / "afile" / "sub", tmp_path / "afile" / "sub" / "deeper"):
        line = error_line(run_cli("export", output_dir, "--out", out))
        assert f"--out {out} cannot be made: its parent {tmp_path / 'afile'} is a file, not a folder" in line
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_empty_out_is_refused(tmp_path, run_cli, monkeypatch):
    output_dir = make_run(tmp_path, "qwen2")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert "--out is empty" in error_line(run_cli("export", output_dir, "--out", ""))
    assert not any((tmp_path / "here").iterdir())
