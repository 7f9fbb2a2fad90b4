"""The shipped demo visibly learns: configs/demo.yaml, trained as the README's first command trains it,
answers the README's question as the demo's data does, and the base model alone answers as the README
shows. It trains the real config (the README promises under a minute on 2 CPU cores), on one thread so
that the answer does not depend on how many threads the machine gives it."""

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from qlora_cli.config.loading import load_config
from qlora_cli.generate.command import generate
from qlora_cli.train.loop import train

pytestmark = pytest.mark.usefixtures("reference_ops", "one_thread")
ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "configs" / "demo.yaml"
# The README's first command ends by asking the trained demo a question ...
FIRST_COMMAND = re.compile(
    r'qlora train configs/demo\.yaml && qlora generate outputs/demo --prompt "([^"]+)"'
)
# ... and shows what the base model and the trained one answer: `$ qlora generate ...` then the answer.
SHOWN = re.compile(r'^\$ qlora generate (\S+)( --base-only)? --prompt "([^"]+)".*\n(.*)$', re.MULTILINE)


def readme_demo() -> tuple[str, str, str]:
    """The README's demo question, the base model's answer and the trained model's answer it shows."""
    readme = (ROOT / "README.md").read_text()
    question = FIRST_COMMAND.search(readme).group(1)
    shown = {(source, bool(base)): (prompt, answer) for source, base, prompt, answer in SHOWN.findall(readme)}
    assert shown[("configs/demo.yaml", True)][0] == shown[("outputs/demo", False)][0] == question
    return question, shown[("configs/demo.yaml", True)][1], shown[("outputs/demo", False)][1]


def data_answer(question: str) -> str:
    """What the demo's data answers to `question` asked alone, as `--prompt` asks it."""
    answers = set()
    for line in (ROOT / "configs" / "demo" / "data" / "train.jsonl").read_text().splitlines():
        turns = json.loads(line)["messages"]
        if turns[0]["role"] == "user" and turns[0]["content"] == question:
            answers.add(turns[1]["content"])
    assert len(answers) == 1, f"the demo data answers {question!r} with {answers or 'nothing'}"
    return answers.pop()


def answer(source: Path, question: str, base_only: bool = False) -> str:
    rows = generate(
        source,
        prompts=[question],
        base_only=base_only,
        stdout=io.StringIO(),
        console=Console(file=io.StringIO()),
    )
    return rows[0]["completion"]


def test_the_trained_demo_answers_the_readmes_question_as_its_data_does(tmp_path, monkeypatch):
    question, shown_base, shown_tuned = readme_demo()
    expected = data_answer(question)
    assert shown_tuned == expected
    monkeypatch.chdir(ROOT)  # the demo config's paths are relative to the repository
    assert answer(DEMO, question, base_only=True) == shown_base != expected
    run = train(load_config(DEMO, [f"output_dir={tmp_path / 'demo'}"]))
    assert answer(run.output_dir, question) == expected
