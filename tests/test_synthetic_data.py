"""The synthetic task the long GPU runs train on: what the rows hold, and that a model learns from them."""

import json

from checkpoints import write_run

from benchmarks.synthetic_data import WORDS, write_rows
from qlora_cli.config.loading import load_config
from qlora_cli.train.loop import train


def test_rows_ask_for_the_words_reversed(tmp_path):
    path = write_rows(tmp_path / "reverse.jsonl", rows=200, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 200
    for row in rows:
        words = row["prompt"].removeprefix("reverse: ").removesuffix("\n").split(" ")
        assert 8 <= len(words) <= 40 and set(words) <= set(WORDS)
        assert row["completion"].split(" ") == words[::-1]
    assert path.read_text() == write_rows(tmp_path / "again.jsonl", rows=200, seed=1).read_text()
    assert path.read_text() != write_rows(tmp_path / "other.jsonl", rows=200, seed=2).read_text()


def test_a_tiny_model_learns_the_task(tmp_path, reference_ops):
    """Packed into full rows, trained on the completions only: the loss falls by more than a nat."""
    data = write_rows(tmp_path / "reverse.jsonl", rows=400)
    config = write_run(
        tmp_path / "run",
        datasets=[{"path": str(data), "type": "completion"}],
        sample_packing=True,
        sequence_len=256,
        micro_batch_size=4,
        max_steps=40,
        learning_rate=3e-3,
        lora_r=8,
        logging_steps=5,
    )
    result = train(load_config(config))
    losses = [
        json.loads(line)["loss"] for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.0  # nats per token
