"""Every shipped recipe (configs/*.yaml but the demo) trained on the GPU as a user runs it.

Usage: python -m benchmarks.recipes [--configs qwen2.5-7b,qwen3.5-9b] [--layers 2] [--vocab 32768]
       [--steps 8] [--jobs 1] [--workdir DIR] [--json FILE]

Each recipe runs with its own settings (packing, LoRA dropout, recompute, CUDA graphs where the run can
replay them, the planner's offload, its chat template and dataset format) on a random checkpoint of its
model's shape (benchmarks/shapes.py, the config's own name) cut to `--layers` decoder layers (a Qwen3.5
keeps its pattern: 4 layers, three Gated DeltaNet and one attention, whatever `--layers` says) and to a
`--vocab` rows embedding, so that writing and exporting it takes seconds; the demo tokenizer is given
the special tokens the recipe's chat template writes. Its rows are Alpaca-shaped, in the recipe's
dataset format. Only base_model, the dataset's path, max_steps, save_steps, eval_steps and output_dir
are set on the command line, through `--set` as a user would.

Per recipe, each stage a process of the real command line (`python -m qlora_cli`):
`train`, killed with SIGKILL once its first checkpoint is on disk; `resume` to `--steps`; `export`
as a PEFT adapter, as a merged model and as GGUF (where the gguf extra is installed); `generate` 16
tokens. One line per recipe: the steps, the loss first and last, tokens/s over the steps after the
first two of each process, the peak GPU memory the run recorded, and the first failure with its last
line. `--jobs N` runs N recipes at once (their tokens/s then share the GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.alpaca_shaped import alpaca_rows
from benchmarks.output import add_json_option, write_json
from benchmarks.random_checkpoint import write_config_checkpoint
from benchmarks.rows import write_jsonl
from benchmarks.shapes import model_config
from qlora_cli.rundir.names import METRICS_FILE
from qlora_cli.sources.chat_templates import SHIPPED
from qlora_cli.train.progress import logged_records

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.stem != "demo")
ROWS, SAVE_EVERY, KILL_TIMEOUT_S = 1500, 2, 600
# GGUF export needs the opt-in gguf extra; where it is missing (the device has no wheel of it) the
# recipe skips that stage and says so, so that generate still runs.
GGUF_INSTALLED = importlib.util.find_spec("gguf") is not None
# The start of a sequence where a chat template asks for one (the demo tokenizer has none).
BOS = {"llama3": "<|begin_of_text|>"}


def _qlora(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlora_cli", *args], cwd=ROOT, capture_output=True, text=True
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def add_template_tokens(folder: Path, template: str | None) -> None:
    """The tokens a shipped chat template writes (one token each) and the BOS it starts with, added to
    the checkpoint's tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    shipped = SHIPPED.get(template)
    if shipped is None:
        return
    bos = BOS.get(template, "<s>") if shipped.needs_bos else None
    tokens = [*shipped.tokens, *([bos] if bos else [])]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens])
    tokenizer.save(str(folder / "tokenizer.json"))
    if bos:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["bos_token"] = bos
        config_file.write_text(json.dumps(config, indent=2))


def write_recipe_rows(out: Path, dataset: dict, rows: int) -> Path:
    """Alpaca-shaped rows in the recipe's dataset format: alpaca fields, or one user and one assistant
    message under its field_messages and message_property_mappings."""
    examples = alpaca_rows(rows)
    if dataset.get("type") == "alpaca":
        return write_jsonl(out, examples)
    field = dataset.get("field_messages", "messages")
    names = {"role": "role", "content": "content", **dataset.get("message_property_mappings", {})}

    def message(role: str, text: str) -> dict:
        return {names["role"]: role, names["content"]: text}

    chats = [
        {
            field: [
                message("user", f"{r['instruction']} {r['input']}".strip()),
                message("assistant", r["output"]),
            ]
        }
        for r in examples
    ]
    return write_jsonl(out, chats)


def _metrics(output_dir: Path) -> list[dict]:
    """The step records so far; read while the run writes them, or after it was killed mid-line."""
    return [r for r in logged_records(output_dir / METRICS_FILE) if "trained_tokens" in r]


def _tokens_per_s(steps: list[dict]) -> float | None:
    timed = steps[2:] or steps
    seconds = sum(s["seconds"] for s in timed)
    return sum(s["input_tokens"] for s in timed) / seconds if seconds else None


def _train_and_kill(command: list[str], output_dir: Path) -> int | None:
    """Start `qlora train`, SIGKILL it once its first checkpoint exists; the steps it had logged, or
    None when it ended first (its return code then says how)."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "qlora_cli", *command], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr
        )
        deadline = time.monotonic() + KILL_TIMEOUT_S
        first = output_dir / f"checkpoint-{SAVE_EVERY}"
        while process.poll() is None and time.monotonic() < deadline:
            if first.exists():
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
                return len(_metrics(output_dir))
            time.sleep(0.02)
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr.seek(0)
        if process.returncode:
            raise RuntimeError(f"train exited {process.returncode}: {_last_line(stderr.read())}")
    return None


def run_recipe(config_path: Path, args) -> dict:
    config = yaml.safe_load(config_path.read_text())
    shape = config_path.stem
    work = args.workdir / shape
    output_dir = work / "run"
    shutil.rmtree(work, ignore_errors=True)
    model_settings = model_config(shape, 4 if shape.startswith("qwen3.5") else args.layers)
    model_settings["vocab_size"] = args.vocab
    result = {"recipe": config_path.name, "shape": shape, "layers": model_settings["num_hidden_layers"]}
    stages = [
        ("resume", ["resume", str(output_dir)]),
        ("adapter", ["export", str(output_dir), "--out", str(work / "adapter")]),
        ("merged", ["export", str(output_dir), "--merged", "--out", str(work / "merged")]),
        *(
            [("gguf", ["export", str(output_dir), "--gguf", "--out", str(work / "gguf")])]
            if GGUF_INSTALLED
            else []
        ),
        (
            "generate",
            ["generate", str(output_dir), "--prompt", "Name three colours.", "--max-new-tokens", "16"],
        ),
    ]
    # A recipe that fails anywhere, this script's own set-up included, is a line of the report, and
    # the others still run.
    try:
        checkpoint = write_config_checkpoint(model_settings, work / "model", device="cuda")
        add_template_tokens(checkpoint, config.get("chat_template"))
        data = write_recipe_rows(work / "rows.jsonl", config["datasets"][0], ROWS)
        sets = {
            "base_model": checkpoint,
            "datasets.0.path": data,
            "max_steps": args.steps,
            "save_steps": SAVE_EVERY,
            "eval_steps": SAVE_EVERY,
            "logging_steps": 1,
            "output_dir": output_dir,
        }
        train = ["train", str(config_path)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        result["killed_at_step"] = _train_and_kill(train, output_dir)
        for stage, command in stages:
            proc = _qlora(*command)
            if proc.returncode:
                raise RuntimeError(f"{stage} exited {proc.returncode}: {_last_line(proc.stderr)}")
            result[stage] = "ok"
    except Exception as error:
        result["failure"] = f"{type(error).__name__}: {error}"
    steps = _metrics(output_dir)
    result.update(
        steps=len(steps),
        last_step=steps[-1]["step"] if steps else 0,
        loss_first=steps[0]["loss"] if steps else None,
        loss_last=steps[-1]["loss"] if steps else None,
        tokens_per_s=_tokens_per_s(steps) if steps else None,
        peak_gib=max((s.get("memory_gib") or 0.0 for s in steps), default=None),
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _line(r: dict) -> str:
    if r["steps"]:
        numbers = (
            f"{r['last_step']} steps, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, "
            f"{r['tokens_per_s']:,.0f} tok/s, {r['peak_gib']:.2f} GiB"
        )
    else:
        numbers = "no step"
    killed = r.get("killed_at_step")
    kill = f"killed after step {killed}, resumed" if killed is not None else "ended before the kill"
    stages = (
        "resume, adapter, merged, gguf, generate" if GGUF_INSTALLED else "resume, adapter, merged, generate"
    )
    outcome = r.get("failure") or f"{stages} ok"
    if not GGUF_INSTALLED:
        outcome += " (GGUF export not run: the gguf package, an opt-in extra, is not installed)"
    return f"{r['recipe']:<20} {r['layers']} layers: {numbers}; {kill}; {outcome}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", help="comma-separated config names (default: every shipped recipe)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep each recipe's folder")
    add_json_option(parser)
    args = parser.parse_args()
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="qlora-recipes-"))
    chosen = CONFIGS
    if args.configs:
        names = set(args.configs.split(","))
        chosen = [c for c in CONFIGS if c.stem in names]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda path: run_recipe(path, args), chosen))
    for r in results:
        print(_line(r), flush=True)
    write_json(args.json, "benchmarks.recipes", results)


if __name__ == "__main__":
    main()
