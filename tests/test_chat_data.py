"""Chat and prompt formats at the token level: which token ids get labels, for ShareGPT role mapping,
train_on_eos, train_on_inputs, per-message training, the shipped chat templates and Axolotl's types."""

import json

import pytest
from test_data import CONVERSATION, DEMO_MODEL, MASK, expected, only, write_jsonl
from tokenizers import Tokenizer

from qlora_cli.config.loading import config_from_dict
from qlora_cli.config.schema import DatasetConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.data.examples import load_examples, prepare_data
from qlora_cli.sources.chat_templates import choose_template
from qlora_cli.sources.tokenizer import ChatTokenizer

SHAREGPT = [
    {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
    for m in CONVERSATION
]
SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
USER_1 = "<|im_start|>user\nReverse: cat, sun<|im_end|>\n"
USER_2 = "<|im_start|>user\nCapital of Peru?<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def load(tok, tmp_path, rows, sequence_len=512, train_on_inputs=False, **fields):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    spec = DatasetConfig(path=str(path), **{"type": "chat_template", **fields})
    return load_examples(spec, tok, sequence_len, train_on_inputs=train_on_inputs)


def assert_pieces(tok, example, pieces):
    ids, labels = expected(tok, pieces)
    assert tok.decode(example.input_ids) == tok.decode(ids)
    assert example.input_ids == ids
    assert example.labels == labels


ASSISTANT_TRAINED = [
    (SYSTEM + USER_1 + ASSISTANT, False),
    ("sun, cat<|im_end|>", True),
    ("\n" + USER_2 + ASSISTANT, False),
    ("Lima.<|im_end|>", True),
    ("\n", False),
]


@pytest.mark.parametrize(
    "row, fields",
    [
        ({"conversations": SHAREGPT}, {"type": "sharegpt"}),
        ({"conversations": SHAREGPT}, {"type": "sharegpt:chat"}),
        ({"conversations": SHAREGPT}, {}),
        ({"conversations": SHAREGPT}, {"roles_to_train": ["gpt"]}),
        (
            {"chat": SHAREGPT},
            {"field_messages": "chat", "message_property_mappings": {"role": "from", "content": "value"}},
        ),
        ({"chat": SHAREGPT}, {"field_messages": "chat", "message_field_role": "from", "message_field_content": "value"}),
        (
            {"dialog": [{"speaker": {"gpt": "bot", "human": "person"}.get(m["from"], m["from"]), "text": m["value"]} for m in SHAREGPT]},
            {
                "field_messages": "dialog",
                "message_property_mappings": {"role": "speaker", "content": "text"},
                "roles": {"assistant": ["bot"], "user": ["person"]},
                "roles_to_train": ["bot"],
            },
        ),
    ],
)  # fmt: skip
def test_sharegpt_renders_template_roles_and_trains_only_assistant_content(tok, tmp_path, row, fields):
    example = only(load(tok, tmp_path, [row], **fields))
    assert_pieces(tok, example, ASSISTANT_TRAINED)
    text = tok.decode(example.input_ids)
    assert "human" not in text and "gpt" not in text and "bot" not in text
    # Header tokens are never labels: every label is inside an assistant answer or its <|im_end|>.
    trained_ids = [label for label in example.labels if label != MASK]
    assert trained_ids == tok.encode("sun, cat<|im_end|>") + tok.encode("Lima.<|im_end|>")


def _renamed(conversation, names):
    return [{**m, "from": names.get(m["from"], m["from"])} for m in conversation]


@pytest.mark.parametrize(
    "names",
    [{"gpt": "chatgpt"}, {"gpt": "bing"}, {"gpt": "bard"}, {"gpt": "bot"}, {"gpt": "model", "human": "user"},
     {"gpt": "assistant", "human": "prompter"}],
)  # fmt: skip
def test_the_assistant_names_of_real_sharegpt_dumps_are_the_assistant(tok, tmp_path, names):
    example = only(load(tok, tmp_path, [{"conversations": _renamed(SHAREGPT, names)}], type="sharegpt"))
    assert_pieces(tok, example, ASSISTANT_TRAINED)


def test_tool_turns_under_other_names_render_as_tool(tok, tmp_path):
    for name in ("function", "observation"):
        conversation = [*SHAREGPT, {"from": name, "value": "42"}, {"from": "gpt", "value": "It is 42."}]
        example = only(load(tok, tmp_path, [{"conversations": conversation}]))
        assert "<|im_start|>tool\n42<|im_end|>" in tok.decode(example.input_ids)


def test_a_null_content_is_no_text_in_an_assistant_turn_that_calls_tools(tok, tmp_path):
    """OpenAI's format writes a tool call's content as null; elsewhere null is refused (test_data)."""
    qwen_25 = choose_template(tok, "qwen_25", None)
    call = [{"function": {"name": "w", "arguments": {"c": "Lima"}}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    example = only(load(qwen_25, tmp_path, [{"messages": messages}]))
    trained = tok.decode([label for label in example.labels if label != MASK])
    assert (
        trained
        == '<tool_call>\n{"name": "w", "arguments": {"c": "Lima"}}\n</tool_call><|im_end|>Sunny.<|im_end|>'
    )


def test_a_role_no_template_knows_stops_naming_the_role_file_and_row(tok, tmp_path):
    rows = [{"conversations": SHAREGPT}, {"conversations": _renamed(SHAREGPT, {"gpt": "narrator"})}]
    with pytest.raises(
        QLoraError,
        match=r"chat\.jsonl:2: message 2: role 'narrator' is not one the chat template knows "
        r"\(system, user, assistant, tool\); .* roles: \{assistant: \[narrator\]\}$",
    ):
        load(tok, tmp_path, rows, type="sharegpt")
    # A role the config's `roles` names is the template's own, rendered as given.
    example = only(
        load(tok, tmp_path, rows[1:], roles={"narrator": ["narrator"]}, roles_to_train=["narrator"])
    )
    assert "<|im_start|>narrator\nsun, cat<|im_end|>" in tok.decode(example.input_ids)


NO_EOS = [
    (SYSTEM + USER_1 + ASSISTANT, False), ("sun, cat", True), ("<|im_end|>\n" + USER_2 + ASSISTANT, False),
    ("Lima.", True), ("<|im_end|>\n", False),
]  # fmt: skip


@pytest.mark.parametrize(
    "train_on_eos, pieces",
    [
        ("turn", ASSISTANT_TRAINED),
        (True, ASSISTANT_TRAINED),
        ("none", NO_EOS),
        (False, NO_EOS),
        (
            "last",
            [(SYSTEM + USER_1 + ASSISTANT, False), ("sun, cat", True), ("<|im_end|>\n" + USER_2 + ASSISTANT, False),
             ("Lima.<|im_end|>", True), ("\n", False)],
        ),
        (
            "all",
            [("<|im_start|>system\nBe brief.", False), ("<|im_end|>", True), ("\n<|im_start|>user\nReverse: cat, sun", False),
             ("<|im_end|>", True), ("\n" + ASSISTANT, False), ("sun, cat<|im_end|>", True),
             ("\n<|im_start|>user\nCapital of Peru?", False), ("<|im_end|>", True), ("\n" + ASSISTANT, False),
             ("Lima.<|im_end|>", True), ("\n", False)],
        ),
    ],
)  # fmt: skip
def test_train_on_eos(tok, tmp_path, train_on_eos, pieces):
    example = only(load(tok, tmp_path, [{"conversations": SHAREGPT}], train_on_eos=train_on_eos))
    assert_pieces(tok, example, pieces)


@pytest.mark.parametrize("last_role", ["user", "tool"])
def test_train_on_eos_last_trains_the_last_turns_end_even_when_it_is_not_trained(tok, tmp_path, last_role):
    """As Axolotl's `last`: the end-of-turn token of the conversation's last turn, whatever its role; the
    answer before it keeps its content but not its own end-of-turn token."""
    messages = [*CONVERSATION[1:3], {"role": last_role, "content": "Thanks."}]
    example = only(load(tok, tmp_path, [{"messages": messages}], train_on_eos="last"))
    assert_pieces(
        tok,
        example,
        [
            (USER_1 + ASSISTANT, False), ("sun, cat", True),
            (f"<|im_end|>\n<|im_start|>{last_role}\nThanks.", False), ("<|im_end|>", True), ("\n", False),
        ],
    )  # fmt: skip


def test_train_on_inputs_trains_every_turns_content_but_no_header(tok, tmp_path):
    example = only(load(tok, tmp_path, [{"messages": CONVERSATION}], train_on_inputs=True))
    assert_pieces(
        tok,
        example,
        [
            ("<|im_start|>system\n", False), ("Be brief.<|im_end|>", True), ("\n<|im_start|>user\n", False),
            ("Reverse: cat, sun<|im_end|>", True), ("\n" + ASSISTANT, False), ("sun, cat<|im_end|>", True),
            ("\n<|im_start|>user\n", False), ("Capital of Peru?<|im_end|>", True), ("\n" + ASSISTANT, False),
            ("Lima.<|im_end|>", True), ("\n", False),
        ],
    )  # fmt: skip


def test_a_message_training_flag_overrides_roles(tok, tmp_path):
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["training"] = False
    messages[1]["training"] = True
    example = only(load(tok, tmp_path, [{"messages": messages}]))
    assert_pieces(
        tok,
        example,
        [
            (SYSTEM + "<|im_start|>user\n", False), ("Reverse: cat, sun<|im_end|>", True),
            ("\n" + ASSISTANT + "sun, cat<|im_end|>\n" + USER_2 + ASSISTANT, False), ("Lima.<|im_end|>", True),
            ("\n", False),
        ],
    )  # fmt: skip


def test_drop_system_message(tok, tmp_path):
    example = only(load(tok, tmp_path, [{"conversations": SHAREGPT}], drop_system_message=True))
    assert not tok.decode(example.input_ids).startswith("<|im_start|>system")


# ----- chat templates -----


def bare_tokenizer(template=None):
    return ChatTokenizer(
        Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json")),
        source="bare",
        chat_template=template,
        eos_token="<|endoftext|>",
    )


def test_qwen3_template_trains_the_last_answers_think_block_and_drops_past_reasoning(tok, tmp_path):
    qwen3 = choose_template(tok, "qwen3", None)
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "add"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "thinking": "add again"},
    ]
    path = write_jsonl(tmp_path / "think.jsonl", [{"messages": messages}])
    spec = DatasetConfig(
        path=str(path), type="chat_template", message_property_mappings={"reasoning_content": "thinking"}
    )
    answers = "4<|im_end|><think>\nadd again\n</think>\n\n6<|im_end|>"
    every_end = "<|im_end|>4<|im_end|><|im_end|><think>\nadd again\n</think>\n\n6<|im_end|>"
    for eos, trained in (("turn", answers), ("all", every_end)):
        spec.train_on_eos = eos
        example = only(load_examples(spec, qwen3, 512))
        assert tok.decode([label for label in example.labels if label != MASK]) == trained
    assert tok.decode(example.input_ids) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6<|im_end|>\n"
    )
    assert qwen3.render_chat(messages[:1], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen_25_adds_its_system_message_and_tool_turns():
    qwen_25 = choose_template(bare_tokenizer(), "qwen_25", None)
    text = qwen_25.render_chat(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {"c": "Lima"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "20C"},
        ]
    )  # fmt: skip
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "w", "arguments": {"c": "Lima"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20C\n</tool_response><|im_end|>\n"
    )


def test_template_choice(tmp_path):
    bare = bare_tokenizer()
    with pytest.raises(QLoraError, match="no chat template; choose one with chat_template: chatml"):
        bare.render_chat([{"role": "user", "content": "x"}])
    assert (
        choose_template(bare, "tokenizer_default_fallback_chatml", None).render_chat(
            [{"role": "user", "content": "x"}]
        )
        == "<|im_start|>user\nx<|im_end|>\n"
    )
    own = bare_tokenizer("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert choose_template(own, "tokenizer_default_fallback_chatml", None) is own
    assert choose_template(own, None, None) is own
    jinja = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"
    for chosen in (
        choose_template(own, "jinja", jinja),
        choose_template(own, None, jinja),
        choose_template(own, jinja, None),
    ):
        assert chosen.render_chat([{"role": "user", "content": "x"}]) == "<user>x<|im_end|>"
    with pytest.raises(QLoraError, match="'llama3' writes '<\\|start_header_id\\|>'"):
        choose_template(own, "llama3", None)
    with pytest.raises(QLoraError, match="'jinja' needs the template in chat_template_jinja"):
        choose_template(own, "jinja", None)
    with pytest.raises(QLoraError, match="chat_template_jinja does not compile"):
        choose_template(own, "jinja", "{% for %}")


# ----- other types -----


def test_alpaca_variants(tok, tmp_path):
    rows = [
        {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
        {"instruction": "Add.", "input": "2, 3", "output": "5"},
    ]
    chat = load(tok, tmp_path, rows, type="alpaca_chat")
    assert_pieces(
        tok,
        chat[0],
        [
            (
                "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
                "USER: Add 2 and 3.\nASSISTANT:",
                False,
            ),
            ("5", True),
            (tok.eos_token, True),
        ],
    )
    assert tok.decode(chat[1].input_ids).endswith("USER: Add.\n2, 3\nASSISTANT:5" + tok.eos_token)
    chatml = load(tok, tmp_path, rows, type="alpaca:chatml")
    assert_pieces(
        tok,
        chatml[1],
        [
            ("<|im_start|>user\nAdd.\n2, 3<|im_end|>\n<|im_start|>assistant\n", False),
            ("5<|im_end|>", True),
            ("\n", False),
        ],
    )
    inputs = load(tok, tmp_path, rows[:1], type="alpaca", train_on_inputs=True, train_on_eos="none")
    assert all(label != MASK for label in inputs[0].labels[:-2]) and inputs[0].labels[-2:] == [MASK, MASK]
    with_system = load(tok, tmp_path, [{**rows[0], "system": "Answer with a digit.\n"}], type="alpaca")
    assert tok.decode(with_system[0].input_ids).startswith("Answer with a digit.\n### Instruction:")


def test_completion_reads_axolotl_text_rows_and_input_output_segments(tok, tmp_path):
    example = only(load(tok, tmp_path, [{"text": "The cat sat."}], type="completion"))
    assert_pieces(tok, example, [("The cat sat.", True), (tok.eos_token, True)])
    example = only(load(tok, tmp_path, [{"body": "The cat sat."}], type="completion", field="body"))
    assert_pieces(tok, example, [("The cat sat.", True), (tok.eos_token, True)])
    segments = [
        {"text": "Q: 2+2?\n", "label": False},
        {"text": "A: 4", "label": True},
        {"text": "<|endoftext|>"},
    ]
    example = only(load(tok, tmp_path, [{"segments": segments}], type="input_output"))
    assert_pieces(tok, example, [("Q: 2+2?\n", False), ("A: 4", True), ("<|endoftext|>", True)])
    with pytest.raises(QLoraError, match=r"chat\.jsonl:1: segment 0: field 'label' must be true or false"):
        load(tok, tmp_path, [{"segments": [{"text": "x", "label": "yes"}]}], type="input_output")


def test_unknown_types_are_refused_naming_what_to_use(tok, tmp_path):
    with pytest.raises(
        QLoraError,
        match=r"type 'oasst' is not a dataset format qlora reads; convert .* chat_template, sharegpt, alpaca",
    ):
        load(tok, tmp_path, [{"text": "x"}], type="oasst")


# ----- dropped rows -----


def data_config(tmp_path, rows, **keys):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    dataset = {"path": str(path), "type": "chat_template", **keys.pop("dataset", {})}
    return config_from_dict(
        {"base_model": str(DEMO_MODEL), "datasets": [dataset], "sequence_len": 64, **keys}
    )


def test_all_rows_dropped_names_the_reasons_not_the_validation_split(tok, tmp_path):
    wrong_roles = [
        {"conversations": [{"from": "system", "value": "hi"}, {"from": "human", "value": "yo"}]}
    ] * 3
    too_long = [
        {"messages": [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]}
    ]
    config = data_config(tmp_path, wrong_roles + too_long, val_set_size=0)
    with pytest.raises(QLoraError) as error:
        prepare_data(config, tok)
    message = str(error.value)
    assert "every one of the 4 rows" in message and "validation" not in message
    assert (
        "3 rows with no turn of a trained role (roles_to_train: assistant; their roles: system, user)"
        in message
    )
    assert "1 row with no trained token within sequence_len" in message


def test_prepare_data_notes_and_test_datasets(tok, tmp_path):
    rows = [{"messages": CONVERSATION}] * 3 + [{"messages": [{"role": "user", "content": "x"}]}]
    test_file = write_jsonl(tmp_path / "test.jsonl", [{"messages": CONVERSATION[:3]}])
    config = data_config(
        tmp_path, rows, sequence_len=512, dataset_exact_deduplication=True,
        test_datasets=[{"path": str(test_file), "type": "chat_template"}],
    )  # fmt: skip
    data = prepare_data(config, tok)
    assert (len(data.train), len(data.validation), data.duplicates) == (1, 1, 2)
    assert data.notes() == [
        f"{tmp_path / 'rows.jsonl'}: 1 row with no turn of a trained role (their roles: user) dropped",
        "2 duplicate examples removed (dataset_exact_deduplication)",
    ]


def test_chat_template_kwargs_reach_the_template(tok, tmp_path):
    template = "{% for m in messages %}{{ greeting }} {{ m.content }}<|im_end|>{% endfor %}"
    config = data_config(tmp_path, [{"messages": CONVERSATION[:3]}], sequence_len=512, chat_template_jinja=template,
                         chat_template_kwargs={"greeting": "hey"})  # fmt: skip
    example = prepare_data(config, tok).train[0]
    assert tok.decode(example.input_ids).startswith("hey Be brief.<|im_end|>hey Reverse")
    assert json.dumps(config.chat_template_kwargs) == '{"greeting": "hey"}'


def test_a_dataset_can_choose_its_own_chat_template(tok, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", [{"messages": CONVERSATION[1:3]}])
    config = data_config(
        tmp_path, [{"messages": CONVERSATION[1:3]}], sequence_len=512, chat_template="qwen_25",
        dataset={"chat_template_jinja": "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"},
    )  # fmt: skip
    config.datasets.append(DatasetConfig(path=str(other), type="chat_template"))
    own, shared = (tok.decode(e.input_ids) for e in prepare_data(config, tok).train)
    assert own == "user: Reverse: cat, sun<|im_end|>assistant: sun, cat<|im_end|>"
    assert shared.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_dataset_problems_are_reported_together(tmp_path):
    with pytest.raises(QLoraError) as error:
        data_config(
            tmp_path, [], chat_template="gemma",
            dataset={"type": "oasst", "shards": 2, "shards_idx": 2, "trust_remote_code": True},
        )  # fmt: skip
    message = str(error.value)
    for part in ("'datasets[0].type': type 'oasst'", "'gemma' is not a chat template qlora ships", "shards_idx': 2 is not below shards 2",
                 "never runs a dataset's loading script"):  # fmt: skip
        assert part in message


def test_a_mapping_type_is_a_user_defined_instruction_format(tok, tmp_path):
    rows = [{"q": "2+2?", "ctx": "", "a": "4"}, {"q": "Add", "ctx": "1, 2", "a": "3", "sys": "Be exact."}]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    names = {"field_instruction": "q", "field_input": "ctx", "field_output": "a", "field_system": "sys"}
    formats = {"format": "[INST] {instruction}\n{input} [/INST]", "no_input_format": "[INST] {instruction} [/INST]",
               "system_format": "<<SYS>>{system}<</SYS>>"}  # fmt: skip
    config = config_from_dict(
        {"base_model": str(DEMO_MODEL), "datasets": [{"path": str(path), "type": {**names, **formats}}]}
    )
    first, second = prepare_data(config, tok).train
    assert_pieces(tok, first, [("[INST] 2+2? [/INST]", False), ("4", True), (tok.eos_token, True)])
    assert_pieces(
        tok,
        second,
        [("<<SYS>>Be exact.<</SYS>>[INST] Add\n1, 2 [/INST]", False), ("3", True), (tok.eos_token, True)],
    )
    alpaca = config_from_dict(
        {"base_model": str(DEMO_MODEL), "datasets": [{"path": str(path), "type": names}]}
    )
    assert tok.decode(prepare_data(alpaca, tok).train[0].input_ids).endswith(
        "### Instruction:\n2+2?\n\n### Response:\n4" + tok.eos_token
    )
    with pytest.raises(
        QLoraError, match=r"'datasets\[0\]\.type': format '\{question\}' is not a format string"
    ):
        config_from_dict(
            {
                "base_model": str(DEMO_MODEL),
                "datasets": [{"path": str(path), "type": {"format": "{question}"}}],
            }
        )
