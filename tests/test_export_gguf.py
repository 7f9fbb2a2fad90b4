"""GGUF export: transformers' GGUF loader and llama.cpp read the file, and it is the --merged model.

Logits against the fp32 --merged export, of magnitude ~3, within: bf16 5e-2 (seen 2e-2), f16 2e-2
(seen 3e-3), q8_0 0.2 (seen 0.07). The bf16 file's matrices are the --merged bf16 export's bit for bit;
its norms and biases stay f32, as in every GGUF type, so its logits are not that export's exactly.

The tiny Qwen3 here has head_dim 128: transformers' GGUF loader does not read qwen3.attention.key_length
and takes Qwen3Config's default head_dim, 128 (every released Qwen3's). llama.cpp does read it; the
llama.cpp test below runs the demo model, whose head_dim (32) is hidden_size / heads.

llama.cpp itself is the reader that matters; test_llama_cpp_generates_what_transformers_does checks
greedy tokens against transformers' on the --merged export where llama_cpp is installed, and skips
elsewhere. llama.cpp runs in a child process (tests/llama_cpp_child.py), never in this one: a build
for another CPU dies of an Illegal instruction, which must fail its tests with a line saying so, not
end the pytest session.
"""

import dataclasses
import importlib.util
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import (
    REPO_ROOT,
    TINY_SPEC,
    load_transformers,
    subprocess_env,
    write_llama,
    write_llama3_tokenizer,
    write_mistral,
    write_qwen2,
    write_qwen3,
    write_qwen3_5,
    write_qwen3_5_moe,
    write_qwen3_moe,
)
from test_export import make_run
from test_moe import _fuse_experts

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.export.command import export
from qlora_cli.export.gguf.architectures import architecture, pairwise_rope_rows
from qlora_cli.export.gguf.layer_kinds import GGUF_LAYER_KINDS, KindTensors
from qlora_cli.export.gguf.vocab import (
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    QWEN35_SPLIT,
    TEKKEN_SPLIT,
    pre_tokenizer_name,
)
from qlora_cli.sources.model_config import read_spec
from qlora_cli.sources.spec import ModelSpec
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.train.loop import train

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("reference_ops")

VOCAB = 1024  # the demo tokenizer's
TOLERANCES = {"bf16": 5e-2, "f16": 2e-2, "q8_0": 0.2}
WRITERS = {
    "qwen2": lambda folder: write_qwen2(folder, vocab_size=VOCAB, rms_norm_eps=1e-5),
    "qwen3": lambda folder: write_qwen3(folder, vocab_size=VOCAB, head_dim=128),
}
CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Sum 2 and 3 in Python?"},
    {"role": "assistant", "content": "`print(2 + 3)` → 5 🙂"},
]
TEXTS = [
    "Hello world, it's a test: don't panic!",
    "你好，世界。今天天气很好",
    "emoji 🙂🚀👍🏽 and ünïcödé",
    "def add(a, b):\n    return a + b  # sum\n\n\tx = [1, 22, 333]",
    "  leading spaces\r\nand CRLF   trailing  ",
]
# Metadata llama.cpp reads for these architectures (llama-model.cpp, llama-vocab.cpp).
REQUIRED_KEYS = [
    "general.architecture",
    "{arch}.context_length",
    "{arch}.embedding_length",
    "{arch}.block_count",
    "{arch}.feed_forward_length",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.attention.key_length",
    "{arch}.attention.value_length",
    "{arch}.rope.freq_base",
    "{arch}.rope.dimension_count",
    "{arch}.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
]


def _make_run(folder: Path, kind: str, **settings) -> Path:
    return make_run(folder, kind, writer=WRITERS[kind], **settings)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def exports(request, tmp_path_factory):
    """A run of each architecture (the demo's ChatML template) and its merged and GGUF exports."""
    folder = tmp_path_factory.mktemp(request.param)
    run = _make_run(folder, request.param, chat_template="chatml")
    found = {"run": run, "kind": request.param}
    for dtype in ("bfloat16", "float32"):
        found[dtype] = export(run, folder / dtype, merged=True, dtype=dtype).out
    for gguf_type in ("bf16", "f16", "q8_0"):
        result = export(run, folder / gguf_type, gguf=True, gguf_type=gguf_type)
        found[gguf_type] = result.out / result.gguf_file
    return found


def logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def load_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize(("gguf_type", "tolerance"), sorted(TOLERANCES.items()))
def test_transformers_loads_the_gguf_and_it_is_the_merged_model(exports, gguf_type, tolerance):
    got = logits(load_gguf(exports[gguf_type]), VOCAB)
    expected = logits(load_transformers(exports["float32"]), VOCAB)
    assert (got - expected).abs().max().item() < tolerance
    base = logits(load_transformers(exports["run"].parent / "model"), VOCAB)
    assert (base - expected).abs().max().item() > 5 * tolerance


def test_gguf_tokenizer_encodes_as_tokenizer_json(exports):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = exports["bf16"]
    loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reference = Tokenizer.from_file(str(exports["run"].parent / "model" / "tokenizer.json"))
    chat = ChatTokenizer.from_folder(exports["bfloat16"]).render_chat(CHAT, add_generation_prompt=True)
    for text in [*TEXTS, chat]:
        assert loaded.encode(text, add_special_tokens=False) == reference.encode(text).ids, text


def read_gguf(path: Path) -> tuple[dict, dict]:
    """(metadata key → value, tensor name → (shape as numpy writes it, type name))."""
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    return fields, tensors


@pytest.mark.parametrize("gguf_type", ["bf16", "q8_0"])
def test_gguf_holds_what_llama_cpp_needs(exports, gguf_type):
    fields, tensors = read_gguf(exports[gguf_type])
    spec = read_spec(exports["run"].parent / "model")
    arch = exports["kind"]
    assert fields["general.architecture"] == arch
    missing = [key.format(arch=arch) for key in REQUIRED_KEYS if key.format(arch=arch) not in fields]
    assert not missing
    # The tiny checkpoints' values (tests/checkpoints.py TINY, WRITERS above): qwen2's head_dim is
    # 64 / 4 heads, qwen3's is set apart from it.
    head_dim, theta, eps = {"qwen2": (16, 1e4, 1e-5), "qwen3": (128, 1e6, 1e-6)}[arch]
    assert {key.removeprefix(f"{arch}."): fields[key] for key in fields if key.startswith(f"{arch}.")} == {
        "vocab_size": VOCAB,
        "context_length": 256,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "rope.freq_base": pytest.approx(theta, rel=1e-7),  # stored as f32: 2**-24 relative
        "attention.layer_norm_rms_epsilon": pytest.approx(eps, rel=1e-7),
    }
    assert fields["tokenizer.ggml.padding_token_id"] == 1021  # <|endoftext|>, the demo's pad_token
    assert "tokenizer.ggml.bos_token_id" not in fields  # the demo tokenizer has none
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.ggml.eos_token_id"] == 1023  # <|im_end|>
    assert len(fields["tokenizer.ggml.tokens"]) == spec.vocab_size
    assert fields["tokenizer.ggml.token_type"][1021:] == [3, 3, 3]  # the demo's special tokens: control
    chat = ChatTokenizer.from_folder(exports["bfloat16"])
    assert fields["tokenizer.chat_template"] == chat.chat_template

    expected = {"token_embd.weight", "output_norm.weight"}
    if not spec.tie_word_embeddings:
        expected.add("output.weight")
    per_layer = [
        "attn_norm",
        "ffn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    extra = {"qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"], "qwen3": ["attn_q_norm", "attn_k_norm"]}[
        arch
    ]
    for layer in range(spec.num_layers):
        expected |= {f"blk.{layer}.{name}.weight" for name in per_layer}
        expected |= {
            f"blk.{layer}.{name}" if name.endswith("bias") else f"blk.{layer}.{name}.weight" for name in extra
        }
    assert set(tensors) == expected
    assert tensors["blk.0.attn_q.weight"][0] == (spec.q_size, spec.hidden_size)
    assert tensors["blk.1.ffn_down.weight"][0] == (spec.hidden_size, spec.intermediate_size)
    matrix = "BF16" if gguf_type == "bf16" else "Q8_0"
    for name, (shape, kind) in tensors.items():
        assert kind == ("F32" if len(shape) == 1 else matrix), name


def test_bf16_gguf_holds_the_merged_bf16_weights_bit_for_bit(exports):
    from safetensors.torch import load_file

    merged = {}
    for shard in exports["bfloat16"].glob("model-*.safetensors"):
        merged.update(load_file(shard))
    reader = gguf.GGUFReader(exports["bf16"])
    data = {t.name: t.data for t in reader.tensors}
    raw = torch.from_numpy(data["blk.1.attn_k.weight"].copy()).view(torch.bfloat16)
    assert torch.equal(raw, merged["model.layers.1.self_attn.k_proj.weight"])


def test_modelfile_and_card_say_how_to_run_it(exports):
    folder = exports["q8_0"].parent
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "README.md", "model-q8_0.gguf"]
    modelfile = (folder / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-q8_0.gguf\n")
    assert "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    card = (folder / "README.md").read_text()
    assert "llama-cli -m model-q8_0.gguf" in card and "ollama create" in card and "q8_0" in card


def _base_llama(folder: Path) -> Path:
    """A base (not Instruct) Llama 3: its eos is <|end_of_text|>, and the llama3 template's turns end in
    <|eot_id|>."""
    folder = write_llama(folder)
    write_llama3_tokenizer(folder, 320, eos_token="<|end_of_text|>")
    return folder


def test_merged_and_gguf_exports_stop_where_the_runs_answers_end(tmp_path):
    """A base Llama trained on the llama3 template ends its answers with <|eot_id|>, where qlora generate
    stops: the merged export's generation_config.json lists it (and <|eom_id|>, where held) after the base's eos,
    so transformers and vLLM stop there too, and the Modelfile stops on it."""
    run = make_run(tmp_path, "llama", writer=_base_llama, chat_template="llama3")
    base = json.loads((tmp_path / "model" / "generation_config.json").read_text())["eos_token_id"]
    tokenizer = ChatTokenizer.from_folder(tmp_path / "model")
    held = [
        t for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>") if tokenizer.token_to_id(t) is not None
    ]
    assert held[0] == "<|eot_id|>" and tokenizer.token_to_id("<|eot_id|>") != base
    ends = [tokenizer.token_to_id(t) for t in held]
    merged = export(run, tmp_path / "merged", merged=True).out
    config = json.loads((merged / "generation_config.json").read_text())
    assert config["eos_token_id"] == [base, *sorted(set(ends) - {base})]
    modelfile = (export(run, tmp_path / "gguf", gguf=True).out / "Modelfile").read_text()
    stops = [line for line in modelfile.splitlines() if line.startswith("PARAMETER stop")]
    assert stops == [f'PARAMETER stop "{t}"' for t in held]


def test_modelfile_carries_a_default_system_prompt(tmp_path):
    """qwen_25 writes a default system turn when a chat has none; Ollama gets it as SYSTEM."""
    run = _make_run(tmp_path, "qwen2", chat_template="qwen_25")
    modelfile = (export(run, tmp_path / "g", gguf=True).out / "Modelfile").read_text()
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud. You are a helpful assistant."""' in modelfile


def error_line(result) -> str:
    code, _, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gguf", "--gguf-type", "q4_k"], "--gguf-type: expected one of bf16, f16, q8_0"),
        (["--gguf-type", "f16"], "--gguf-type applies to --gguf exports only"),
        (["--gguf", "--merged"], "give either --merged or --gguf"),
        (["--gguf", "--dtype", "float16"], "--gguf takes --gguf-type"),
        (["--gguf", "--base", "fp8"], "--base: expected one of original, nf4"),
    ],
)
def test_cli_refuses_bad_gguf_options(tmp_path, run_cli, args, message):
    assert message in error_line(run_cli("export", tmp_path / "run", "--out", tmp_path / "o", *args))


def test_cli_writes_a_gguf(tmp_path, run_cli):
    run = _make_run(tmp_path, "qwen3")
    code, _, err = run_cli("export", run, "--out", tmp_path / "g", "--gguf", "--base", "nf4")
    assert code == 0 and "GGUF model-bf16.gguf (nf4 base, bf16)" in err
    assert "NF4 round trip" in (tmp_path / "g" / "README.md").read_text()


def _without_qwen_split(tokenizer: dict) -> None:
    tokenizer["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def _with_other_split(tokenizer: dict) -> None:
    tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = QWEN2_SPLIT.replace(
        r"\p{N}|", r"\p{N}{1,2}|"
    )


@pytest.mark.parametrize("change", [_without_qwen_split, _with_other_split])
def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused(tmp_path, run_cli, change):
    run = _make_run(tmp_path, "qwen2")
    path = run.parent / "model" / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    assert tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_SPLIT
    change(tokenizer)
    path.write_text(json.dumps(tokenizer))
    line = error_line(run_cli("export", run, "--out", tmp_path / "o", "--gguf"))
    assert "after a split llama.cpp knows" in line and "would cut this one's text differently" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_a_vocabulary_larger_than_the_model_is_refused_and_nothing_is_left(tmp_path, run_cli):
    run = make_run(tmp_path, "qwen2")  # 160 embedding rows for the demo's 1024 tokens
    line = error_line(run_cli("export", run, "--out", tmp_path / "o", "--gguf"))
    assert "has token id 1023, but the model's vocab_size is 160" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(QLoraError, match=r"pip install 'qlora-cli\[gguf\]'"):
        export(tmp_path / "run", tmp_path / "o", gguf=True)


LLAMA_CPP_CHILD = Path(__file__).resolve().parent / "llama_cpp_child.py"
# Found without importing it: importing loads llama.cpp's native library into this process.
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


def llama_cpp(request: dict, child: Path = LLAMA_CPP_CHILD) -> dict:
    """tests/llama_cpp_child.py's answer to `request`. A child killed by a signal fails the calling test
    in one line naming the signal; SIGILL is llama.cpp compiled for instructions this CPU lacks."""
    proc = subprocess.run(
        [sys.executable, str(child)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = (
            ": llama-cpp-python was built for another CPU; reinstall it portable, as the README's test "
            "command does (CMAKE_ARGS=-DGGML_NATIVE=off, pip --no-cache-dir)"
            if name == "SIGILL"
            else ""
        )
        pytest.fail(f"llama.cpp died of {name} in its child process{hint}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"llama.cpp's child process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def test_a_llama_cpp_crash_fails_its_test_in_one_line_not_the_session(tmp_path):
    child = tmp_path / "crash.py"
    child.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        llama_cpp({}, child)
    assert str(failed.value).startswith(
        "llama.cpp died of SIGILL in its child process: llama-cpp-python was built for another CPU"
    )


@pytest.fixture(scope="module")
def demo_exports(tmp_path_factory):
    """The demo trained a few steps (on the torch reference ops, as users on CPU do), exported --merged
    (bf16) and --gguf (bf16)."""
    folder = tmp_path_factory.mktemp("demo")
    config = load_config(
        REPO_ROOT / "configs" / "demo.yaml",
        [f"output_dir={folder / 'out'}", "max_steps=20", "save_steps=20", "device=cpu"],
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        checkpoint = train(config).checkpoint
    merged = export(checkpoint, folder / "merged", merged=True).out
    result = export(checkpoint, folder / "gguf", gguf=True)
    return merged, result.out / result.gguf_file


@needs_llama_cpp
def test_llama_cpp_generates_what_transformers_does(demo_exports):
    """llama.cpp loads the GGUF, tokenizes as tokenizer.json does, and its greedy continuation of a chat
    equals transformers' on the merged export."""
    merged, path = demo_exports
    chat = ChatTokenizer.from_folder(merged)
    prompt = chat.render_chat(
        [{"role": "user", "content": "Give me three colors."}], add_generation_prompt=True
    )
    ids = chat.encode(prompt)
    model = load_transformers(merged)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    answer = llama_cpp(
        {
            "model": str(path),
            "n_ctx": 256,
            "tokenize": TEXTS,
            "tokenize_special": [prompt],
            "generate": {"ids": ids, "max_tokens": len(expected), "stop": chat.eos_token_id},
        }
    )
    for text, tokens in zip(TEXTS, answer["tokens"], strict=True):
        assert tokens == chat.encode(text), text
    assert answer["special_tokens"] == [ids]
    got = answer["generated"]
    assert got == expected.tolist()[: len(got)] and len(got) > 4


@needs_llama_cpp
@pytest.mark.parametrize("gguf_type", sorted(TOLERANCES))
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_llama_cpp_computes_the_merged_model(tmp_path, kind, gguf_type):
    """llama.cpp's logits on the GGUF are the fp32 merge's: Qwen2 with q/k/v biases and tied embeddings
    (no output tensor), Qwen3 with QK-norm, an untied lm_head and head_dim 24 unlike hidden / heads."""
    writer = {"qwen2": write_qwen2, "qwen3": write_qwen3}[kind]
    run = make_run(tmp_path, kind, writer=lambda folder: writer(folder, vocab_size=VOCAB))
    merged = load_transformers(export(run, tmp_path / "m", merged=True, dtype="float32").out)
    result = export(run, tmp_path / "g", gguf=True, gguf_type=gguf_type)
    ids = torch.randint(0, 1021, (17,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = merged(ids[None]).logits[0]
    answer = llama_cpp({"model": str(result.out / result.gguf_file), "n_ctx": 64, "eval": ids.tolist()})
    got = torch.tensor(answer["scores"])
    assert (got - expected).abs().max().item() < TOLERANCES[gguf_type]


def test_tensors_are_written_as_they_stream_past(tmp_path, monkeypatch):
    """Each merged tensor reaches the file before the next is read, so memory stays near one tensor."""
    import qlora_cli.export.gguf_folder as gguf_folder

    run = _make_run(tmp_path, "qwen2")
    merged_tensors, sizes = gguf_folder.merged_tensors, []

    def watched(*args):
        for name, tensor in merged_tensors(*args):
            (partial,) = tmp_path.glob(".g.tmp-export-*/model-bf16.gguf")
            sizes.append(partial.stat().st_size)
            yield name, tensor

    monkeypatch.setattr(gguf_folder, "merged_tensors", watched)
    out = export(run, tmp_path / "g", gguf=True).out
    embedding = VOCAB * 64 * 2
    assert sizes == sorted(sizes) and sizes[-1] - sizes[0] > embedding
    assert (out / "model-bf16.gguf").stat().st_size > sizes[-1]


def test_a_template_that_is_not_chatml_gets_no_ollama_template():
    from qlora_cli.export.gguf.ollama import modelfile

    base = ChatTokenizer.from_folder(REPO_ROOT / "configs" / "demo" / "tiny-qwen3")
    other = base.with_chat_template(
        "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}### assistant:", "test"
    )
    text = modelfile("model-f16.gguf", other, {})
    assert "TEMPLATE" not in text and "SYSTEM" not in text and text.startswith("# The chat template")
    assert "FROM ./model-f16.gguf\n" in text and 'PARAMETER stop "<|im_end|>"' in text
    assert "TEMPLATE" in modelfile("model-f16.gguf", base, {})


def test_cli_help_names_the_gguf_options(run_cli):
    code, out, _ = run_cli("export", "--help")
    assert code == 0 and "--gguf-type" in out and "bf16" in out and "q8_0" in out


def _ollama_argument(text: str) -> str | None:
    """The argument Ollama's Modelfile parser reads from the start of `text`: the text up to the first
    space or line break where it is a whole quoted (or bare) value, without its quotes; None if none is."""
    ends = [i for i, c in enumerate(text) if c in " \t\r\n"] + [len(text)]
    for end in ends:
        value = text[:end].strip()
        if value.startswith('"""'):
            if len(value) >= 6 and value.endswith('"""'):
                return value[3:-3]
        elif value.startswith('"'):
            if len(value) >= 2 and value.endswith('"'):
                return value[1:-1]
        elif value:
            return value
    return None


@pytest.mark.parametrize(
    "text",
    [
        "Answer briefly.",
        'Say "hi" when greeted.',
        'Fence code in """ like this.',
        'Ends in """',
        '"" opens it',
        '" then a space',
        'one\n"""\nper line',
        "<|im_end|>",
        'a" b',
        '"""',
    ],
)
def test_quoted_modelfile_arguments_read_back_or_are_refused(text):
    from qlora_cli.export.gguf.ollama import quote

    for marks in [('"""', '"'), ('"', '"""')]:
        quoted = quote(text, marks)
        if quoted is None:
            assert all(_ollama_argument(m + text + m + "\nNEXT") != text for m in marks)
        else:
            assert _ollama_argument(quoted + "\nPARAMETER x") == text


def _with_system_prompt(system: str) -> ChatTokenizer:
    base = ChatTokenizer.from_folder(REPO_ROOT / "configs" / "demo" / "tiny-qwen3")
    template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + system + "<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant{{ '\\n' }}"  # Jinja drops a template's last line break
    )
    return base.with_chat_template(template, "test")


def test_a_default_system_prompt_with_quotes_reads_back_or_is_left_out():
    from qlora_cli.export.gguf.ollama import modelfile

    holdable = 'Quote "like this" and fence with """'
    text = modelfile("m.gguf", _with_system_prompt(holdable), {})
    (line,) = [line for line in text.splitlines() if line.startswith("SYSTEM ")]
    assert _ollama_argument(line.removeprefix("SYSTEM ")) == holdable
    text = modelfile("m.gguf", _with_system_prompt('Fence code in """ like this.'), {})
    assert "SYSTEM" not in text and "# Left out: the default system prompt" in text
    assert "TEMPLATE" in text and 'PARAMETER stop "<|im_end|>"' in text


# The families whose GGUF form differs from the checkpoint's: Qwen3.5 as Qwen3_5ForCausalLM saves it
# (untied) and as published (vision-language, tied, with an MTP head); Llama with llama3 RoPE, and tied
# with head_dim 32 unlike hidden / heads (16), as Mistral Small has (Mistral's own test tokenizer is a
# SentencePiece one, which --gguf refuses below); the MoE families, their routed experts stacked:
# Qwen3 MoE sparse in every layer, with 12 experts, so that the checkpoint's sorted names stream
# expert 10 before expert 2; Qwen3.5 MoE with its shared expert.
def centred_norms(folder: Path) -> Path:
    """Zero-centred norms near 0, as trained Qwen3.5 checkpoints have them (x̂·(1+w), w initialised to
    0): the random 1 + 0.2·noise of tests/checkpoints.py doubles every activation, and this tiny model
    then amplifies q8_0's rounding to the size of its logits."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensors[name] = tensors[name] - 1
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


FAMILIES = {
    "qwen3_5": lambda folder: centred_norms(write_qwen3_5(folder)),
    "qwen3_5vl": lambda folder: centred_norms(write_qwen3_5(folder, layout="vl", tie=True, mtp=True)),
    "llama": lambda folder: write_llama(folder),
    "llama-head_dim": lambda folder: write_llama(
        folder, tie=True, head_dim=32, rope_scaling={"rope_type": "default", "rope_theta": 500000.0}
    ),
    "qwen3_moe": lambda folder: write_qwen3_moe(folder, vocab_size=VOCAB, mlp_only_layers=[], num_experts=12),
    "qwen3_5_moe": lambda folder: centred_norms(write_qwen3_5_moe(folder)),
}
# llama.cpp's architecture of each of them, as general.architecture names it.
ARCHITECTURES = {
    "qwen3_5": "qwen35",
    "qwen3_5vl": "qwen35",
    "llama": "llama",
    "llama-head_dim": "llama",
    "qwen3_moe": "qwen3moe",
    "qwen3_5_moe": "qwen35moe",
}


def _tiled(heads: int, per_key: int) -> list[int]:
    """Value head t of llama.cpp's order is value head j = (t % H_k) * r + t // H_k of transformers'."""
    return [(t % heads) * per_key + t // heads for t in range(heads * per_key)]


def _pairwise(heads: int, head_dim: int) -> list[int]:
    """Row 2i of each head is row i, row 2i+1 is row i + head_dim / 2."""
    return [h * head_dim + i // 2 + (i % 2) * head_dim // 2 for h in range(heads) for i in range(head_dim)]


def _value_rows(spec, head_size: int) -> list[int]:
    linear = spec.linear_attention
    order = _tiled(linear.num_key_heads, linear.num_value_heads // linear.num_key_heads)
    return [j * head_size + i for j in order for i in range(head_size)]


def _mlp_tensors(spec, n: int, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's MLP tensors of layer n: a dense MLP's, or its routed experts' matrices stacked in
    expert order [experts, out, in], their router, and the shared expert with its gate where it has one."""
    projections = ("gate", "up", "down")
    if spec.mlp_types[n] == "dense":
        return {f"ffn_{p}.weight": layer[f"mlp.{p}_proj.weight"] for p in projections}
    experts = range(spec.moe.num_experts)
    found = {"ffn_gate_inp.weight": layer["mlp.gate.weight"]}
    for p in projections:
        found[f"ffn_{p}_exps.weight"] = torch.stack(
            [layer[f"mlp.experts.{e}.{p}_proj.weight"] for e in experts]
        )
    if spec.moe.shared_expert_intermediate_size:
        found["ffn_gate_inp_shexp.weight"] = layer["mlp.shared_expert_gate.weight"]
        for p in projections:
            found[f"ffn_{p}_shexp.weight"] = layer[f"mlp.shared_expert.{p}_proj.weight"]
    return found


def expected_gguf_tensors(spec, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors for the merged model, spelt out independently of the writer."""
    merged = {name.replace("model.language_model.", "model."): t for name, t in merged.items()}
    expected = {"token_embd.weight": merged["model.embed_tokens.weight"]}
    if "lm_head.weight" in merged:
        expected["output.weight"] = merged["lm_head.weight"]
    qwen35 = spec.linear_attention is not None

    def norm(weight):
        return weight + 1 if qwen35 else weight

    expected["output_norm.weight"] = norm(merged["model.norm.weight"])
    for n in range(spec.num_layers):
        layer = {k.removeprefix(f"model.layers.{n}."): t for k, t in merged.items() if f"layers.{n}." in k}
        blk = f"blk.{n}."
        expected[blk + "attn_norm.weight"] = norm(layer["input_layernorm.weight"])
        post = "post_attention_norm" if qwen35 else "ffn_norm"
        expected[blk + post + ".weight"] = norm(layer["post_attention_layernorm.weight"])
        expected |= {blk + name: tensor for name, tensor in _mlp_tensors(spec, n, layer).items()}
        if spec.layer_types[n] == "linear_attention":
            linear = spec.linear_attention
            v_rows = _value_rows(spec, linear.value_head_dim)
            heads = _value_rows(spec, 1)
            qkv_rows = list(range(2 * linear.key_dim)) + [2 * linear.key_dim + i for i in v_rows]
            expected[blk + "attn_qkv.weight"] = layer["linear_attn.in_proj_qkv.weight"][qkv_rows]
            expected[blk + "ssm_conv1d.weight"] = layer["linear_attn.conv1d.weight"][qkv_rows, 0, :]
            expected[blk + "attn_gate.weight"] = layer["linear_attn.in_proj_z.weight"][v_rows]
            expected[blk + "ssm_beta.weight"] = layer["linear_attn.in_proj_b.weight"][heads]
            expected[blk + "ssm_alpha.weight"] = layer["linear_attn.in_proj_a.weight"][heads]
            expected[blk + "ssm_a"] = -torch.exp(layer["linear_attn.A_log"][heads])
            expected[blk + "ssm_dt.bias"] = layer["linear_attn.dt_bias"][heads]
            expected[blk + "ssm_norm.weight"] = layer["linear_attn.norm.weight"]
            expected[blk + "ssm_out.weight"] = layer["linear_attn.out_proj.weight"][:, v_rows]
            continue
        q, k = layer["self_attn.q_proj.weight"], layer["self_attn.k_proj.weight"]
        if spec.model_type == "llama":
            q, k = q[_pairwise(spec.num_heads, spec.head_dim)], k[_pairwise(spec.num_kv_heads, spec.head_dim)]
        expected[blk + "attn_q.weight"], expected[blk + "attn_k.weight"] = q, k
        expected[blk + "attn_v.weight"] = layer["self_attn.v_proj.weight"]
        expected[blk + "attn_output.weight"] = layer["self_attn.o_proj.weight"]
        if spec.qk_norm:
            expected[blk + "attn_q_norm.weight"] = norm(layer["self_attn.q_norm.weight"])
            expected[blk + "attn_k_norm.weight"] = norm(layer["self_attn.k_norm.weight"])
    return expected


def llama3_rope_freqs(spec) -> torch.Tensor:
    """llama.cpp converter's rope_freqs for llama3 RoPE, from rope_parameters: the factor each
    frequency's angle is divided by."""
    rope = spec.rope_scaling
    old = rope.original_max_position_embeddings
    base = torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim
    factors = []
    for freq in (1.0 / spec.rope_theta**base).tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old / rope.high_freq_factor:
            factors.append(1.0)
        elif wavelength > old / rope.low_freq_factor:
            factors.append(rope.factor)
        else:
            smooth = (old / wavelength - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / rope.factor + smooth))
    return torch.tensor(factors)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_exports(request, tmp_path_factory):
    """A run of each family (every projection adapted, norms trained), its fp32 merge and f16 GGUF."""
    folder = tmp_path_factory.mktemp(request.param)
    run = make_run(folder, request.param, writer=FAMILIES[request.param], train_norms=True)
    merged = export(run, folder / "merged", merged=True, dtype="float32").out
    result = export(run, folder / "gguf", gguf=True, gguf_type="f16")
    return {"kind": request.param, "run": run, "merged": merged, "gguf": result.out / result.gguf_file}


def _gguf_tensor(tensor) -> torch.Tensor:
    data = torch.from_numpy(tensor.data.copy())
    return data.view(torch.float16) if tensor.tensor_type.name == "F16" else data


# The matrices the writer keeps in f32 whatever the file type, by GGUF name; vectors are f32 too.
GGUF_F32 = (
    "ssm_alpha.weight",
    "ssm_beta.weight",
    "ssm_conv1d.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp_shexp.weight",
)


def test_gguf_tensors_are_the_merged_weights_in_llama_cpps_form(family_exports):
    """Every tensor is the merged model's, transformed as llama.cpp reads it (zero-centred norms +1 but
    the gated norm, A_log as -exp, value heads tiled, the conv squeezed; Llama's Q and K rows in
    adjacent pairs; routed experts stacked), stored f16 but the vectors and the matrices kept in f32,
    and nothing else is in the file but llama3's rope_freqs."""
    from safetensors.torch import load_file

    spec = read_spec(family_exports["run"].parent / "model")
    merged = {}
    for shard in family_exports["merged"].glob("model-*.safetensors"):
        merged.update(load_file(shard))
    expected = expected_gguf_tensors(spec, merged)
    if spec.rope_scaling.rope_type == "llama3":
        expected["rope_freqs.weight"] = llama3_rope_freqs(spec)
    found = {t.name: t for t in gguf.GGUFReader(family_exports["gguf"]).tensors}
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        got = _gguf_tensor(found[name])
        if name == "rope_freqs.weight":
            assert torch.allclose(got, tensor, rtol=1e-6), (got, tensor)
            continue
        assert got.shape == tensor.shape, name
        assert torch.equal(got, tensor.to(got.dtype)), name
        kept_f32 = tensor.dim() == 1 or name.endswith(GGUF_F32)
        assert found[name].tensor_type.name == ("F32" if kept_f32 else "F16"), name


def test_gguf_metadata_is_what_llama_cpp_reads(family_exports):
    fields, _ = read_gguf(family_exports["gguf"])
    spec = read_spec(family_exports["run"].parent / "model")
    qwen35 = spec.linear_attention is not None
    arch = ARCHITECTURES[family_exports["kind"]]
    assert fields["general.architecture"] == arch
    missing = [key.format(arch=arch) for key in REQUIRED_KEYS if key.format(arch=arch) not in fields]
    assert missing == [] or missing == ["tokenizer.chat_template"] and arch == "llama"
    assert fields[f"{arch}.attention.key_length"] == fields[f"{arch}.attention.value_length"] == spec.head_dim
    assert fields[f"{arch}.rope.dimension_count"] == spec.rotary_dim
    assert fields[f"{arch}.block_count"] == spec.num_layers
    if qwen35:
        linear = spec.linear_attention
        assert spec.rotary_dim == spec.head_dim // 4 == 4
        assert fields[f"{arch}.rope.dimension_sections"] == [1, 1, 0, 0]
        assert fields[f"{arch}.full_attention_interval"] == 4
        assert fields[f"{arch}.ssm.conv_kernel"] == linear.conv_kernel
        assert fields[f"{arch}.ssm.state_size"] == linear.key_head_dim
        assert fields[f"{arch}.ssm.group_count"] == linear.num_key_heads
        assert fields[f"{arch}.ssm.time_step_rank"] == linear.num_value_heads
        assert fields[f"{arch}.ssm.inner_size"] == linear.value_dim
    experts = {key.removeprefix(f"{arch}."): value for key, value in fields.items() if ".expert_" in key}
    if spec.moe is None:
        assert experts == {}
    else:
        # tests/checkpoints.py's TINY_MOE: 2 of the experts a token, each of 32; Qwen3.5 MoE's shared
        # expert of 48. Qwen3 MoE's 12 experts are FAMILIES'.
        shared = {"expert_shared_feed_forward_length": 48} if arch == "qwen35moe" else {}
        assert experts == {
            "expert_count": {"qwen3moe": 12, "qwen35moe": 8}[arch],
            "expert_used_count": 2,
            "expert_feed_forward_length": 32,
            **shared,
        }
    if arch == "llama":
        assert fields["tokenizer.ggml.pre"] == "llama-bpe"
        assert fields["tokenizer.ggml.add_bos_token"] is True
        assert fields["tokenizer.ggml.bos_token_id"] == ChatTokenizer.from_folder(
            family_exports["merged"]
        ).token_to_id("<|begin_of_text|>")
    else:
        assert fields["tokenizer.ggml.pre"] == "qwen2"  # the demo tokenizer's split
        assert fields["tokenizer.ggml.add_bos_token"] is False


@pytest.mark.parametrize(
    ("split", "name"),
    [(QWEN2_SPLIT, "qwen2"), (QWEN35_SPLIT, "qwen35"), (LLAMA3_SPLIT, "llama-bpe"), (TEKKEN_SPLIT, "tekken")],
)
def test_each_known_split_gets_llama_cpps_name_for_it(split, name):
    split_step = {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [split_step, byte_level]}) == name
    split_step["pattern"]["Regex"] = split.replace(r"\s+(?!\S)", r"\s+(?!\s)")
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [split_step, byte_level]}) is None


def test_a_sentencepiece_tokenizer_is_refused_in_one_line(tmp_path, run_cli):
    run = make_run(tmp_path, "mistral", writer=write_mistral)
    line = error_line(run_cli("export", run, "--out", tmp_path / "o", "--gguf"))
    assert "cannot export a SentencePiece tokenizer" in line and "tokenizer.model's scores" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_a_layer_pattern_llama_cpp_cannot_express_is_refused(tmp_path, run_cli):
    layer_types = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    run = make_run(tmp_path, "qwen3_5", writer=lambda folder: write_qwen3_5(folder, layer_types=layer_types))
    line = error_line(run_cli("export", run, "--out", tmp_path / "o", "--gguf"))
    assert "one full-attention layer every N layers" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_a_moe_whose_top_k_weights_are_not_renormalised_is_refused(tmp_path, run_cli):
    """llama.cpp's qwen3moe always divides a token's top-k expert weights by their sum."""
    settings = {"vocab_size": VOCAB, "mlp_only_layers": [], "norm_topk_prob": False}
    run = make_run(tmp_path, "qwen3_moe", writer=lambda folder: write_qwen3_moe(folder, **settings))
    line = error_line(run_cli("export", run, "--out", tmp_path / "o", "--gguf"))
    assert (
        "llama.cpp renormalises each token's top-k expert weights" in line and "norm_topk_prob false" in line
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_a_layers_experts_reach_the_file_before_the_next_layer_streams(tmp_path, monkeypatch):
    """A layer's routed experts are held until their stacked tensors are written, and no longer: each
    layer's are in the file before the next layer's first tensor is read."""
    import qlora_cli.export.gguf_folder as gguf_folder

    run = make_run(tmp_path, "qwen3_moe", writer=FAMILIES["qwen3_moe"])
    merged_tensors, sizes = gguf_folder.merged_tensors, {}

    def watched(*args):
        for name, tensor in merged_tensors(*args):
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer is not None and layer not in sizes:
                (partial,) = tmp_path.glob(".g.tmp-export-*/model-bf16.gguf")
                sizes[layer] = partial.stat().st_size
            yield name, tensor

    monkeypatch.setattr(gguf_folder, "merged_tensors", watched)
    out = export(run, tmp_path / "g", gguf=True).out
    ends: dict[int, int] = {}
    for tensor in gguf.GGUFReader(out / "model-bf16.gguf").tensors:
        if tensor.name.endswith("_exps.weight"):
            layer = int(tensor.name.split(".")[1])
            ends[layer] = max(ends.get(layer, 0), tensor.data_offset + tensor.n_bytes)
    assert sorted(sizes) == sorted(ends) == [0, 1, 2]
    for layer in (1, 2):
        assert sizes[layer] >= ends[layer - 1] > sizes[layer - 1]


def test_experts_stored_fused_give_the_gguf_of_experts_stored_one_by_one(tmp_path):
    """transformers 5's fused 3-D experts (gate_up_proj, down_proj) stream as the same per-expert
    matrices, in another order, and become the same stacked tensors."""
    run = make_run(tmp_path, "qwen3_5_moe", writer=FAMILIES["qwen3_5_moe"])
    one_by_one = export(run, tmp_path / "a", gguf=True, gguf_type="f16").out / "model-f16.gguf"
    _fuse_experts(run.parent / "model")
    fused = export(run, tmp_path / "b", gguf=True, gguf_type="f16").out / "model-f16.gguf"
    expected = {t.name: _gguf_tensor(t) for t in gguf.GGUFReader(one_by_one).tensors}
    got = {t.name: _gguf_tensor(t) for t in gguf.GGUFReader(fused).tensors}
    assert sorted(got) == sorted(expected) and "blk.0.ffn_gate_exps.weight" in got
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _stored(x: torch.Tensor, gguf_type: str) -> torch.Tensor:
    """`x` as a GGUF of `gguf_type` holds it (rows cut into blocks along the last dim; f16 where rows
    split into no whole q8_0 blocks, as the writer stores them)."""
    if gguf_type == "q8_0" and x.shape[-1] % 32 == 0:
        kind = gguf.GGMLQuantizationType.Q8_0
        data = gguf.quants.quantize(x.detach().float().numpy(), kind)
        return torch.from_numpy(gguf.quants.dequantize(data, kind)).reshape(x.shape)
    return x.to({"bf16": torch.bfloat16, "f16": torch.float16, "q8_0": torch.float16}[gguf_type]).float()


# The matrices a GGUF keeps in f32: Gated DeltaNet's a and b, a MoE's router and shared expert's gate.
F32_MATRICES = ("in_proj_a.weight", "in_proj_b.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight")


def storage_rounding_error(folder: Path, ids: torch.Tensor, gguf_type: str) -> float:
    """How far the merged model's logits move when its matrices are rounded to `gguf_type` and so are
    the inputs of each matrix product, as llama.cpp's CPU kernels round them (an f16 matrix multiplies
    f16 activations, a q8_0 one q8_0 activations; the routed experts' 3-D matrices and their input
    alike): the error llama.cpp cannot avoid on this model."""
    model = load_transformers(folder)
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
        for name, param in model.named_parameters():
            if param.dim() >= 2 and not name.endswith(F32_MATRICES):
                param.copy_(_stored(param, gguf_type))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
                module.register_forward_pre_hook(lambda _, args: (_stored(args[0], gguf_type),))
            elif hasattr(module, "gate_up_proj"):  # transformers' routed experts: (hidden, choices, weights)
                module.register_forward_pre_hook(lambda _, args: (_stored(args[0], gguf_type), *args[1:]))
        return (model(ids[None]).logits[0] - expected).abs().max().item()


@needs_llama_cpp
@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_llama_cpp_computes_the_merged_model_of_each_family(family_exports, gguf_type, tmp_path):
    """llama.cpp's logits on the GGUF are the fp32 merge's, for Qwen3.5's hybrid layers, for the llama
    architecture (llama3 RoPE through rope_freqs; a head_dim unlike hidden / heads) and for the MoE
    families' routed experts (stacked in expert order, gate and up apart) and shared expert, up to what
    rounding to the file's type does to this model in transformers, twice over (llama.cpp rounds in
    other places too: its f16 KV cache); a mistake in the tensors' form moves them by the logits' own
    size (~3)."""
    path = family_exports["gguf"]
    if gguf_type != "f16":
        result = export(family_exports["run"], tmp_path / "g", gguf=True, gguf_type=gguf_type)
        path = result.out / result.gguf_file
    spec = read_spec(family_exports["run"].parent / "model")
    ids = torch.randint(0, spec.vocab_size - 8, (17,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = load_transformers(family_exports["merged"])(ids[None]).logits[0]
        base = load_transformers(family_exports["run"].parent / "model")(ids[None]).logits[0]
    tolerance = 2 * storage_rounding_error(family_exports["merged"], ids, gguf_type)
    got = torch.tensor(llama_cpp({"model": str(path), "n_ctx": 64, "eval": ids.tolist()})["scores"])
    assert (got - expected).abs().max().item() < tolerance
    assert (base - expected).abs().max().item() > 2 * tolerance


class _DoubledTensors(KindTensors):
    """A GGUF form for the test-only layer kind: its tensors doubled, kept in f32, one metadata key."""

    prefix = "mixer_x."

    def transform(self, name, tensor):
        return 2 * tensor

    def keeps_f32(self, name):
        return True

    def add_metadata(self, writer):
        writer.add_uint32("mixer_x.width", self.spec.hidden_size)


def _spec_with_layer_kind(kind: str) -> ModelSpec:
    return dataclasses.replace(TINY_SPEC, num_layers=2, layer_types=("full_attention", kind))


def test_a_layer_kind_gets_its_gguf_form_through_the_registry_alone(monkeypatch):
    """Registered in GGUF_LAYER_KINDS, a kind's own tensors take its transform and the architecture's
    after it; attention's and the rest take the architecture's alone; its metadata is written."""
    monkeypatch.setitem(GGUF_LAYER_KINDS, "mixer_x", _DoubledTensors)
    family = architecture(_spec_with_layer_kind("mixer_x"))
    own, query = "model.layers.1.mixer_x.w.weight", "model.layers.0.self_attn.q_proj.weight"
    weight = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    assert torch.equal(family.transform(own, weight), 2 * weight)
    assert family.keeps_f32(own) and not family.keeps_f32(query)
    assert torch.equal(family.transform(query, weight), pairwise_rope_rows(weight, 4))

    class Keys:
        def __init__(self):
            self.written = {}

        def __getattr__(self, name):
            return lambda *values: self.written.__setitem__(name, values)

    writer = Keys()
    family.add_metadata(writer, None)
    assert writer.written["add_uint32"] == ("mixer_x.width", 64)


def test_a_layer_kind_without_a_gguf_form_is_refused_in_one_line():
    with pytest.raises(QLoraError, match="no GGUF form for layers of kind 'mixer_x'"):
        architecture(_spec_with_layer_kind("mixer_x"))


def test_an_mlp_kind_without_a_gguf_form_is_refused_in_one_line():
    spec = dataclasses.replace(TINY_SPEC, num_layers=2, mlp_types=("dense", "mlp_x"))
    with pytest.raises(QLoraError, match="no GGUF form for MLPs of kind 'mlp_x'"):
        architecture(spec)
