"""Datasets to labelled examples (exact label positions per type, clear errors) and the batch plan."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from qlora_cli.config.schema import DatasetConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.data.examples import LONGER, TOO_LONG, BatchPlan, Example, load_examples, split_validation
from qlora_cli.sources.tokenizer import ChatTokenizer

DEMO_MODEL = Path(__file__).resolve().parents[1] / "configs" / "demo" / "tiny-qwen3"
MASK = -100


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def dataset(path, type="chat_template", **fields):
    return DatasetConfig(path=str(path), type=type, **fields)


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def expected(tok, pieces):
    """input_ids and shifted labels for (text, trained) pieces, each tokenized on its own."""
    ids, trained = [], []
    for piece, is_trained in pieces:
        piece_ids = [piece] if isinstance(piece, int) else tok.encode(piece)
        ids += piece_ids
        trained += [is_trained] * len(piece_ids)
    labels = [ids[t + 1] if trained[t + 1] else MASK for t in range(len(ids) - 1)] + [MASK]
    return ids, labels


def only(examples) -> Example:
    assert len(examples) == 1
    return examples[0]


# ----- masking per type -----


def test_alpaca_masks_the_prompt(tok, tmp_path):
    rows = [
        {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
        {"instruction": "Add these.", "input": "2, 3", "output": "5"},
    ]
    examples = load_examples(dataset(write_jsonl(tmp_path / "a.jsonl", rows), "alpaca"), tok, 512)
    no_input = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n"
    )
    with_input = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd these.\n\n"
        "### Input:\n2, 3\n\n### Response:\n"
    )
    for example, prompt in zip(examples, [no_input, with_input], strict=True):
        ids, labels = expected(tok, [(prompt, False), ("5", True), (tok.eos_token_id, True)])
        assert example.input_ids == ids and example.labels == labels
        assert example.labels[-3:] == [tok.encode("5")[0], tok.eos_token_id, MASK]


def test_completion_and_train_on_eos_off(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "2 + 3 =", "completion": " 5"}])
    example = only(load_examples(dataset(path, "completion", train_on_eos=False), tok, 512))
    ids, labels = expected(tok, [("2 + 3 =", False), (" 5", True), (tok.eos_token_id, False)])
    assert example.input_ids == ids and example.labels == labels
    assert example.labels[-2:] == [MASK, MASK]


def test_text_trains_everything(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "The cat sat by the river."}])
    example = only(load_examples(dataset(path, "text", field_text="body"), tok, 512))
    ids = tok.encode("The cat sat by the river.") + [tok.eos_token_id]
    assert example.input_ids == ids and example.labels == ids[1:] + [MASK]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reverse: cat, sun"},
    {"role": "assistant", "content": "sun, cat"},
    {"role": "user", "content": "Capital of Peru?"},
    {"role": "assistant", "content": "Lima."},
]


def test_chat_trains_assistant_content_and_end_of_turn(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    example = only(load_examples(dataset(path), tok, 512))
    ids, labels = expected(
        tok,
        [
            ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nReverse: cat, sun<|im_end|>\n"
             "<|im_start|>assistant\n", False),
            ("sun, cat<|im_end|>", True),
            ("\n<|im_start|>user\nCapital of Peru?<|im_end|>\n<|im_start|>assistant\n", False),
            ("Lima.<|im_end|>", True),
            ("\n", False),
        ],
    )  # fmt: skip
    assert example.input_ids == ids and example.labels == labels
    assert tok.decode(example.input_ids) == tok.render_chat(CONVERSATION)


def test_chat_field_names_roles_and_eos(tok, tmp_path):
    renamed = [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": renamed}])
    spec = dataset(
        path,
        field_messages="conversations",
        message_field_role="from",
        message_field_content="value",
        roles_to_train=["user", "assistant"],
        train_on_eos=False,
    )
    example = only(load_examples(spec, tok, 512))
    trained = [label for label in example.labels if label != MASK]
    assert tok.decode(trained) == "Reverse: cat, sunsun, catCapital of Peru?Lima."


def test_chat_template_decorating_the_last_turn(tmp_path):
    """Qwen3 renders an empty think block only in the last assistant turn; history turns stay plain."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = ChatTokenizer(
        Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json")),
        source="qwen3-like",
        chat_template=template,
        eos_token="<|im_end|>",
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    example = only(load_examples(dataset(path), tok, 512))
    assert tok.decode([label for label in example.labels if label != MASK]) == (
        "sun, cat<|im_end|><think>\n\n</think>\n\nLima.<|im_end|>"
    )


def test_chat_template_that_rewrites_history_is_refused(tmp_path):
    template = "{{ messages | length }}{% for m in messages %}|{{ m.content | upper }}<|im_end|>{% endfor %}"
    tok = ChatTokenizer(
        Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json")),
        source="odd",
        chat_template=template,
        eos_token="<|im_end|>",
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(QLoraError, match=r"chat\.jsonl:1: message 2: .*renders this turn differently"):
        load_examples(dataset(path), tok, 512)


# ----- bad input -----


@pytest.mark.parametrize(
    "bad_line, type, message",
    [
        ('{"instruction": "x"}', "alpaca", r"bad\.jsonl:3: missing field 'output'"),
        (
            '{"instruction": "x", "output": 5}',
            "alpaca",
            r"bad\.jsonl:3: field 'output' must be a string, got a number",
        ),
        ('{"instruction": "x", "output": ', "alpaca", r"bad\.jsonl:3: not valid JSON"),
        ("[1, 2]", "text", r"bad\.jsonl:3: expected a JSON object, got an array"),
        ('{"messages": []}', "chat_template", r"bad\.jsonl:3: field 'messages' must be a non-empty list"),
        (
            '{"messages": [{"role": "user"}]}',
            "chat_template",
            r"bad\.jsonl:3: message 0: missing field 'content'",
        ),
        (
            '{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]}',
            "chat_template",
            r"bad\.jsonl:3: message 0: field 'content' must be a string, got null \(null only in an "
            r"assistant turn with tool_calls\)$",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]}',
            "chat_template",
            r"bad\.jsonl:3: message 1: field 'content' must be a string, got null",
        ),
        (
            '{"instruction": "bad \\ud800", "output": "x"}',
            "alpaca",
            r"bad\.jsonl:3: the row is not UTF-8 text \(lone surrogate U\+D800 at character \d+\)",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi \\udc80"}, {"role": "assistant", "content": "x"}]}',
            "chat_template",
            r"bad\.jsonl:3: the row is not UTF-8 text \(byte 0x80 at character \d+\)",
        ),
    ],
)
def test_bad_rows_name_file_and_line(tok, tmp_path, bad_line, type, message):
    good = {"instruction": "a", "output": "b", "text": "c", "messages": [{"role": "user", "content": "d"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad_line])
    with pytest.raises(QLoraError, match=message):
        load_examples(dataset(path, type), tok, 512)


def test_a_key_set_twice_in_a_row_is_refused_naming_file_row_and_key(tok, tmp_path):
    """json keeps the last of two equal keys without a word: the earlier value would not train."""
    good = '{"instruction": "a", "output": "b"}'
    lines = write_jsonl(
        tmp_path / "twice.jsonl", [good, "", '{"instruction": "a", "output": "x", "output": "y"}']
    )
    with pytest.raises(
        QLoraError, match=r"twice\.jsonl:3: key 'output' is set twice in one object; keep one$"
    ):
        load_examples(dataset(lines, "alpaca"), tok, 512)
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    nested = json.dumps(chat).replace('"content": "b"', '"content": "b", "content": "c"')
    lines = write_jsonl(tmp_path / "chat.jsonl", [chat, nested])
    with pytest.raises(QLoraError, match=r"chat\.jsonl:2: key 'content' is set twice in one object"):
        load_examples(dataset(lines), tok, 512)
    items = tmp_path / "rows.json"
    items.write_text("[\n" + ",\n".join([json.dumps(chat), json.dumps(chat), nested]) + "\n]\n")
    with pytest.raises(QLoraError, match=r"rows\.json: item 2: key 'content' is set twice in one object"):
        load_examples(dataset(items), tok, 512)
    items.write_text('[{"text": "a", "text": "b"}, {"text": "c"}]')
    with pytest.raises(QLoraError, match=r"rows\.json: item 0: key 'text' is set twice in one object"):
        load_examples(dataset(items, "text"), tok, 512)


def test_a_column_named_twice_is_refused_naming_file_and_column(tok, tmp_path):
    """A row from a CSV header or an Arrow schema with a column named twice keeps the last column."""
    import pyarrow as pa
    import pyarrow.ipc

    csv = tmp_path / "twice.csv"
    csv.write_text("instruction,output,output\na,x,y\n")
    with pytest.raises(QLoraError, match=r"twice\.csv: column 'output' appears twice; keep one$"):
        load_examples(dataset(csv, "alpaca"), tok, 512)
    arrow = tmp_path / "twice.arrow"
    table = pa.table([["a"], ["x"], ["y"]], names=["instruction", "output", "output"])
    with pa.OSFile(str(arrow), "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(QLoraError, match=r"twice\.arrow: column 'output' appears twice; keep one$"):
        load_examples(dataset(arrow, "alpaca"), tok, 512)


def test_json_list_items_and_missing_or_empty_sources(tok, tmp_path):
    items = tmp_path / "rows.json"
    items.write_text(json.dumps([{"text": "a"}, {"txt": "b"}]))
    with pytest.raises(QLoraError, match=r"rows\.json: item 1: missing field 'text'"):
        load_examples(dataset(items, "text"), tok, 512)
    with pytest.raises(QLoraError, match="does not exist"):
        load_examples(dataset(tmp_path / "nowhere.jsonl", "text"), tok, 512)
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(QLoraError, match="no rows"):
        load_examples(dataset(empty, "text"), tok, 512)
    (tmp_path / "rows.txt").write_text("text\na\n")
    with pytest.raises(QLoraError, match=r"unsupported dataset file type '\.txt'.*set ds_type"):
        load_examples(dataset(tmp_path / "rows.txt", "text"), tok, 512)


def test_folder_reads_sorted_files_of_the_split(tok, tmp_path):
    folder = tmp_path / "hub"
    write_jsonl(folder / "data" / "train-00001-of-00002.jsonl", [{"text": "second"}])
    write_jsonl(folder / "data" / "train-00000-of-00002.jsonl", [{"text": "first"}])
    write_jsonl(folder / "data" / "test-00000-of-00001.jsonl", [{"text": "held out"}])
    write_jsonl(folder / ".cache" / "train.jsonl", [{"text": "cache"}])
    examples = load_examples(dataset(folder, "text"), tok, 512)
    assert [tok.decode(e.input_ids[:-1]) for e in examples] == ["first", "second"]
    plain = tmp_path / "plain"
    write_jsonl(plain / "b.jsonl", [{"text": "b"}])
    (plain / "a.json").write_text(json.dumps([{"text": "a"}]))
    assert [tok.decode(e.input_ids[:-1]) for e in load_examples(dataset(plain, "text"), tok, 512)] == [
        "a",
        "b",
    ]


def test_truncation_and_dropping_are_counted(tok, tmp_path):
    rows = [
        {"prompt": "short", "completion": " answer"},
        {"prompt": "a much longer prompt than eight tokens can hold", "completion": " never seen"},
        {"prompt": "x", "completion": " one two three four five six seven eight nine ten"},
    ]
    examples = load_examples(dataset(write_jsonl(tmp_path / "c.jsonl", rows), "completion"), tok, 8)
    assert (examples.rows, examples.truncated, len(examples)) == (3, 1, 2)
    assert examples.dropped == {TOO_LONG: 1}
    cut = examples[1]
    full_ids = tok.encode("x") + tok.encode(" one two three four five six seven eight nine ten")
    assert cut.input_ids == full_ids[:8]
    assert cut.labels == full_ids[1:8] + [MASK]


def test_rows_longer_than_sequence_len_can_be_dropped(tok, tmp_path):
    rows = [
        {"prompt": "short", "completion": " answer"},
        {"prompt": "x", "completion": " one two three four five six"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    examples = load_examples(dataset(path, "completion"), tok, 6, drop_long=True)
    assert len(examples) == 1 and examples.truncated == 0
    assert examples.dropped == {LONGER: 1}
    assert examples[0].input_ids == tok.encode("short") + tok.encode(" answer") + [tok.eos_token_id]


def test_demo_dataset_loads(tok):
    examples = load_examples(dataset(DEMO_MODEL.parent / "data" / "train.jsonl"), tok, 256)
    assert examples.rows >= 400 and len(examples) == examples.rows and examples.truncated == 0


# ----- split and batches -----


def synthetic_examples(lengths):
    """Example k's ids are 1000(k+1), 1000(k+1)+1, ...; its first two tokens are prompt."""
    examples = []
    for k, n in enumerate(lengths, start=1):
        ids = list(range(1000 * k, 1000 * k + n))
        examples.append(Example(input_ids=ids, labels=[MASK] + ids[2:] + [MASK]))
    return examples


def test_split_validation_is_deterministic():
    examples = synthetic_examples([3] * 50)
    train, val = split_validation(examples, 0.1, seed=7)
    assert len(val) == 5 and len(train) == 45
    assert split_validation(examples, 0.1, seed=7) == (train, val)
    assert split_validation(examples, 0.1, seed=8)[1] != val
    assert sorted(e.input_ids[0] for e in train + val) == [e.input_ids[0] for e in examples]
    assert len(split_validation(examples, 3, seed=0)[1]) == 3
    assert split_validation(examples, 0.0, seed=0) == (examples, [])
    for bad in (50, 1.5, -1):
        with pytest.raises(QLoraError, match="val_set_size"):
            split_validation(examples, bad, seed=0)


def all_batches(plan, epoch):
    return [plan.batch(epoch, i) for i in range(plan.num_batches)]


def check_rows(batch, examples):
    """Every row: documents laid out contiguously from the left, positions restarting, labels inside."""
    by_first_id = {e.input_ids[0]: e for e in examples}
    seen = []
    for r in range(batch.input_ids.shape[0]):
        ids, labels = batch.input_ids[r].tolist(), batch.labels[r].tolist()
        positions, docs = batch.position_ids[r].tolist(), batch.doc_ids[r].tolist()
        t, doc = 0, 0
        while t < len(ids) and ids[t] in by_first_id and docs[t] == doc:
            example = by_first_id[ids[t]]
            n = len(example.input_ids)
            assert ids[t : t + n] == example.input_ids and labels[t : t + n] == example.labels
            assert positions[t : t + n] == list(range(n)) and docs[t : t + n] == [doc] * n
            seen.append(ids[t])
            t, doc = t + n, doc + 1
        assert all(d == doc for d in docs[t:]) and all(label == MASK for label in labels[t:])
        assert positions[t:] == list(range(len(ids) - t))
        for u, label in enumerate(labels):
            if label != MASK:
                assert docs[u + 1] == docs[u] and label == ids[u + 1]
    return seen


def test_packing_keeps_documents_apart_and_covers_each_example_once():
    lengths = [5, 17, 3, 30, 9, 12, 2, 25, 8, 16, 7, 11, 4, 20, 6]
    examples = synthetic_examples(lengths)
    plan = BatchPlan(
        examples, micro_batch_size=2, sequence_len=32, sample_packing=True, seed=3, pad_token_id=1
    )
    for epoch in range(2):
        batches = all_batches(plan, epoch)
        seen = []
        for batch in batches:
            assert batch.input_ids.shape[1] == 32
            assert batch.input_ids.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.int64
            assert batch.doc_ids.dtype == torch.int32
            assert batch.n_tokens == int((batch.labels != MASK).sum())
            seen += check_rows(batch, examples)
        assert sorted(seen) == sorted(e.input_ids[0] for e in examples)
    assert len(plan.rows) == -(-sum(lengths) // 32)  # best-fit needs no more rows than the tokens fill


def same_batches(a, b):
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("packing", [True, False])
def test_order_is_a_function_of_seed_and_epoch(packing):
    examples = synthetic_examples([4 + k % 9 for k in range(40)])
    plans = [
        BatchPlan(
            examples, micro_batch_size=3, sequence_len=24, sample_packing=packing, seed=seed, pad_token_id=0
        )
        for seed in (5, 5, 6)
    ]
    epoch0 = [b.input_ids for b in all_batches(plans[0], 0)]
    assert same_batches(epoch0, [b.input_ids for b in all_batches(plans[1], 0)])
    assert same_batches(epoch0, [plans[0].batch(0, i).input_ids for i in range(plans[0].num_batches)])
    epoch1 = [b.input_ids for b in all_batches(plans[0], 1)]
    assert len(epoch1) == len(epoch0) == plans[0].num_batches
    assert not same_batches(epoch0, epoch1)
    assert not same_batches(epoch0, [b.input_ids for b in all_batches(plans[2], 0)])


def test_unpacked_rows_pad_to_a_multiple_of_eight():
    examples = synthetic_examples([3, 9, 14, 22, 5])
    plan = BatchPlan(
        examples, micro_batch_size=2, sequence_len=22, sample_packing=False, seed=0, pad_token_id=7
    )
    assert plan.num_batches == 3
    seen = []
    for index, batch in enumerate(all_batches(plan, 0)):
        longest = max(len(examples[row[0]].input_ids) for row in plan.batch_rows(0, index))
        assert batch.input_ids.shape[1] == min(22, -(-longest // 8) * 8)
        assert (batch.doc_ids <= 1).all()
        seen += check_rows(batch, examples)
    assert sorted(seen) == sorted(e.input_ids[0] for e in examples)
    moved = plan.batch(0, 0).to("cpu")
    assert moved.input_ids.device.type == "cpu" and moved.n_tokens == plan.batch(0, 0).n_tokens
