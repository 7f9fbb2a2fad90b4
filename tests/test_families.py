"""`qlora train`, `resume`, `data` and `profile` on tiny Qwen3.5, Llama and Mistral checkpoints, each with
the chat template its family trains with: loss falls with packing and recompute, a resumed run equals the
uninterrupted one, the data report renders the family's template, the profile has the hybrid's rows."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import (
    load_transformers,
    subprocess_env,
    write_llama,
    write_mistral,
    write_qwen3_5,
    write_run,
)

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.ops import HYBRID_ROWS, MOE_ROWS, Op
from qlora_cli.export.gguf.architectures import architecture
from qlora_cli.model import QLoRAModel
from qlora_cli.sources import families
from qlora_cli.sources.families import Family
from qlora_cli.train.loop import train
from qlora_cli.train.run import build_run

pytestmark = pytest.mark.usefixtures("reference_ops")
ROOT = Path(__file__).resolve().parent.parent

# Each family's tiny checkpoint and the config keys its chats train with: Qwen3.5 with one Gated DeltaNet
# layer and one attention layer and its own thinking template; Llama and Mistral with the named
# templates their users pick (their tiny tokenizers ship none).
FAMILIES = {
    "qwen3_5": (functools.partial(write_qwen3_5, num_hidden_layers=2, full_attention_interval=2), {}),
    "llama": (write_llama, {"chat_template": "llama3"}),
    "mistral": (write_mistral, {"chat_template": "mistral_v2v3"}),
}
# What a rendered training chat of each family starts its answer with (Qwen3.5's template opens a think
# block, empty here, in the current turn).
ANSWER_HEADER = {
    "qwen3_5": "<|im_start|>assistant\n<think>\n",
    "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[/INST]",
}
SMALL = dict(rows=12, sequence_len=96, micro_batch_size=2, sample_packing=True, learning_rate=3e-3)


def _write(tmp_path: Path, family: str, name: str = "run", **config) -> Path:
    writer, keys = FAMILIES[family]
    return write_run(tmp_path / name, model_writer=writer, **{**SMALL, **keys, **config})


def _losses(output_dir: Path) -> list[float]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trains_with_packing_and_recompute(family, tmp_path):
    config = load_config(_write(tmp_path, family, max_steps=6, gradient_checkpointing=True))
    result = train(config)
    losses = _losses(result.output_dir)
    assert len(losses) == 6 and max(losses[-2:]) < min(losses[:2])
    assert (result.output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_is_exact(family, tmp_path, one_thread):
    """With LoRA dropout on every projection group of both layer kinds (each its own salt): 4 steps
    in one go equal 2 steps, then `qlora resume` in a fresh process to 4, bit for bit."""
    common = dict(
        gradient_checkpointing=True,
        gradient_accumulation_steps=2,
        lora_dropout=0.1,
        lr_scheduler="constant",
        warmup_steps=0,
    )
    whole = train(load_config(_write(tmp_path, family, "whole", max_steps=4, **common)))
    half = train(load_config(_write(tmp_path, family, "half", max_steps=2, **common)))
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_cli", "resume", str(half.output_dir), "--set", "max_steps=4"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert _losses(half.output_dir) == _losses(whole.output_dir)
    adapter = "adapter_model.safetensors"
    assert (half.output_dir / adapter).read_bytes() == (whole.output_dir / adapter).read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_data_show_renders_the_familys_template(family, tmp_path, run_cli):
    code, out, err = run_cli("data", _write(tmp_path, family), "--show", "1")
    assert code == 0, err
    assert "example 0" in out and ANSWER_HEADER[family] in out
    assert all(header not in out for other, header in ANSWER_HEADER.items() if other != family)


def test_profile_shows_the_gated_deltanet_rows(tmp_path, run_cli):
    """The hybrid's conv, delta rule and gates have rows, forward and backward; a Llama's table leaves
    them out, and neither shows the mixture-of-experts rows."""
    for family in ("qwen3_5", "llama"):
        config = _write(tmp_path, family, family, max_steps=2, gradient_checkpointing=True)
        report = tmp_path / f"{family}.json"
        code, out, err = run_cli("profile", config, "--steps", 1, "--warmup", 0, "--json", report)
        assert code == 0, err
        rows = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
        assert not set(MOE_ROWS) & set(rows)
        if family == "qwen3_5":
            assert all(rows[op]["calls"] > 0 and rows[op]["ms"] > 0 for op in HYBRID_ROWS)
            assert all(f"\n{op.value} " in out or f" {op.value} " in out for op in HYBRID_ROWS)
        else:
            assert not set(HYBRID_ROWS) & set(rows) and Op.ATTENTION in rows


@pytest.mark.parametrize("window", [64, 96, None])
def test_a_mistral_sliding_window_at_least_sequence_len_trains(window, tmp_path):
    writer = functools.partial(write_mistral, sliding_window=window)
    path = write_run(tmp_path / "run", model_writer=writer, **SMALL, **FAMILIES["mistral"][1], max_steps=1)
    config = load_config(path)
    if window is not None and window < config.sequence_len:
        with pytest.raises(QLoraError) as refused:
            build_run(config)
        assert str(refused.value) == (
            f"sliding_window {window} < sequence_len 96: qlora's training attention has no sliding window; "
            f"set sequence_len <= {window}"
        )
    else:
        assert train(config).step == 1


def test_qlora_data_refuses_a_sliding_window_shorter_than_the_rows_as_train_does(tmp_path, run_cli):
    """qlora data plans the rows qlora train would, so it stops where train stops, in the same line."""
    writer = functools.partial(write_mistral, sliding_window=64)
    path = write_run(tmp_path / "run", model_writer=writer, **SMALL, **FAMILIES["mistral"][1], max_steps=1)
    code, _, err = run_cli("data", path)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "sliding_window 64 < sequence_len 96: qlora's training attention has no sliding window; "
        "set sequence_len <= 64"
    ), err


def test_a_llama_with_attention_and_mlp_bias_matches_transformers_and_trains(tmp_path):
    """attention_bias puts a bias on q, k, v and o; mlp_bias on gate, up and down: all loaded."""
    writer = functools.partial(write_llama, attention_bias=True, mlp_bias=True)
    path = write_run(tmp_path / "run", model_writer=writer, **SMALL, max_steps=2)
    folder = tmp_path / "run" / "model"
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    groups = ours.layers[0].projections
    assert all(bias is not None for g in ("qkv", "o", "gate_up", "down") for bias in groups[g].biases)
    ids = torch.randint(0, ours.spec.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - load_transformers(folder)(ids).logits).abs().max().item() < 1e-4
    assert train(load_config(path, ["chat_template=llama3"])).step == 2


def test_a_head_larger_than_the_attention_kernels_take_is_refused_before_loading(tmp_path, run_cli):
    """head_dim 512 (over kernels.attention's 256): one line naming it, exit 2, from `qlora train` and
    from loading the model for generation, before any weights stream in."""
    writer = functools.partial(write_llama, head_dim=512)
    path = write_run(tmp_path / "run", model_writer=writer, **SMALL, max_steps=1)
    code, out, err = run_cli("train", path)
    line = "config.json: head_dim 512 is above 256, the largest head qlora's attention takes"
    assert code == 2 and line in err and "Traceback" not in err + out
    assert not (tmp_path / "run" / "outputs" / "checkpoint-1").exists()
    with pytest.raises(QLoraError, match=line):
        QLoRAModel.from_pretrained(tmp_path / "run" / "model")


def test_targets_naming_no_projection_of_the_model_are_one_line_before_its_weights_load(
    tmp_path, run_cli, monkeypatch
):
    """Qwen3.5's Gated DeltaNet projections on a Llama would leave LoRA nothing to train."""

    def loaded(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(QLoRAModel, "from_pretrained", loaded)
    config = _write(tmp_path, "llama", lora_target_modules=["in_proj_qkv", "in_proj_z"])
    for command in ("train", "data"):
        code, _, err = run_cli(command, config)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0] == (
            "error: config key 'lora_target_modules': in_proj_qkv, in_proj_z names no projection of this "
            "llama model; its layers have q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
        )


def test_a_family_that_reuses_llamas_layers_is_one_row(tmp_path, monkeypatch):
    """A new model_type with a row of its own, and nothing else, reads, loads and runs as Llama does:
    the logits of transformers' Llama on the same weights."""
    folder = write_llama(tmp_path / "model", attention_bias=True, mlp_bias=True)
    theirs = load_transformers(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "test_llama"}))
    with pytest.raises(QLoraError, match="model_type 'test_llama' is not supported"):
        QLoRAModel.from_pretrained(folder)

    row = Family(("test_llama",), "Test Llama", "LLAMA", reads_mlp_bias=True)
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, row))
    ours = QLoRAModel.from_pretrained(folder, quantize=False).eval()
    assert (ours.spec.model_type, ours.spec.attention_bias, ours.spec.mlp_bias) == ("test_llama", True, True)
    assert architecture(ours.spec).arch == "LLAMA"
    ids = torch.randint(0, ours.spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
