"""The chat templates qlora ships for Qwen, Llama 3 and Mistral: what each renders (Axolotl's text), which
vocabulary each needs, the end-of-turn text each declares, and Qwen3.5's own thinking template rendering
in the sandbox and training on the assistant's text."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from checkpoints import DEMO_TOKENIZER, write_llama3_tokenizer, write_mistral_tokenizer

from qlora_cli.config.loading import load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import SHIPPED_TEMPLATES
from qlora_cli.data.report import data_report
from qlora_cli.sources.chat_templates import SHIPPED, choose_template
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import stop_ids

QWEN3_5_TEMPLATE = DEMO_TOKENIZER.parents[2] / "tests" / "templates" / "qwen3_5.jinja"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": " Hello there "},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    write_llama3_tokenizer(root / "llama", 320)
    write_mistral_tokenizer(root / "mistral", 320)
    return {
        "qwen": ChatTokenizer.from_folder(DEMO_TOKENIZER),
        "llama": ChatTokenizer.from_folder(root / "llama"),
        "mistral": ChatTokenizer.from_folder(root / "mistral"),
    }


@pytest.mark.parametrize(
    ("family", "name", "text"),
    [
        ("llama", "llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\nHello there<|eot_id|>"),
        ("mistral", "mistral_v1", "<s> [INST] Be brief.\n\nHi [/INST]  Hello there </s>"),
        # v2/v3 and v3 tekken attach the system message only to a final user turn: a training row drops it.
        ("mistral", "mistral_v2v3", "<s>[INST] Hi[/INST] Hello there</s>"),
        ("mistral", "mistral_v3_tekken", "<s>[INST]Hi[/INST] Hello there </s>"),
    ],
)  # fmt: skip
def test_shipped_templates_render_what_axolotls_render(tokenizers, family, name, text):
    assert choose_template(tokenizers[family], name, None).render_chat(CHAT) == text


def test_mistral_v2v3_puts_the_system_message_on_a_final_user_turn(tokenizers):
    mistral = choose_template(tokenizers["mistral"], "mistral_v2v3", None)
    assert mistral.render_chat(CHAT[:2]) == "<s>[INST] Be brief.\n\nHi[/INST]"


def test_mistral_v7_tekken_always_writes_a_system_prompt(tokenizers):
    tekken = ChatTokenizer.from_folder(tokenizers["mistral"].source)
    tekken = tekken.with_chat_template(SHIPPED["mistral_v7_tekken"].text, "test")
    assert tekken.render_chat(CHAT).startswith("<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]")
    assert "The current date is 20" in tekken.render_chat(CHAT[1:])


def test_mistral_templates_refuse_roles_out_of_order(tokenizers):
    mistral = choose_template(tokenizers["mistral"], "mistral_v3_tekken", None)
    with pytest.raises(QLoraError, match="Conversation roles must alternate"):
        mistral.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    ("family", "name", "lacking"),
    [
        ("qwen", "llama3", "'<|start_header_id|>'"),
        ("qwen", "mistral_v1", "a BOS token"),
        ("llama", "chatml", "'<|im_start|>'"),
        ("mistral", "mistral_v7_tekken", "'[SYSTEM_PROMPT]'"),
        ("llama", "tokenizer_default_fallback_qwen3", "'<|im_start|>'"),
    ],
)
def test_a_template_the_vocabulary_cannot_write_is_one_line_naming_what_fits(
    tokenizers, family, name, lacking
):
    tokenizer = tokenizers[family]
    with pytest.raises(QLoraError) as error:
        choose_template(tokenizer, name, None)
    message = str(error.value)
    assert "\n" not in message
    assert f"'{name}' writes {lacking}, which the tokenizer of {tokenizer.source} lacks" in message
    fitting = {"qwen": "chatml, qwen_25, qwen3)", "llama": "(tokenizer_default, llama3, mistral_v1"}
    assert fitting.get(family, "mistral_v3_tekken)") in message


def test_each_template_declares_its_end_of_turn(tokenizers):
    assert choose_template(tokenizers["llama"], "llama3", None).end_of_turn == "<|eot_id|>"
    assert choose_template(tokenizers["qwen"], "qwen3", None).end_of_turn == "<|im_end|>"
    for name in ("mistral_v1", "mistral_v2v3", "mistral_v3_tekken"):
        assert choose_template(tokenizers["mistral"], name, None).end_of_turn == "</s>"
    assert choose_template(tokenizers["llama"], None, None).end_of_turn is None
    assert SHIPPED.keys() == set(SHIPPED_TEMPLATES)


def test_the_declared_end_of_turn_is_what_an_assistant_turn_ends_with(tokenizers):
    family = {"chatml": "qwen", "qwen_25": "qwen", "qwen3": "qwen", "llama3": "llama"}
    for name in SHIPPED_TEMPLATES:
        if name == "mistral_v7_tekken":
            continue  # the tiny Mistral tokenizer has no [SYSTEM_PROMPT]
        tokenizer = choose_template(tokenizers[family.get(name, "mistral")], name, None)
        assert tokenizer.render_chat(CHAT).rstrip().endswith(tokenizer.end_of_turn), name


QWEN3_5_CHAT = [
    {"role": "system", "content": "  Think first.  "},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "call the tool",
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris", "days": [1, 2]}}}],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


def test_qwen3_5_thinking_template_renders_in_the_sandbox():
    tokenizer = ChatTokenizer.from_folder(DEMO_TOKENIZER).with_chat_template(
        QWEN3_5_TEMPLATE.read_text(), "qwen3.5"
    )
    text = tokenizer.render_chat(QWEN3_5_CHAT)
    assert text.startswith(
        "<|im_start|>system\nThink first.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    assert "<|im_start|>assistant\n4<|im_end|>\n" in text  # a past turn's reasoning is dropped
    assert (
        "<|im_start|>assistant\n<think>\ncall the tool\n</think>\n\n<tool_call>\n<function=weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is sunny.<|im_end|>\n")
    prompt = QWEN3_5_CHAT[:2]
    assert tokenizer.render_chat(prompt, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n"
    )
    closed = tokenizer.render_chat(prompt, add_generation_prompt=True, enable_thinking=False)
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(QLoraError, match="System message must be at the beginning"):
        tokenizer.render_chat([*prompt, {"role": "system", "content": "late"}])


def _data_report(tmp_path, source, rows, **keys):
    """`qlora data`'s report for `rows` rendered by a copy of the tokenizer at `source`."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(source) / file).is_file():
            shutil.copy(Path(source) / file, folder / file)
    shape = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 512}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(shape))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    config = {"base_model": str(folder), "datasets": [{"path": str(data), "type": "chat_template"}],
              "sequence_len": 256, **keys}  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return data_report(load_config(path))


def _trained_text(report) -> str:
    """The tokens training predicts (labels are the next token of each position)."""
    return report.tokenizer.decode([label for label in report.train[0].labels if label != -100])


@pytest.mark.parametrize(
    ("family", "name", "trained"),
    [("llama", "llama3", "Hello there<|eot_id|>"), ("mistral", "mistral_v3_tekken", "Hello there </s>")],
)
def test_training_rows_train_the_assistant_text_and_its_end_of_turn(
    tmp_path, tokenizers, family, name, trained
):
    report = _data_report(tmp_path, tokenizers[family].source, [CHAT], chat_template=name)
    assert _trained_text(report) == trained
    assert report.train[0].input_ids.count(report.tokenizer.bos_token_id) == 1  # no second BOS


def test_llama3_on_a_base_llama_trains_and_stops_at_eot_id_not_at_its_eos(tmp_path):
    """A base Llama 3's eos is <|end_of_text|>, not the <|eot_id|> that closes the llama3 template's turns
    (the other tests' tokenizer is an Instruct one, whose eos is <|eot_id|>): the template must declare
    its own end of turn, or generation would stop at <|end_of_text|> only. Training finds the end of a
    turn in the rendered text, and trains <|eot_id|>."""
    folder = tmp_path / "base-llama"
    write_llama3_tokenizer(folder, 320, eos_token="<|end_of_text|>")
    tokenizer = choose_template(ChatTokenizer.from_folder(folder), "llama3", None)
    stops = {tokenizer.token_to_id(token) for token in ("<|eot_id|>", "<|end_of_text|>")}
    assert stop_ids(tokenizer, {}) == stops
    assert tokenizer.eos_token == "<|end_of_text|>" and tokenizer.end_of_turn == "<|eot_id|>"
    report = _data_report(tmp_path, folder, [CHAT], chat_template="llama3")
    assert _trained_text(report) == "Hello there<|eot_id|>"


def test_qwen3_5_own_template_trains_the_last_turn_with_its_think_block(tmp_path):
    folder = tmp_path / "qwen3_5"
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / file, folder / file)
    shutil.copy(QWEN3_5_TEMPLATE, folder / "chat_template.jinja")
    row = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>greet</think>Hello"}]
    report = _data_report(tmp_path, folder, [row], chat_template="tokenizer_default")
    # The generation prompt opens the think block (thinking on), so training starts inside it.
    assert _trained_text(report) == "greet\n</think>\n\nHello<|im_end|>"
