"""The benchmarks time with the profiler's helper and write their numbers as JSON beside the text."""

import json
import re
import subprocess
import sys

import pytest
import torch
from checkpoints import REPO_ROOT, subprocess_env, write_qwen2


def test_compare_writes_its_numbers_as_json(tmp_path):
    """qlora's eager runner on the CPU (the GPU runs all four): each step timed on its own, tokens/s
    from the median step, the same numbers in the JSON file as on stdout."""
    checkpoint = write_qwen2(tmp_path / "model")
    out = tmp_path / "results" / "compare.json"
    command = [sys.executable, "-m", "benchmarks.compare", str(checkpoint), "--device", "cpu"]
    command += ["--runners", "qlora-eager", "--batch", "1", "--seq", "32", "--steps", "3", "--warmup", "1"]
    proc = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    printed = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("JSON "))[5:])
    assert data["results"] == printed
    assert data["command"].startswith("python -m benchmarks.compare ") and data["device"] == "cpu"
    result = data["results"]["qlora-eager"]
    assert 0 < result["step_ms_min"] <= result["step_s"] * 1e3
    assert result["tokens_per_s"] == pytest.approx(32 / result["step_s"])


def test_generate_benchmark_times_qlora_decoding(tmp_path, monkeypatch):
    """benchmarks.generate's qlora side on the CPU (the GPU runs it against the baselines): exactly
    new_tokens per row, the rates computed from the timed generate, and ratios against a baseline."""
    from benchmarks.generate import qlora_decode, qlora_model, ratios

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = qlora_model(write_qwen2(tmp_path / "model"), device="cpu")
    result = qlora_decode(model, batch=2, prompt_len=8, new_tokens=5)
    assert result["decode_tokens_per_s"] == pytest.approx(2 * 5 / result["generate_s"])
    assert result["ttft_s"] > 0 and result["generate_s"] > 0  # a busy CPU may time one token longer than five
    baseline = {"decode_tokens_per_s": result["decode_tokens_per_s"] / 4, "ttft_s": result["ttft_s"] * 2}
    assert ratios({"qlora": result, "hf": baseline}) == pytest.approx({"speed_vs_hf": 4.0, "ttft_vs_hf": 0.5})
    assert any(".lora_B." in name and param.abs().sum() > 0 for name, param in model.named_parameters())


def test_alpaca_shaped_rows_are_fixed_by_their_seed():
    from benchmarks.alpaca_shaped import INPUT_SHARE, alpaca_rows

    rows = alpaca_rows(2000, seed=1)
    assert rows == alpaca_rows(2000, seed=1) and rows != alpaca_rows(2000, seed=2)
    assert all(set(r) == {"instruction", "input", "output"} for r in rows)
    with_input = sum(bool(r["input"]) for r in rows) / len(rows)
    assert abs(with_input - INPUT_SHARE) < 0.04
    lengths = sorted(len(r["output"].split()) for r in rows)
    assert 40 < lengths[len(lengths) // 2] < 90 and lengths[-1] > 4 * lengths[len(lengths) // 2]


def test_steady_tokens_per_s_leaves_out_the_warm_up():
    from benchmarks.e2e import steady

    steps = [{"seconds": 10.0, "trained_tokens": 10, "input_tokens": 20}] + [
        {"seconds": 1.0, "trained_tokens": 100, "input_tokens": 400}
    ] * 3
    assert steady(steps, 1) == {"trained_tokens_per_s": 100.0, "tokens_per_s": 400.0, "timed_steps": 3}
    assert steady(steps[:1], 1)["timed_steps"] == 1


def test_unsloth_adapts_what_the_config_adapts_in_qlora(tmp_path):
    """lora_target_linear: every decoder linear of a Qwen3.5, its Gated DeltaNet's projections too, as
    qlora adapts them; lora_target_modules: those names alone."""
    from checkpoints import write_qwen3_5

    from benchmarks.e2e import unsloth_targets

    checkpoint = write_qwen3_5(tmp_path / "model", num_hidden_layers=2, full_attention_interval=2)
    every = unsloth_targets({"lora_target_linear": True}, checkpoint)
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "down_proj"} <= set(
        every
    )
    assert len(every) == 12
    assert unsloth_targets({"lora_target_modules": ["v_proj", "q_proj"]}, checkpoint) == ["q_proj", "v_proj"]


def test_e2e_runs_qlora_train_on_alpaca_shaped_rows(tmp_path):
    """The qlora runner on the CPU with the demo's config and model: the real command line on rows it
    writes, its numbers read from the run's metrics, the same numbers in the JSON file."""
    out = tmp_path / "e2e.json"
    command = [sys.executable, "-m", "benchmarks.e2e", "--config", "configs/demo.yaml"]
    command += [
        "--checkpoint",
        "configs/demo/tiny-qwen3",
        "--rows",
        "120",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
    ]
    command += ["--runners", "qlora", "--workdir", str(tmp_path / "work"), "--json", str(out)]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"]["qlora"]
    assert result["steps"] == 3 and result["timed_steps"] == 2
    assert 0 < result["trained_tokens_per_s"] < result["tokens_per_s"]
    assert 0 < result["startup_s"] < result["wall_s"]
    assert set(result["startup_parts_s"]) == {"startup_data_s", "startup_model_s"}
    assert (tmp_path / "work" / "alpaca-120-0.jsonl").is_file()
    assert "qlora train" in proc.stdout


def test_packed_attention_rows_and_the_ideal_speedup():
    import torch

    from benchmarks.packed_attention import ideal_speedup, packed_doc_ids

    doc_ids = packed_doc_ids(2, 4096, seed=0)
    assert doc_ids.shape == (2, 4096) and torch.equal(doc_ids, packed_doc_ids(2, 4096, seed=0))
    assert (doc_ids.diff(dim=1) >= 0).all() and 5 < doc_ids[0].max() < 40
    assert ideal_speedup(torch.zeros(1, 100, dtype=torch.int32)) == 1.0
    halves = torch.tensor([[0] * 50 + [1] * 50])
    assert ideal_speedup(halves) == (100 * 101 / 2) / (2 * 50 * 51 / 2)
    assert ideal_speedup(doc_ids) > 5


def test_compare_trains_every_linear_of_a_hybrid_model(tmp_path):
    """On a Qwen3.5, LoRA goes on the Gated DeltaNet layers' five projections too, for every runner,
    MFU counts the attention of its full layers and the delta rule of the others, and qlora's runner
    trains it."""
    from checkpoints import write_qwen3_5

    from benchmarks.compare import lora_targets, model_flops_per_token
    from qlora_cli.sources.model_config import read_spec

    checkpoint = write_qwen3_5(tmp_path / "model", num_hidden_layers=2, full_attention_interval=2)
    assert lora_targets(checkpoint) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    )
    # MFU's count of a Qwen3.5: its projections, lm_head, one attention layer, one delta rule.
    spec = read_spec(checkpoint)
    dense = sum(o * i for kind in spec.layer_types for o, i in spec.projection_shapes(kind).values())
    attention = 3 * 2 * 2 * spec.num_heads * spec.head_dim * 64 / 2
    delta_rule = 3 * 6 * 4 * 16 * 16  # 3 x (three rank-1 products of 16 x 16) x 4 value heads
    expected = 4 * (dense + spec.vocab_size * spec.hidden_size) + attention + delta_rule
    assert model_flops_per_token(json.loads((checkpoint / "config.json").read_text()), 64) == expected
    losses = []
    for packed in ("0", "8"):
        out = tmp_path / f"packed-{packed}.json"
        command = [sys.executable, "-m", "benchmarks.compare", str(checkpoint), "--device", "cpu"]
        command += [
            "--runners",
            "qlora-eager",
            "--batch",
            "1",
            "--seq",
            "32",
            "--steps",
            "1",
            "--warmup",
            "0",
        ]
        command += ["--packed", packed, "--json", str(out)]
        proc = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "qlora, no graphs" in proc.stdout and "failed" not in proc.stdout
        losses.append(json.loads(out.read_text())["results"]["qlora-eager"]["loss"])
    # Packed into documents of 8 tokens, the same rows see shorter contexts: another loss.
    assert abs(losses[0] - losses[1]) > 1e-4


def test_qwen3_5_27b_shape_has_the_published_tensors():
    """Qwen3.6-27B's published listing has 1199 tensors: this text decoder's 851, a 27-block vision
    tower's 333 (12 a block, 3 patch and position, 6 merger) and an MTP head's 15 (4 + one 11-tensor
    attention layer); the shapes below are from that listing."""
    from benchmarks.shapes import model_config
    from qlora_cli.sources.model_config import spec_from_config

    tensors = spec_from_config(model_config("qwen3.5-27b")).expected_tensors()
    assert len(tensors) == 1199 - (27 * 12 + 3 + 6) - (4 + 11)
    assert tensors["model.layers.0.linear_attn.in_proj_qkv.weight"] == (10240, 5120)
    assert tensors["model.layers.0.linear_attn.in_proj_z.weight"] == (6144, 5120)
    assert tensors["model.layers.0.linear_attn.in_proj_b.weight"] == (48, 5120)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert tensors["model.layers.0.linear_attn.out_proj.weight"] == (5120, 6144)
    assert tensors["model.layers.3.self_attn.q_proj.weight"] == (12288, 5120)
    assert tensors["model.layers.3.self_attn.k_proj.weight"] == (1024, 5120)
    assert tensors["model.layers.3.self_attn.o_proj.weight"] == (5120, 6144)
    assert tensors["model.layers.63.mlp.gate_proj.weight"] == (17408, 5120)


def test_llama_and_mistral_shapes_have_their_published_sizes():
    """Llama 3.1 8B has 8,030,261,248 parameters; Mistral Small 24B's attention is 32 x 128 = 4096 wide
    against a 5120 residual stream."""
    from benchmarks.shapes import model_config
    from qlora_cli.sources.model_config import spec_from_config

    llama = spec_from_config(model_config("llama-3.1-8b")).expected_tensors()
    assert sum(torch.Size(shape).numel() for shape in llama.values()) == 8_030_261_248
    mistral = spec_from_config(model_config("mistral-small-24b")).expected_tensors()
    assert mistral["model.layers.0.self_attn.q_proj.weight"] == (4096, 5120)
    assert mistral["model.layers.39.self_attn.o_proj.weight"] == (5120, 4096)


def test_the_recipe_shapes_have_their_published_sizes():
    """Qwen3-0.6B 596,049,920 parameters (tied head), Qwen3-8B 8,190,735,360, Mistral-7B-v0.3 7,248,023,552."""
    from benchmarks.shapes import model_config
    from qlora_cli.sources.model_config import spec_from_config

    published = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "mistral-7b": 7_248_023_552}
    for shape, parameters in published.items():
        tensors = spec_from_config(model_config(shape)).expected_tensors()
        assert sum(torch.Size(s).numel() for s in tensors.values()) == parameters, shape


def test_every_recipe_reads_the_rows_and_tokenizer_the_recipe_benchmark_writes(tmp_path, run_cli):
    """benchmarks.recipes gives each shipped config rows in its dataset format and a tokenizer holding
    its chat template's tokens: `qlora data` takes them with the config's own settings, and trains
    tokens of every recipe (no weights needed)."""
    import json
    import shutil

    import yaml

    from benchmarks.random_checkpoint import DEMO_TOKENIZER
    from benchmarks.recipes import CONFIGS, add_template_tokens, write_recipe_rows
    from benchmarks.shapes import model_config

    assert {c.stem for c in CONFIGS} == {
        "llama-3.1-8b",
        "mistral-7b",
        "qwen2.5-0.5b",
        "qwen2.5-7b",
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-30b-a3b",
        "qwen3.5-27b",
        "qwen3.5-35b-a3b",
        "qwen3.5-9b",
    }
    for config in CONFIGS:
        settings = yaml.safe_load(config.read_text())
        folder = tmp_path / config.stem
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(model_config(config.stem, 4)))
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO_TOKENIZER / file, folder / file)
        add_template_tokens(folder, settings.get("chat_template"))
        rows = write_recipe_rows(folder / "rows.jsonl", settings["datasets"][0], 40)
        code, out, err = run_cli(
            "data", config, "--set", f"base_model={folder}", "--set", f"datasets.0.path={rows}"
        )
        assert code == 0, f"{config.name}: {err}"
        assert re.search(r"[1-9][\d,]* \(\d+%\)", out), f"{config.name} trains no token:\n{out}"


def test_compare_draws_a_random_base_for_qlora_alone(tmp_path):
    """`random:SHAPE:LAYERS` trains qlora's runner on weights drawn in memory, and the planner's
    estimate comes with it; a runner that loads a folder says so in one line."""
    command = [sys.executable, "-m", "benchmarks.compare", "random:qwen2.5-0.5b:1", "--device", "cpu"]
    command += ["--runners", "qlora-eager,hf", "--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "0"]
    out = tmp_path / "random.json"
    command += ["--json", str(out)]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    refusal = "HF+PEFT+bnb loads a checkpoint folder; random:qwen2.5-0.5b:1 is drawn by qlora's runners only"
    assert refusal in proc.stdout
    runs = json.loads(out.read_text())["results"]
    assert set(runs) == {"qlora-eager"}
    assert 0 < runs["qlora-eager"]["loss"] < 20 and runs["qlora-eager"]["estimated_peak_gib"] > 0


def test_grouped_nf4_routing_gives_each_token_top_k_distinct_experts():
    from benchmarks.grouped_nf4 import routed_offsets

    offsets = routed_offsets(100, 16, 4, torch.Generator().manual_seed(0))
    counts = offsets.diff()
    assert offsets[0] == 0 and offsets[-1] == 400 and offsets.shape == (17,)
    assert (counts >= 0).all() and counts.max() <= 100


def test_kernel_lines_show_the_longest_kernels_and_sum_the_rest():
    from benchmarks.kernel_table import kernel_lines

    lines = kernel_lines({"gemm": 6.0, "scan": 3.0, "norm": 0.6, "copy": 0.4}, top=2)
    assert lines[0].endswith("total 10.000")
    assert lines[1].split() == ["6.000", "60.0%", "gemm"]
    assert lines[2].split() == ["3.000", "30.0%", "scan"]
    assert lines[3].split() == ["1.000", "10.0%", "2", "other", "kernels"]
    assert len(kernel_lines({"gemm": 6.0}, top=2)) == 2


def test_live_bytes_counts_a_storage_until_it_dies():
    """A view adds nothing and keeps its storage counted; a freed storage leaves the count; a view of
    a tensor made before, or an op in place on it, counts nothing."""
    from benchmarks.live_bytes import LiveBytes

    before = torch.zeros(4000, dtype=torch.uint8)
    with LiveBytes() as counter:
        before.view(40, 100).t().add_(1)
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(500, dtype=torch.uint8)
        view = a[10:]
        del a
        c = torch.empty(200, dtype=torch.uint8)
        del view, b
        d = torch.empty(300, dtype=torch.uint8)
    assert (counter.peak, counter.now) == (1700, 500)
    assert c.numel() + d.numel() == 500
