"""qlora generate: our cached decoding of the NF4 base + adapter equals transformers' greedy decoding of
the merged (NF4 round trip) export, token for token, for Qwen2, Qwen3 and Qwen3.5 (text and VL layouts,
Gated DeltaNet states beside the KV cache); batching changes nothing; sampling repeats with its seed; bad
input ends in one line."""

import functools
import io
import json
import math
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from checkpoints import (
    DEMO_TOKENIZER,
    add_demo_tokenizer,
    load_transformers,
    write_llama3_tokenizer,
    write_mistral,
    write_qwen2,
    write_qwen3,
    write_qwen3_5,
    write_run,
)
from safetensors.torch import load_file, save_file

from qlora_cli.config.loading import config_from_dict, load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.export.command import export
from qlora_cli.generate import command as generate_command
from qlora_cli.generate.chat import TextStream
from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.generate.sampling import Completion, Sampler, Sampling, generate_ids
from qlora_cli.generate.source import load_source
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import lora_config, select_device
from qlora_cli.rundir.checkpoint import save_checkpoint
from qlora_cli.rundir.trainer_state import TrainerState
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import stop_ids
from qlora_cli.train.loop import train
from qlora_kernels import nf4_matvec
from qlora_kernels.formats import NF4

pytestmark = pytest.mark.usefixtures("reference_ops")
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "How many seconds are in 6 minutes?",
    "Hi",
    "Sort these words alphabetically: rose, dog, wolf, bread, moon, and then say them backwards please",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The shipped demo config, trained for two steps."""
    folder = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        return train_demo(folder)


def train_demo(folder: Path) -> Path:
    overrides = [
        f"output_dir={folder / 'out'}",
        f"base_model={ROOT / 'configs' / 'demo' / 'tiny-qwen3'}",
        f"datasets.0.path={ROOT / 'configs' / 'demo' / 'data' / 'train.jsonl'}",
        "max_steps=2",
        "save_steps=2",
        "val_set_size=0",
        "warmup_steps=0",
    ]
    return train(load_config(ROOT / "configs" / "demo.yaml", overrides)).output_dir


WRITERS = {
    "qwen3": write_qwen3,
    "qwen2": write_qwen2,
    "qwen3_5": write_qwen3_5,
    "qwen3_5-vl": functools.partial(write_qwen3_5, layout="vl"),
}
# Families with attention only (the tests of options and errors run on these) and every family (the
# tests of what the decoding computes).
ATTENTION_ONLY = ["qwen3", "qwen2"]
FAMILIES = [*ATTENTION_ONLY, "qwen3_5", "qwen3_5-vl"]


def random_run(folder: Path, kind: str = "qwen3") -> Path:
    """A random tiny model with the demo tokenizer and a random NF4-trained adapter: every token varies,
    so greedy decoding takes many different paths (a trained demo this short repeats itself)."""
    base = add_demo_tokenizer(WRITERS[kind](folder / "model", vocab_size=1024, max_position_embeddings=512))
    slow_decay(base)
    raw = {
        "base_model": str(base),
        "datasets": [{"path": "data.jsonl", "type": "chat_template"}],
        "lora_r": 4,
        "device": "cpu",
        "output_dir": str(folder / "out"),
        **({"lora_target_modules": ["q_proj", "v_proj", "down_proj"]} if kind == "qwen2" else {}),
    }
    config = config_from_dict(raw)
    model = QLoRAModel.from_pretrained(base, quantize=True, lora=lora_config(config))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.trainable_parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    state = TrainerState(1, total_steps=1, compute_dtype="float32")
    optimizer = torch.optim.AdamW(model.trainable_parameters())
    save_checkpoint(Path(config.output_dir), 1, model, optimizer, state, config)
    return Path(config.output_dir)


def slow_decay(base: Path) -> None:
    """Gated DeltaNet layers that remember: random A_log ~ 0 halves the state every token, so prompts
    ending in the same chat-template suffix would continue alike; A = exp(A_log) ~ 0.05 keeps ~97 %."""
    tensors = load_file(base / "model.safetensors")
    decays = [name for name in tensors if name.endswith("linear_attn.A_log")]
    for name in decays:
        tensors[name] = torch.full_like(tensors[name], math.log(0.05))
    if decays:
        save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """random_run of a family, made once per module."""
    made = {}

    def run_of(kind: str) -> Path:
        if kind not in made:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("TRITON_INTERPRET", "0")
                made[kind] = random_run(tmp_path_factory.mktemp(kind), kind)
        return made[kind]

    return run_of


@pytest.fixture(scope="module", params=ATTENTION_ONLY)
def run(request, runs):
    return runs(request.param)


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, runs):
    return runs(request.param)


def transformers_greedy(merged: Path, raw: bool, stop_ids: set[int]) -> list[tuple[int, list[int]]]:
    """(prompt length, new token ids without the stop token) per prompt, one at a time, by transformers."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = load_transformers(merged)
    results = []
    for prompt in PROMPTS:
        text = (
            prompt
            if raw
            else tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        )
        ids = tokenizer(text, add_special_tokens=False).input_ids
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=sorted(stop_ids),
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()
        results.append((len(ids), out[:-1] if out and out[-1] in stop_ids else out))
    return results


def ours(run_cli, source: Path, out: Path, *args) -> list[dict]:
    prompts = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
    code, stdout, err = run_cli(
        "generate", source, *prompts, "--out", out, "--max-new-tokens", NEW_TOKENS, "--device", "cpu", *args
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert stdout == "".join(row["completion"] + "\n" for row in rows)
    assert "first token after" in err
    return rows


def check_equal_to_transformers(source: Path, tmp_path: Path, run_cli, raw: bool) -> None:
    merged = export(source, tmp_path / "merged", merged=True, base="nf4", dtype="float32").out
    loaded = load_source(source, device="cpu")
    expected = transformers_greedy(merged, raw, loaded.stop_ids)
    rows = ours(run_cli, source, tmp_path / "out.jsonl", *(["--raw"] if raw else []))
    assert len({length for length, _ in expected}) == len(PROMPTS)
    for row, (prompt_tokens, ids), prompt in zip(rows, expected, PROMPTS, strict=True):
        assert row["prompt"] == prompt
        assert row["prompt_tokens"] == prompt_tokens
        assert row["completion_tokens"] == len(ids)
        assert row["completion"] == loaded.tokenizer.decode(ids)
        assert row["finish_reason"] == ("length" if len(ids) == NEW_TOKENS else "stop")


@pytest.mark.parametrize("raw", [False, True])
def test_trained_demo_equals_transformers_on_the_merged_export(demo_run, tmp_path, run_cli, raw):
    check_equal_to_transformers(demo_run, tmp_path, run_cli, raw)


@pytest.mark.parametrize("raw", [False, True])
def test_random_adapter_equals_transformers_on_the_merged_export(family_run, tmp_path, run_cli, raw):
    check_equal_to_transformers(family_run, tmp_path, run_cli, raw)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len({row["completion"] for row in rows}) == len(PROMPTS)
    assert all(len(set(row["completion"])) > 3 for row in rows)


def test_batched_generation_equals_one_by_one(family_run):
    loaded = load_source(family_run, device="cpu")
    engine = DecodingEngine(loaded.model)
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    together = generate_ids(engine, prompts, sampling, loaded.stop_ids)
    alone = [generate_ids(engine, [prompt], sampling, loaded.stop_ids)[0] for prompt in prompts]
    assert [c.ids for c in together] == [c.ids for c in alone]
    assert all(len(c.ids) > 0 for c in together)


def test_a_mistral_generates_within_its_sliding_window_over_a_longer_prompt(tmp_path, run_cli):
    """sliding_window 32 under prompts of 3 and 5 windows, packed together in the prefill: each greedy
    answer equals transformers' Mistral with the window (past it in the prefill and in every decode step),
    which differs from the same model's without it."""
    from transformers import AutoModelForCausalLM

    window = 32
    base = write_mistral(tmp_path / "model", sliding_window=window, max_position_embeddings=512)
    config = write_run(
        tmp_path, model_writer=lambda folder: base, load_in_4bit=False, adapter="lora", sequence_len=window
    )
    words = [
        "the",
        "capital",
        "of",
        "France",
        "is",
        "Paris",
        "and",
        "12345",
        "apples",
        "with",
        "678",
        "pears",
    ]
    texts = [" ".join(words[i % len(words)] for i in range(count)) for count in (28, 46)]
    tokenizer = ChatTokenizer.from_folder(base)
    lengths = [len(tokenizer.encode(text)) for text in texts]
    assert 3 * window <= lengths[0] < 4 * window and 5 * window <= lengths[1] < 6 * window

    def greedy(model, text: str) -> list[int]:
        ids = torch.tensor([tokenizer.encode(text)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
        return out[:-1] if out and out[-1] == tokenizer.eos_token_id else out

    windowed = [greedy(load_transformers(base), text) for text in texts]
    unwindowed_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, sliding_window=None)
    assert [greedy(unwindowed_model.eval(), text) for text in texts] != windowed
    out = tmp_path / "out.jsonl"
    prompts = [arg for text in texts for arg in ("--prompt", text)]
    code, _, err = run_cli(
        "generate", config, "--base-only", "--raw", *prompts, "--max-new-tokens", NEW_TOKENS,
        "--device", "cpu", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt_tokens"] for row in rows] == lengths
    assert [row["completion_tokens"] for row in rows] == [len(ids) for ids in windowed]
    assert [row["completion"] for row in rows] == [tokenizer.decode(ids) for ids in windowed]


def test_sampling_repeats_with_its_seed(run, tmp_path, run_cli):
    sample = ["--temperature", "1.0", "--top-p", "0.95", "--top-k", "50"]
    first = ours(run_cli, run, tmp_path / "a.jsonl", *sample, "--seed", "5")
    again = ours(run_cli, run, tmp_path / "b.jsonl", *sample, "--seed", "5")
    other = ours(run_cli, run, tmp_path / "c.jsonl", *sample, "--seed", "6")
    greedy = ours(run_cli, run, tmp_path / "d.jsonl")
    one_choice = ours(run_cli, run, tmp_path / "e.jsonl", "--temperature", "2.0", "--top-k", "1")
    assert first == again
    assert [r["completion"] for r in first] != [r["completion"] for r in other]
    assert [r["completion"] for r in first] != [r["completion"] for r in greedy]
    assert one_choice == greedy


def test_sampled_batches_draw_on_from_one_stream(run, tmp_path, run_cli):
    """The same prompt in two batches gets other samples in the second (best-of-N), where each batch
    seeded anew repeated the first's draws."""
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(
        "generate", run, *["--prompt", PROMPTS[0]] * 4, "--out", out, "--max-new-tokens", NEW_TOKENS,
        "--device", "cpu", "--temperature", "2.0", "--batch-size", "2", "--seed", "3",
    )  # fmt: skip
    assert code == 0, err
    completions = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert completions[:2] != completions[2:]


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-3])
def test_a_tiny_temperature_samples_the_likeliest_token(temperature):
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.999], [80.0, -80.0, 79.0, 0.0]]) * 1e3
    for top_p, top_k in [(1.0, 0), (0.9, 2)]:
        sampler = Sampler(Sampling(temperature=temperature, top_p=top_p, top_k=top_k), torch.device("cpu"))
        assert sampler(logits).tolist() == [1, 0]


def _kept(probs, temperature=1.0, **sampling):
    """The tokens a sampler ever draws in 4000 rows of these probabilities: every kept token has a
    renormalised probability of at least 1/16 here, so 4000 draws miss one with odds below 1e-100."""
    logits = torch.tensor(probs).log().repeat(4000, 1)
    return set(Sampler(Sampling(temperature=temperature, **sampling), torch.device("cpu"))(logits).tolist())


HALVING = [0.5, 0.25, 0.125, 0.0625, 0.0625]


@pytest.mark.parametrize(
    ("probs", "sampling", "kept"),
    [
        (HALVING, {}, {0, 1, 2, 3, 4}),
        # top-p keeps the fewest likeliest tokens that reach p, the one that crosses it included
        (HALVING, {"top_p": 0.74}, {0, 1}),
        (HALVING, {"top_p": 0.76}, {0, 1, 2}),
        (HALVING, {"top_p": 0.4}, {0}),
        ([0.3, 0.3, 0.3, 0.1], {"top_p": 0.65}, {0, 1, 2}),
        # top-k keeps the k likeliest and every token tied with the k-th, as transformers does
        (HALVING, {"top_k": 2}, {0, 1}),
        ([0.4, 0.2, 0.2, 0.1, 0.1], {"top_k": 2}, {0, 1, 2}),
        ([0.4, 0.2, 0.2, 0.1, 0.1], {"top_k": 1}, {0}),
        # top-p reads the probabilities top-k leaves: 4/7 alone reaches 0.5, 0.4 alone would not
        ([0.4, 0.3, 0.2, 0.1], {"top_k": 2, "top_p": 0.5}, {0}),
        ([0.4, 0.3, 0.2, 0.1], {"top_p": 0.5}, {0, 1}),
    ],
)
def test_top_p_and_top_k_keep_exactly_their_tokens(probs, sampling, kept):
    assert _kept(probs, **sampling) == kept


def test_top_p_after_temperature_and_between_tied_tokens():
    """Temperature 2 flattens 1/2, 1/4 to 0.37, 0.26 (square roots, renormalised), so 0.45 needs two
    tokens; three tied at 0.3 under p 0.5 keep two of them, whichever sort puts first."""
    assert _kept(HALVING[:3] + [0.125], top_p=0.45) == {0}
    assert _kept(HALVING[:3] + [0.125], temperature=2.0, top_p=0.45) == {0, 1}
    tied = _kept([0.3, 0.3, 0.3, 0.1], top_p=0.5)
    assert len(tied) == 2 and tied < {0, 1, 2}


def test_prompt_file_takes_prompts_and_chats(run, tmp_path, run_cli):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    file = tmp_path / "prompts.jsonl"
    file.write_text(json.dumps({"prompt": PROMPTS[1]}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli("generate", run, "--prompts", file, "--out", out, "--max-new-tokens", 5)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["prompt"] == PROMPTS[1] and rows[1]["messages"] == chat
    loaded = load_source(run, device="cpu")
    rendered = loaded.tokenizer.render_chat(chat, add_generation_prompt=True)
    assert rows[1]["prompt_tokens"] == len(loaded.tokenizer.encode(rendered))
    code, _, err = run_cli(
        "generate", run, "--prompt", PROMPTS[0], "--system", "Be brief.", "--out", out, "--max-new-tokens", 5
    )
    assert code == 0, err
    assert json.loads(out.read_text())["completion"] == rows[1]["completion"]


def test_out_is_checked_before_loading_and_keeps_the_rows_of_finished_batches(
    run, tmp_path, run_cli, monkeypatch
):
    (tmp_path / "file").write_text("")
    for out in (tmp_path, tmp_path / "file" / "out.jsonl"):
        assert f"cannot write --out {out}" in error_line(
            run_cli("generate", run, "--prompt", "hi", "--out", out)
        )
    real = generate_command.generate_ids
    batches = []

    def failing_second_batch(*args, **kwargs):
        batches.append(args[1])
        if len(batches) == 2:
            raise QLoraError("the second batch failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_command, "generate_ids", failing_second_batch)
    out = tmp_path / "rows.jsonl"
    result = run_cli(
        "generate", run, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--batch-size", 1, "--out", out
    )
    assert result[0] == 2 and "the second batch failed" in result[2]
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == [PROMPTS[0]]


def test_running_out_of_gpu_memory_is_one_line_and_keeps_the_rows_done(run, tmp_path, run_cli, monkeypatch):
    """The second batch's decoding fails to allocate: exit 1, one line naming the prompts, their length
    and what to lower, and --out holding the first batch's row."""
    real, batches = generate_command.generate_ids, []

    def second_batch_runs_out(*args, **kwargs):
        batches.append(args[1])
        if len(batches) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_command, "generate_ids", second_batch_runs_out)
    out = tmp_path / "rows.jsonl"
    code, _, err = run_cli(
        "generate", run, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--batch-size", 1, "--out", out,
        "--max-new-tokens", 5,
    )  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in err, err
    assert lines == [
        f"error: out of GPU memory generating prompts 2 to 2 of 2 (the longest {len(batches[1][0])} tokens, up "
        f"to 5 new): lower --batch-size (now 1) or --max-new-tokens; {out} holds the 1 row done before"
    ]
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == [PROMPTS[0]]


def test_a_refused_prompt_leaves_out_as_it_was(run, tmp_path, run_cli):
    """The refusal comes before any row: no empty --out is left behind, and an earlier one stays whole."""
    long_prompt = " ".join(f"w{i}" for i in range(600))
    out = tmp_path / "out.jsonl"
    args = ("generate", run, "--prompt", "hi", "--prompt", long_prompt, "--raw", "--out", out)
    line = error_line(run_cli(*args))
    assert "more than the model's context" in line and re.search(
        r"shorten it to at most [\d,]+ tokens$", line
    )
    assert list(tmp_path.iterdir()) == []
    out.write_text("an earlier run's rows\n")
    error_line(run_cli(*args))
    assert list(tmp_path.iterdir()) == [out] and out.read_text() == "an earlier run's rows\n"


def test_out_naming_the_prompts_file_is_refused_and_the_prompts_kept(run, tmp_path, run_cli):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    line = error_line(
        run_cli("generate", run, "--prompts", prompts, "--out", tmp_path / "." / "prompts.jsonl")
    )
    assert line.endswith("is the --prompts file, which the answers would replace; write them elsewhere")
    assert prompts.read_text() == '{"prompt": "hi"}\n'


def test_the_loaded_line_prints_a_bracketed_path_as_it_is(run, tmp_path, run_cli):
    copy = tmp_path / "[v2]" / "out"
    shutil.copytree(run, copy)
    code, _, err = run_cli("generate", copy, "--prompt", "hi", "--max-new-tokens", 1)
    assert code == 0 and f" + adapter of {copy / 'checkpoint-1'} in " in err, err


def test_rows_record_the_system_message_and_the_summary_counts_right(run, tmp_path, run_cli):
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(
        "generate", run, "--prompt", "hi", "--system", "Be brief.", "--out", out, "--max-new-tokens", 1
    )
    assert code == 0, err
    row = json.loads(out.read_text())
    assert row["system"] == "Be brief." and row["prompt"] == "hi"
    tokens = row["completion_tokens"]
    assert f"1 prompt, {tokens} token{'' if tokens == 1 else 's'} in " in err
    code, _, err = run_cli(
        "generate", run, "--prompt", "hi", "--prompt", "ho", "--out", out, "--max-new-tokens", 2
    )
    assert code == 0, err
    assert "2 prompts, " in err
    assert all("system" not in json.loads(line) for line in out.read_text().splitlines())


def test_stdout_holds_each_completion_as_written_and_out_one_row_each(run, tmp_path, run_cli, monkeypatch):
    """A completion with newlines spans lines of stdout; --out keeps it whole in its row."""
    tokenizer = load_source(run, device="cpu").tokenizer
    texts = ["first line\nsecond line", "one line"]

    def written(engine, batch, *args, **kwargs):
        return [
            Completion(len(p), tokenizer.encode(text), "stop") for p, text in zip(batch, texts, strict=False)
        ]

    monkeypatch.setattr(generate_command, "generate_ids", written)
    out = tmp_path / "out.jsonl"
    code, stdout, err = run_cli("generate", run, "--prompt", "a", "--prompt", "b", "--out", out)
    assert code == 0, err
    assert stdout == "first line\nsecond line\none line\n"
    assert [json.loads(line)["completion"] for line in out.read_text().splitlines()] == texts


def test_base_only_differs_from_the_adapter(run, tmp_path, run_cli):
    adapted = ours(run_cli, run, tmp_path / "a.jsonl")
    base = ours(run_cli, run, tmp_path / "b.jsonl", "--base-only")
    assert [r["completion"] for r in adapted] != [r["completion"] for r in base]


def test_stop_tokens_are_the_declared_end_of_turn_else_the_probed_one_and_llama3s_other_ends(tmp_path):
    write_llama3_tokenizer(tmp_path, 320)
    llama = choose_template(ChatTokenizer.from_folder(tmp_path), "llama3", None)
    # The vocabulary holds <|end_of_text|> but no <|eom_id|>.
    assert stop_ids(llama, {}) == {llama.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>")}
    demo = ChatTokenizer.from_folder(DEMO_TOKENIZER)
    assert stop_ids(demo, {}) == {demo.token_to_id("<|im_end|>")}
    declared = demo.with_chat_template(demo.chat_template, "a test", end_of_turn="<|endoftext|>")
    assert stop_ids(declared, {}) == {demo.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}


def error_line(result) -> str:
    code, _, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_sources(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"base_model: {ROOT / 'configs' / 'demo' / 'tiny-qwen3'}\n"
        f"datasets: [{{path: {ROOT / 'configs' / 'demo' / 'data' / 'train.jsonl'}, type: chat_template}}]\n"
        f"output_dir: {tmp_path / 'never'}\n"
    )
    for source, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no complete checkpoint"),
        (tmp_path / "notes.txt", "is not a config file"),
        (config, "holds no checkpoint yet"),
    ]:
        assert message in error_line(run_cli("generate", source, "--prompt", "hi"))
    code, stdout, err = run_cli("generate", config, "--prompt", "hi", "--base-only", "--max-new-tokens", 3)
    assert code == 0 and "no adapter" in err, err


def test_bad_prompts_and_options(run, tmp_path, run_cli):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    no_field = tmp_path / "no_field.jsonl"
    no_field.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    long_prompt = " ".join(f"w{i}" for i in range(600))
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text(json.dumps({"prompt": "ok"}) + "\n\n{oops\n")
    listed = tmp_path / "listed.jsonl"
    listed.write_text("[1]\n")
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"messages": [{"role": "user", "content": "ok \\ud800"}]}\n')
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"messages": [{"role": "user", "content": "a", "role": "system"}]}\n')
    for args, message in [
        # A byte that is not UTF-8 in an argument reaches Python as a surrogate (surrogateescape).
        (["--prompt", "caf\udce9"], "--prompt 1: the prompt is not UTF-8 text (byte 0xe9 at character 4)"),
        (["--prompt", "caf\udce9", "--raw"], "--prompt 1: the prompt is not UTF-8 text (byte 0xe9"),
        (["--prompt", "hi", "--system", "s\udce9"], "--system is not UTF-8 text (byte 0xe9 at character 2)"),
        (["--prompts", surrogate], f"{surrogate}:1: the prompt is not UTF-8 text (lone surrogate U+D800 at"),
        (["--prompts", empty], "holds no prompts"),
        (["--prompts", no_field], f"{no_field}:2: the row has neither 'prompt' nor 'messages'"),
        (["--prompts", not_json], f"{not_json}:3: not valid JSON (Expecting property name"),
        (["--prompts", listed], f"{listed}:1: expected a JSON object, got"),
        (["--prompts", twice], f"{twice}:1: key 'role' is set twice in one object; keep one"),
        (["--prompts", tmp_path / "absent.jsonl"], "does not exist"),
        (["--prompt", long_prompt, "--raw"], "more than the model's context"),
        (["--prompt", "hi", "--temperature", "-0.5"], "--temperature must be 0"),
        (
            ["--prompt", "hi", "--temperature", "nan"],
            "--temperature must be 0 (greedy) or a positive number, got nan",
        ),
        (
            ["--prompt", "hi", "--temperature", "inf"],
            "--temperature must be 0 (greedy) or a positive number, got inf",
        ),
        (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", "hi", "--raw", "--system", "x"], "--system needs the chat template"),
        (["--prompt", "", "--raw"], "the prompt is empty"),
        ([], "no prompt given"),
    ]:
        assert message in error_line(run_cli("generate", run, *args))


@pytest.mark.parametrize(
    "devices, names", [(1, "1 CUDA device (cuda:0)"), (2, "2 CUDA devices (cuda:0 to cuda:1)")]
)
def test_a_cuda_index_past_the_machines_devices_names_those_it_has(monkeypatch, devices, names):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    with pytest.raises(QLoraError) as refused:
        select_device(f"cuda:{devices}", "--device")
    assert str(refused.value) == f"--device is 'cuda:{devices}' but this machine has {names}"


def test_bad_devices(run, run_cli):
    cases = [("gpu", "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"), ("cuda:x", "got 'cuda:x'")]
    if not torch.cuda.is_available():
        cases += [
            ("cuda", "--device is 'cuda' but no CUDA device"),
            ("cuda:0", "--device is 'cuda:0' but no CUDA"),
        ]
    else:
        cases.append((f"cuda:{torch.cuda.device_count()}", "but this machine has "))
    for command in (["generate", run, "--prompt", "hi"], ["chat", run]):
        for device, message in cases:
            assert message in error_line(run_cli(*command, "--device", device))


def chat_session(run_cli, monkeypatch, source, lines: list[str], *args):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code, stdout, err = run_cli("chat", source, "--device", "cpu", *args)
    assert code == 0, err
    return stdout, err


def test_chat_streams_the_answers_generate_gives(family_run, tmp_path, run_cli, monkeypatch):
    run, first = family_run, PROMPTS[1]
    stdout, err = chat_session(
        run_cli,
        monkeypatch,
        run,
        [first, "/system Be brief.", PROMPTS[0], "/reset", first],
        "--max-new-tokens",
        "12",
    )
    assert "(conversation cleared)" in err and "(system message set)" in err
    alone = ours_file(run_cli, run, tmp_path, [{"role": "user", "content": first}])
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": first},
        {"role": "assistant", "content": alone},
        {"role": "user", "content": PROMPTS[0]},
    ]
    second = ours_file(run_cli, run, tmp_path, history)
    after_reset = ours_file(run_cli, run, tmp_path, [history[0], history[1]])
    assert stdout == f"{alone}\n{second}\n{after_reset}\n"
    assert len({alone, second, after_reset}) == 3


def ours_file(run_cli, source, tmp_path, messages) -> str:
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps({"messages": messages}) + "\n")
    code, stdout, err = run_cli(
        "generate", source, "--prompts", file, "--max-new-tokens", "12", "--device", "cpu"
    )
    assert code == 0, err
    return stdout.removesuffix("\n")


def test_chat_drops_the_oldest_turns_past_sequence_len(run, run_cli, monkeypatch):
    long_message = " ".join(f"w{i}" for i in range(60))
    _, err = chat_session(
        run_cli, monkeypatch, run, [long_message] * 5 + ["/exit", "never read"], "--max-new-tokens", "8"
    )
    assert err.count("> ") == 6
    assert "dropped the oldest turn to stay within sequence_len 512" in err
    too_long, err = chat_session(run_cli, monkeypatch, run, [" ".join(["w1"] * 600)], "--max-new-tokens", "8")
    assert too_long == "" and "does not fit in sequence_len 512" in err


def test_a_chat_line_that_is_not_utf8_is_said_and_the_chat_goes_on(run, tmp_path, run_cli, monkeypatch):
    stdout, err = chat_session(
        run_cli, monkeypatch, run, ["caf\udce9", "/system s\udce9", PROMPTS[0]], "--max-new-tokens", "12"
    )
    assert err.count("(that line is not UTF-8 text (byte 0xe9 at character ") == 2
    assert stdout == f"{ours_file(run_cli, run, tmp_path, [{'role': 'user', 'content': PROMPTS[0]}])}\n"
    line = error_line(run_cli("chat", run, "--device", "cpu", "--system", "s\udce9"))
    assert line == "error: --system is not UTF-8 text (byte 0xe9 at character 2)"


def test_a_message_too_long_for_chat_keeps_the_conversation(run, tmp_path, run_cli, monkeypatch):
    too_long = " ".join(["w1"] * 600)
    stdout, err = chat_session(
        run_cli, monkeypatch, run, [PROMPTS[1], too_long, PROMPTS[0]], "--max-new-tokens", "12"
    )
    assert "does not fit in sequence_len 512" in err and "dropped" not in err
    first = ours_file(run_cli, run, tmp_path, [{"role": "user", "content": PROMPTS[1]}])
    history = [
        {"role": "user", "content": PROMPTS[1]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": PROMPTS[0]},
    ]
    assert stdout == f"{first}\n{ours_file(run_cli, run, tmp_path, history)}\n"


def cuda_model(run: Path, dtype: torch.dtype) -> tuple[QLoRAModel, set[int], list[list[int]]]:
    """The run's model on CUDA (Triton kernels), its stop ids and the test prompts as ids."""
    loaded = load_source(run, device="cpu")
    model = QLoRAModel.from_pretrained(
        loaded.model.source, quantize=True, lora=loaded.model.lora, device="cuda", dtype=dtype
    )
    model.load_state_dict(loaded.model.state_dict())
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    return model.eval().requires_grad_(False), loaded.stop_ids, prompts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_step_equals_the_eager_one(family_run, dtype):
    model, _, prompts = cuda_model(family_run, dtype)
    logits = {}
    for graphs in (False, True):
        engine = DecodingEngine(model, cuda_graphs=graphs)
        cache, step = engine.prepare(len(prompts), 64)
        out = [engine.prefill(cache, prompts)]
        lengths = torch.tensor([len(p) for p in prompts], device="cuda")
        for _ in range(6):
            out.append(step(out[-1].argmax(-1), lengths).clone())
            lengths += 1
        logits[graphs] = torch.stack(out)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert (logits[True] - logits[False]).abs().max().item() < tolerance * logits[False].abs().max().item()


@pytest.mark.gpu
def test_cuda_generation_agrees_with_the_cpu_reference(family_run):
    run = family_run
    model, stop_ids, prompts = cuda_model(run, torch.float32)
    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    on_cuda = generate_ids(DecodingEngine(model), prompts, sampling, stop_ids)
    reference = load_source(run, device="cpu")
    on_cpu = generate_ids(DecodingEngine(reference.model), prompts, sampling, stop_ids)
    assert [c.ids for c in on_cuda] == [c.ids for c in on_cpu]
    first = DecodingEngine(model)
    cache, _ = first.prepare(len(prompts), 64)
    cpu_engine = DecodingEngine(reference.model)
    cpu_cache, _ = cpu_engine.prepare(len(prompts), 64)
    got, expected = first.prefill(cache, prompts).cpu(), cpu_engine.prefill(cpu_cache, prompts)
    # fp32 both ways, every Triton product in full precision ("ieee", no TF32); the kernels and cuBLAS
    # sum in other orders than the CPU does (the delta rule's chunks and triangular solve among them),
    # so the bound is 1e-4 of the logits' scale, as for the interpreter below. TF32 in one product
    # (10-bit mantissas) moved a Qwen3.5 prefill by 7.9e-3 of its scale on an H200.
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter runs where no GPU compiles the kernels"
)
@pytest.mark.parametrize("rows", [1, 2])
def test_decoding_on_the_triton_kernels_equals_the_reference(family_run, monkeypatch, rows):
    """The prefill and decode steps through the Triton kernels (in the interpreter) give the logits the
    torch references give: the shapes and strides decoding hands the kernels are ones they take. One
    row takes nf4_matvec's kernel on the NF4 codes, several rows its dequantize + matmul."""
    loaded = load_source(family_run, device="cpu")
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS[:rows]]
    calls = {"kernel": 0, "dequantize": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(nf4_matvec, "_nf4_matvec_triton", counted("kernel", nf4_matvec._nf4_matvec_triton))
    monkeypatch.setattr(NF4, "dequantize", counted("dequantize", NF4.dequantize))
    logits = {}
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        engine = DecodingEngine(loaded.model)
        cache, step = engine.prepare(len(prompts), 32)
        out = [engine.prefill(cache, prompts)]
        # Only the decode steps count: prefill's GEMMs dequantize their NF4 weights too.
        calls.update(kernel=0, dequantize=0)
        lengths = torch.tensor([len(p) for p in prompts])
        for _ in range(2):
            out.append(step(out[-1].argmax(-1), lengths))
            lengths += 1
        logits[interpret] = torch.stack(out)
        if interpret == "0":
            assert calls == {"kernel": 0, "dequantize": 0}
    groups = [group for layer in loaded.model.layers for group in layer.projections.values()]
    weights = sum(len(group.weights) for group in groups)
    assert calls == (
        {"kernel": 2 * len(groups), "dequantize": 0}
        if rows == 1
        else {"kernel": 0, "dequantize": 2 * weights}
    )
    # fp32 both ways; the kernels sum in other orders (the delta rule's chunks and their triangular
    # solve among them), so the bound is 1e-4 of the logits' scale, not of 1.
    scale = logits["0"].abs().max().item()
    assert (logits["1"] - logits["0"]).abs().max().item() < 1e-4 * scale


def test_a_config_source_generates_with_its_runs_newest_checkpoint(demo_run, tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(ROOT)
    config = tmp_path / "demo.yaml"
    config.write_text((ROOT / "configs" / "demo.yaml").read_text().replace("./outputs/demo", str(demo_run)))
    assert ours(run_cli, config, tmp_path / "a.jsonl") == ours(run_cli, demo_run, tmp_path / "b.jsonl")
    code, _, err = run_cli("generate", config, "--prompt", "Hi", "--max-new-tokens", "2")
    assert code == 0 and "checkpoint-2" in err, err


def _interrupt_answer_after(monkeypatch, tokens: int, times: int = 1) -> list[str]:
    """Ctrl-C (`times` signals) once the first answer has streamed `tokens` tokens; returns the text it had shown."""
    shown: list[str] = []
    real = TextStream.__call__

    def interrupting(self, row, token):
        real(self, row, token)
        if len(self.ids) == tokens and not shown:
            shown.append(self.tokenizer.decode(self.ids))
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(TextStream, "__call__", interrupting)
    return shown


def test_ctrl_c_stops_the_answer_which_stays_in_the_conversation(runs, tmp_path, run_cli, monkeypatch):
    run = runs(ATTENTION_ONLY[0])
    alone = ours_file(run_cli, run, tmp_path, [{"role": "user", "content": PROMPTS[1]}])
    shown = _interrupt_answer_after(monkeypatch, 3)
    stdout, err = chat_session(run_cli, monkeypatch, run, [PROMPTS[1], PROMPTS[0]], "--max-new-tokens", "12")
    (partial,) = shown
    assert alone.startswith(partial) and partial != alone
    assert "(answer stopped; the part shown stays in the conversation)" in err
    monkeypatch.undo()
    history = [
        {"role": "user", "content": PROMPTS[1]},
        {"role": "assistant", "content": partial},
        {"role": "user", "content": PROMPTS[0]},
    ]
    assert stdout == f"{partial}\n{ours_file(run_cli, run, tmp_path, history)}\n"


def test_ctrl_c_before_the_first_token_drops_the_message(runs, tmp_path, run_cli, monkeypatch):
    run = runs(ATTENTION_ONLY[0])
    real, calls = DecodingEngine.prefill, []

    def interrupted_prefill(self, cache, prompts):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return real(self, cache, prompts)

    monkeypatch.setattr(DecodingEngine, "prefill", interrupted_prefill)
    stdout, err = chat_session(run_cli, monkeypatch, run, [PROMPTS[1], PROMPTS[0]], "--max-new-tokens", "12")
    assert "(answer stopped before it began; your message is dropped)" in err
    monkeypatch.undo()
    assert stdout == f"\n{ours_file(run_cli, run, tmp_path, [{'role': 'user', 'content': PROMPTS[0]}])}\n"


class CtrlCAtSecondPrompt(io.StringIO):
    def __init__(self, text: str):
        super().__init__(text)
        self.prompts = 0

    def readline(self, *args):
        self.prompts += 1
        if self.prompts == 2:
            signal.raise_signal(signal.SIGINT)
        return super().readline(*args)


@pytest.mark.parametrize("at", ["prompt", "second Ctrl-C"])
def test_ctrl_c_at_the_prompt_or_twice_in_an_answer_ends_the_session(runs, run_cli, monkeypatch, at):
    run = runs(ATTENTION_ONLY[0])
    lines = "".join(f"{prompt}\n" for prompt in PROMPTS[:2])
    shown = []
    if at == "prompt":
        monkeypatch.setattr("sys.stdin", CtrlCAtSecondPrompt(lines))
    else:
        shown = _interrupt_answer_after(monkeypatch, 3, times=2)
        monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code, stdout, err = run_cli("chat", run, "--device", "cpu", "--max-new-tokens", "12")
    assert code == 128 + signal.SIGINT
    assert err.rstrip().endswith("> interrupted: SIGINT received; stopped"), err
    assert err.count("> ") == (2 if at == "prompt" else 1)
    assert stdout.count("\n") == (1 if at == "prompt" else 0) and stdout.startswith(shown[0] if shown else "")
