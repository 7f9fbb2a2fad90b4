"""`qlora data CONFIG`: statistics and highlighted examples from the tokenizer alone; every bad input one
line and exit 2."""

import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_data import DEMO_MODEL, write_jsonl

from qlora_cli.config.loading import load_config
from qlora_cli.data.examples import BatchPlan, prepare_data
from qlora_cli.data.report import data_report, highlighted

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tokenizer_only_model(tmp_path):
    """The demo model's config and tokenizer without its weights: `qlora data` must not need them."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, folder / name)
    return folder


SHAREGPT_ROWS = [
    {"conversations": [{"from": "human", "value": f"Count to {n}."}, {"from": "gpt", "value": " ".join(map(str, range(1, n + 1)))}]}
    for n in range(1, 9)
] + [{"conversations": [{"from": "human", "value": "Only a question"}]}]  # fmt: skip


def write_config(tmp_path, model, dataset=None, **keys):
    data = write_jsonl(tmp_path / "chats.jsonl", SHAREGPT_ROWS)
    config = {
        "base_model": str(model),
        "datasets": [{"path": str(data), "type": "sharegpt", **(dataset or {})}],
        "sequence_len": 64,
        "sample_packing": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        **keys,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_data_prints_statistics_and_highlighted_examples(tmp_path, run_cli, tokenizer_only_model):
    config = write_config(tmp_path, tokenizer_only_model, val_set_size=2)
    code, out, err = run_cli("data", config, "--show", "2")
    assert code == 0, err
    report = data_report(load_config(config))
    tokens = sum(len(e.input_ids) for e in report.train)
    trained = sum(label != -100 for e in report.train for label in e.labels)
    assert len(report.train) == 6 and len(report.validation) == 2
    assert report.datasets[0].dropped == 1
    assert f"training examples: 6 ({tokens:,} tokens, {trained:,} trained;" in out
    assert "evaluation examples: 2" in out
    assert "chats.jsonl: dropped 1 row with no turn of a trained role (their roles: user)" in out
    assert f"packing efficiency {report.fill:.1%}" in out
    plan = BatchPlan(
        report.train, micro_batch_size=2, sequence_len=64, sample_packing=True, seed=42, pad_token_id=0
    )
    assert report.fill == tokens / (len(plan.rows) * 64)
    assert "example 0" in out and "example 1" in out and "example 2" not in out
    first = report.train[0]
    answer = report.tokenizer.decode(
        [first.input_ids[t + 1] for t, label in enumerate(first.labels) if label != -100]
    )
    assert answer.endswith("<|im_end|>") and f"⟦{answer}⟧" in out
    assert "<|im_start|>user\nCount to" in out
    assert "human" not in out and "gpt" not in out


def test_highlighting_marks_exactly_the_trained_tokens(tmp_path, tokenizer_only_model):
    report = data_report(load_config(write_config(tmp_path, tokenizer_only_model)))
    for example in report.train:
        text = highlighted(example, report.tokenizer, color=False).plain
        trained = [example.input_ids[t + 1] for t, label in enumerate(example.labels) if label != -100]
        marked = "".join(piece.split("⟧")[0] for piece in text.split("⟦")[1:])
        assert marked == report.tokenizer.decode(trained)
        assert marked.endswith("<|im_end|>") and "<|im_start|>" not in marked


def test_data_without_packing_reports_padding(tmp_path, run_cli, tokenizer_only_model):
    code, out, err = run_cli("data", write_config(tmp_path, tokenizer_only_model, sample_packing=False))
    assert code == 0, err
    assert "padded rows;" in out and "packing efficiency" not in out


@pytest.mark.parametrize(
    "dataset, keys, message",
    [
        ({"type": "oasst"}, {}, "type 'oasst' is not a dataset format qlora reads"),
        ({}, {"chat_template": "llama3"}, "'llama3' writes '<\\|start_header_id\\|>', which the tokenizer of .* lacks"),
        ({}, {"chat_template": "jinja"}, "'jinja' needs the template in chat_template_jinja"),
        ({"split": "validation"}, {}, "is one file, which is the split 'train'; it has no split 'validation'"),
        ({"split": "train[:x%]"}, {}, "'x%' is not a row index or a percent"),
        ({"roles_to_train": ["system"]}, {}, "every one of the 9 rows of .* was dropped: 9 rows with no turn of a trained role"),
        ({"path": "missing/chats.jsonl"}, {}, "dataset file or folder 'missing/chats.jsonl' does not exist"),
        ({"message_property_mappings": "from"}, {}, r"config key 'datasets\[0\]\.message_property_mappings': expected a mapping"),
        ({"train_on_eos": "sometimes"}, {}, r"config key 'datasets\[0\]\.train_on_eos': expected one of 'turn', 'all', 'last', 'none'"),
        ({"field_messages": "messages"}, {}, r"chats\.jsonl:1: missing field 'messages'"),
        ({}, {"val_set_size": 0.1, "test_datasets": [{"path": "x.jsonl"}]}, "'test_datasets' and 'val_set_size' both"),
        ({}, {"sequence_len": 100000}, "100000 is above the model's maximum of 2,048 \\(max_position_embeddings\\)"),
    ],
)  # fmt: skip
def test_bad_data_input_is_one_line_and_exit_2(
    tmp_path, run_cli, tokenizer_only_model, dataset, keys, message
):
    config = write_config(tmp_path, tokenizer_only_model, dataset, **keys)
    code, out, err = run_cli("data", config)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert out == ""


def test_a_corrupt_gz_is_one_line_and_exit_2(tmp_path, run_cli, tokenizer_only_model):
    config = write_config(tmp_path, tokenizer_only_model)
    packed = tmp_path / "chats.jsonl.gz"
    packed.write_bytes(gzip.compress((tmp_path / "chats.jsonl").read_bytes())[:-20])
    code, out, err = run_cli("data", config, "--set", f"datasets.0.path={packed}")
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{packed}: cannot read as gzip (Compressed file ended before the end-of-stream marker" in err
    assert out == ""


def test_files_a_folder_does_not_read_are_named(tmp_path, run_cli, tokenizer_only_model):
    """`qlora data` and a run's notes both say which files of a dataset folder train nothing."""
    folder = tmp_path / "chats"
    folder.mkdir()
    config = write_config(tmp_path, tokenizer_only_model, {"path": str(folder)})
    (tmp_path / "chats.jsonl").rename(folder / "chats.jsonl")
    (folder / "chats.tsv").write_text("from\tvalue\n")
    note = f"{folder}: 1 file not read, in no format qlora reads: chats.tsv"
    code, out, err = run_cli("data", config)
    assert code == 0, err
    assert note in out.splitlines()
    report = data_report(load_config(config))
    assert prepare_data(load_config(config), report.tokenizer).notes() == [
        f"{folder}: 1 row with no turn of a trained role (their roles: user) dropped",
        note,
    ]


def test_data_prints_the_configs_notes_as_a_run_does(tmp_path, run_cli, tokenizer_only_model):
    """An Axolotl key qlora leaves to another command is noted by `qlora data` too, not only by train."""
    config = write_config(tmp_path, tokenizer_only_model, debug=True)
    notes = load_config(config).notes
    assert len(notes) == 1 and "debug" in notes[0]
    code, out, err = run_cli("data", config)
    assert code == 0, err
    assert f"note: {notes[0]}" in " ".join(out.split())


def test_data_takes_the_special_tokens_training_takes(tmp_path, run_cli, tokenizer_only_model):
    """The preview renders and pads with the config's special_tokens, and refuses the ones training refuses."""
    config = write_config(tmp_path, tokenizer_only_model, special_tokens={"pad_token": "<|im_start|>"})
    report = data_report(load_config(config))
    assert report.tokenizer.pad_token_id == report.tokenizer.token_to_id("<|im_start|>")
    code, _, err = run_cli("data", config, "--set", "special_tokens.pad_token=<|end_of_text|>")
    assert code == 2
    assert "config key 'special_tokens.pad_token': '<|end_of_text|>' is not in the vocabulary" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_into_a_pipe_lines_stay_whole_and_the_table_keeps_its_width(tmp_path, tokenizer_only_model):
    """A job log is grepped: a path longer than any terminal stays on its line, in the table and in the
    note, brackets and all; the rule over an example still spans the 80 columns rich would have wrapped at."""
    folder = tmp_path / ("d" * 150) / "[v2]" / ("e" * 150)
    config = write_config(folder, tokenizer_only_model)
    data = folder / "chats.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_cli", "data", str(config), "--show", "1"],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row = next(line for line in lines if str(data) in line)
    assert row.startswith("│ ") and row.split("│")[2].strip() == "9"
    assert f"{data}: dropped 1 row with no turn of a trained role (their roles: user)" in lines
    rule = next(line for line in lines if "example 0" in line)
    assert len(rule) == 80 and rule.startswith("─")
