"""ChatTokenizer on the shipped demo tokenizer: ids, special tokens, and the sandboxed chat template."""

import json
import shutil
from pathlib import Path

import pytest

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.tokenizer import ChatTokenizer

DEMO_MODEL = Path(__file__).resolve().parents[1] / "configs" / "demo" / "tiny-qwen3"


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def model_folder(tmp_path: Path, **config) -> Path:
    """A copy of the demo tokenizer whose tokenizer_config.json is replaced by `config`."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(DEMO_MODEL / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))
    return folder


@pytest.mark.parametrize(
    "text",
    ["Anna has 7 apples and gets 5 more.", "  two  spaces\n\nand lines\t", "naïve café: 12 × 3 = 36 ✓", ""],
)
def test_encode_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_are_single_ids_and_never_added(tokenizer):
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        assert tokenizer.encode(token) == [tokenizer.token_to_id(token)]
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tokenizer.encode("") == []
    assert tokenizer.eos_token_id == end
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.bos_token_id is None
    assert tokenizer.vocab_size == 1024


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of Peru?"},
        {"role": "assistant", "content": "The capital of Peru is Lima."},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCapital of Peru?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of Peru is Lima.<|im_end|>\n"
    )
    assert tokenizer.render_chat(messages) == expected
    prompt = tokenizer.render_chat(messages[:2], add_generation_prompt=True)
    assert prompt == expected[: expected.index("The capital")]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{% set x = messages.append(1) %}{{ x }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(tmp_path, template):
    tokenizer = ChatTokenizer.from_folder(model_folder(tmp_path, chat_template=template))
    with pytest.raises(QLoraError, match="chat template .* failed to render"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_template_helpers(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ m | tojson }}{% endfor %}"
    )
    tokenizer = ChatTokenizer.from_folder(model_folder(tmp_path, chat_template=template))
    assert (
        tokenizer.render_chat([{"role": "user", "content": "<a & b>"}])
        == '{"role": "user", "content": "<a & b>"}'
    )
    with pytest.raises(QLoraError, match="no tools here"):
        tokenizer.render_chat([{"role": "tool", "content": "x"}])


def test_named_templates_pick_default_and_jinja_file_wins(tmp_path):
    folder = model_folder(
        tmp_path,
        chat_template=[{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}],
        pad_token={"content": "<|endoftext|>", "special": True},
    )
    tokenizer = ChatTokenizer.from_folder(folder)
    assert tokenizer.render_chat([]) == "plain"
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>")
    (folder / "chat_template.jinja").write_text("from file")
    assert ChatTokenizer.from_folder(folder).render_chat([]) == "from file"


def test_pad_falls_back_to_eos_and_no_template_is_an_error(tmp_path):
    tokenizer = ChatTokenizer.from_folder(model_folder(tmp_path))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    with pytest.raises(QLoraError, match="has no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_bad_folders_are_user_errors(tmp_path):
    with pytest.raises(QLoraError, match="no tokenizer.json"):
        ChatTokenizer.from_folder(tmp_path)
    with pytest.raises(QLoraError, match="does not compile"):
        ChatTokenizer.from_folder(model_folder(tmp_path, chat_template="{% for %}"))
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(QLoraError, match="not in the tokenizer's vocabulary"):
        ChatTokenizer.from_folder(tmp_path / "model")
