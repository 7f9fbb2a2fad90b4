"""Axolotl's own example configs for Qwen and Llama LoRA/QLoRA (copied from the axolotl repository's
examples/ as data) run through `qlora train` with only base_model, the dataset paths, max_steps and
output_dir replaced: the rest of each file is read as it ships."""

import json
from pathlib import Path

import pytest
import yaml
from checkpoints import DEMO_DATA, add_demo_tokenizer, write_qwen3

pytestmark = pytest.mark.usefixtures("reference_ops")
EXAMPLES = Path(__file__).resolve().parent / "axolotl_examples"

# Llama 3's pad token is not in Qwen's vocabulary, and qlora cannot add tokens: refused, one line.
LLAMA3_PAD = "config key 'special_tokens.pad_token': '<|end_of_text|>' is not in the vocabulary"
REFUSED = {
    "llama-3-lora-1b.yml": LLAMA3_PAD,
    "llama-3-qlora-1b.yml": LLAMA3_PAD,
    "llama-3-qlora.yml": LLAMA3_PAD,
    "llama-3-lora-1b-kernels.yml": LLAMA3_PAD,
    "llama-3-lora-8b.yml": "config key 'lora_modules_to_save' is not supported",
    # Axolotl's qwen3_5 template is not one qlora ships (tokenizer_default is Qwen3.5's own).
    "qwen3.5-27b-qlora.yaml": "config key 'chat_template': 'qwen3_5' is not a chat template qlora ships",
}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """One tiny Qwen3 (long enough for the examples' sequence_len) and the demo rows in three layouts."""
    root = tmp_path_factory.mktemp("axolotl")
    model = write_qwen3(
        root / "model",
        vocab_size=1024,
        max_position_embeddings=4096,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
    )
    add_demo_tokenizer(model)
    rows = [json.loads(line)["messages"] for line in DEMO_DATA.read_text().splitlines()[:24]]
    layouts = {
        "alpaca": [{"instruction": m[0]["content"], "input": "", "output": m[1]["content"]} for m in rows],
        "messages": [{"messages": m} for m in rows],
        "sharegpt": [
            {
                "conversations": [
                    {"from": "human", "value": m[0]["content"]},
                    {"from": "gpt", "value": m[1]["content"]},
                ]
            }
            for m in rows
        ],
    }
    files = {}
    for name, records in layouts.items():
        files[name] = root / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return model, files


def _dataset_file(dataset: dict, files: dict) -> Path:
    if dataset.get("type") == "alpaca":
        return files["alpaca"]
    return files["sharegpt" if dataset.get("field_messages") == "conversations" else "messages"]


def _example(name: str, fixtures, tmp_path) -> Path:
    model, files = fixtures
    raw = yaml.safe_load((EXAMPLES / name).read_text())
    raw.update(base_model=str(model), max_steps=1, output_dir=str(tmp_path / "out"))
    for dataset in raw["datasets"]:
        dataset["path"] = str(_dataset_file(dataset, files))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "name",
    [p.name for p in sorted(EXAMPLES.glob("*.y*ml")) if p.name not in REFUSED],
)
def test_example_trains(name, fixtures, tmp_path, run_cli):
    code, _, err = run_cli("train", _example(name, fixtures, tmp_path))
    assert code == 0, err
    assert "done: 1 step " in err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == len(set(notes))
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_example_refused_with_what_to_change(name, fixtures, tmp_path, run_cli):
    code, _, err = run_cli("train", _example(name, fixtures, tmp_path))
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and REFUSED[name] in err
