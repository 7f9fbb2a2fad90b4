"""`qlora train` on a shipped config and Alpaca-shaped rows, as a user runs it, against Unsloth + TRL.

Usage: python -m benchmarks.e2e [--config configs/qwen2.5-7b.yaml] [--shape qwen2.5-7b] [--layers N]
       [--checkpoint DIR] [--rows 20000] [--steps 20] [--warmup-steps 3]
       [--runners qlora,unsloth,benchmark] [--workdir DIR] [--set KEY=VALUE ...] [--json FILE]

Each runner is its own process. `qlora` is the real command line, `python -m qlora_cli train CONFIG`
with `--set` pointing base_model at a random-weight checkpoint of the shape (benchmarks/random_checkpoint.py;
`--layers` shortens it) and datasets at Alpaca-shaped rows this writes (benchmarks/alpaca_shaped.py);
every other key is the config's, unless `--set` changes it for both runners. Its numbers come from the run's own metrics.jsonl (one record a
step). `unsloth` trains the same rows with the config's LoRA shape, batch, accumulation, schedule and
sequence length through Unsloth's FastLanguageModel and TRL's SFTTrainer (prompt/completion rows,
the completion trained), with packing when Unsloth accepts it there, padded rows otherwise (the
result says which). `benchmark` is benchmarks.compare's qlora runner on one random 4 x sequence_len
batch, the number the README quotes, for the ratio the end-to-end run should reach.

Reported per runner: trained tokens/s and all tokens/s over the steps after the warm-up, peak GPU
memory allocated, the start-up to the first step and the wall time of the whole process. qlora's
all tokens count the padding that fills its packed rows; Unsloth's count the attention mask.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.alpaca_shaped import alpaca_rows, write_rows
from benchmarks.output import add_json_option, write_json
from benchmarks.random_checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"qlora": "qlora train", "unsloth": "Unsloth + TRL", "benchmark": "benchmarks.compare"}


def steady(steps: list[dict], warmup: int) -> dict:
    """Tokens/s over the steps after `warmup` (all of them when there are no more), from per-step
    records of trained_tokens, input_tokens and seconds."""
    timed = steps[warmup:] or steps
    seconds = sum(s["seconds"] for s in timed)
    return {
        "trained_tokens_per_s": sum(s["trained_tokens"] for s in timed) / seconds,
        "tokens_per_s": sum(s["input_tokens"] for s in timed) / seconds,
        "timed_steps": len(timed),
    }


def _config(args) -> dict:
    """The config's keys as both runners read them, `--set` applied (top-level keys)."""
    config = yaml.safe_load(args.config.read_text())
    for text in args.set:
        key, _, value = text.partition("=")
        config[key] = yaml.safe_load(value)
    return config


def run_qlora(args, checkpoint: Path, data: Path) -> dict:
    output_dir = args.workdir / "qlora-out"
    overrides = {
        **dict(text.partition("=")[::2] for text in args.set),
        "base_model": str(checkpoint),
        "datasets": f"[{{path: {data}, type: alpaca}}]",
        "max_steps": args.steps,
        "logging_steps": 1,
        "output_dir": str(output_dir),
        "overwrite_output_dir": "true",
    }
    command = [sys.executable, "-m", "qlora_cli", "train", str(args.config)]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"qlora train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "trained_tokens" in r]
    return steady(steps, args.warmup_steps) | {
        "peak_gib": max(r["memory_gib"] or 0.0 for r in steps),
        "startup_s": steps[0]["startup_s"],
        "startup_parts_s": {
            k: v for k, v in steps[0].items() if k.startswith("startup_") and k != "startup_s"
        },
        "wall_s": wall,
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "steps": len(steps),
        "notes": [line for line in proc.stderr.splitlines() if line.startswith("note:")],
    }


def run_benchmark(args, checkpoint: Path) -> dict:
    config = _config(args)
    command = [
        *(sys.executable, "-m", "benchmarks.compare", str(checkpoint)),
        *("--batch", "4", "--seq", str(config.get("sequence_len", 2048)), "--worker", "qlora"),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"benchmarks.compare failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    return {
        "tokens_per_s": result["tokens_per_s"],
        "trained_tokens_per_s": None,
        "peak_gib": result["peak_gib"],
    }


def unsloth_targets(config: dict, checkpoint: Path) -> list[str]:
    """The decoder linears qlora adapts for this config, as PEFT names them, for Unsloth to adapt too:
    every one with lora_target_linear (a Qwen3.5 layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    and out_proj among them), else those lora_target_modules names."""
    from benchmarks.compare import lora_targets
    from qlora_cli.core.names import ALL_PROJECTIONS

    wanted = (
        ALL_PROJECTIONS
        if config.get("lora_target_linear")
        else config.get("lora_target_modules", ALL_PROJECTIONS)
    )
    return [name for name in lora_targets(checkpoint) if name in wanted]


def _supported(cls, **kwargs) -> dict:
    """The keyword arguments `cls` takes: TRL renamed several between versions."""
    names = inspect.signature(cls).parameters
    return {k: v for k, v in kwargs.items() if k in names}


def _tokenizer_argument(trainer_class, tokenizer) -> dict:
    """`processing_class` in TRL since 0.12, `tokenizer` before."""
    names = inspect.signature(trainer_class).parameters
    return {"processing_class" if "processing_class" in names else "tokenizer": tokenizer}


def run_unsloth(args, checkpoint: Path) -> dict:
    """Runs in its own process (--worker unsloth); imports Unsloth first, as it asks."""
    started = time.perf_counter()
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from unsloth import FastLanguageModel  # noqa: I001 (Unsloth patches trl and transformers on import)
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from qlora_cli.data.prompts import ALPACA_STYLES, ALPACA_SYSTEM, ALPACA_SYSTEM_NO_INPUT

    config = _config(args)
    seq = config.get("sequence_len", 2048)
    with_input, without_input = ALPACA_STYLES["instruct"]

    def prompt(row: dict) -> str:
        if row["input"].strip():
            return ALPACA_SYSTEM + with_input.format(**row)
        return ALPACA_SYSTEM_NO_INPUT + without_input.format(**row)

    rows = alpaca_rows(args.rows, args.seed)
    dataset = Dataset.from_list([{"prompt": prompt(r), "completion": r["output"]} for r in rows])
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(checkpoint), max_seq_length=seq, load_in_4bit=True, dtype=torch.bfloat16
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=config.get("lora_r", 16),
        lora_alpha=config.get("lora_alpha", 32),
        lora_dropout=config.get("lora_dropout", 0.0),
        target_modules=unsloth_targets(config, checkpoint),
        use_gradient_checkpointing="unsloth" if config.get("gradient_checkpointing", True) else False,
        random_state=config.get("seed", 42),
    )

    def trainer(packing: bool):
        settings = _supported(
            SFTConfig,
            output_dir=str(args.workdir / "unsloth-out"),
            per_device_train_batch_size=config.get("micro_batch_size", 2),
            gradient_accumulation_steps=config.get("gradient_accumulation_steps", 1),
            max_steps=args.steps,
            learning_rate=float(config.get("learning_rate", 1e-4)),
            lr_scheduler_type=config.get("lr_scheduler", "cosine"),
            warmup_ratio=config.get("warmup_ratio", 0.0),
            weight_decay=config.get("weight_decay", 0.0),
            max_grad_norm=config.get("max_grad_norm", 1.0),
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=True,
            seed=config.get("seed", 42),
            max_length=seq,
            max_seq_length=seq,
            packing=packing,
            completion_only_loss=True,
            dataset_num_proc=os.cpu_count(),
        )
        return SFTTrainer(
            model=model,
            train_dataset=dataset,
            args=SFTConfig(**settings),
            **_tokenizer_argument(SFTTrainer, tokenizer),
        )

    try:
        sft = trainer(packing=True)
        columns = sft.train_dataset.column_names
        packed = bool(sft.args.packing) and (
            "seq_lengths" in columns or "position_ids" in columns or len(sft.train_dataset) < 0.8 * len(rows)
        )
        note = "packed rows" if packed else "padded rows: packing was asked for and not applied"
    except Exception as error:  # noqa: BLE001 (any refusal of packing falls back to padded rows)
        sft = trainer(packing=False)
        packed, note = False, f"padded rows: packing refused ({type(error).__name__}: {error})"[:300]

    counts = {"trained": 0, "input": 0}
    steps: list[dict] = []
    first_step: list[float] = []
    original_step = sft.training_step

    def counting_step(model, inputs, *rest, **kwargs):
        labels = inputs.get("labels")
        if labels is not None:
            counts["trained"] += int((labels[..., 1:] != -100).sum())
        mask = inputs.get("attention_mask")
        counts["input"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        return original_step(model, inputs, *rest, **kwargs)

    sft.training_step = counting_step

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.start = time.perf_counter()
            if not first_step:
                first_step.append(self.start)
            counts.update(trained=0, input=0)

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            seconds = time.perf_counter() - self.start
            steps.append(
                {"seconds": seconds, "trained_tokens": counts["trained"], "input_tokens": counts["input"]}
            )

    sft.add_callback(StepTimer())
    torch.cuda.reset_peak_memory_stats()
    output = sft.train()
    return steady(steps, args.warmup_steps) | {
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "startup_s": first_step[0] - started,
        "loss_last": output.training_loss,
        "steps": len(steps),
        "packed": packed,
        "note": note,
    }


def _worker(name: str, args) -> dict:
    """One runner in a child process; the parent reads its RESULT line."""
    command = [sys.executable, "-m", "benchmarks.e2e", *sys.argv[1:], "--worker", name]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :]) | {"wall_s": time.perf_counter() - start}


def _inputs(args) -> tuple[Path, Path]:
    """The checkpoint (written once per shape and depth) and the rows (once per count and seed)."""
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = args.workdir / f"{args.shape}-{args.layers or 'all'}-layers"
        if not (checkpoint / "model.safetensors.index.json").is_file():
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            write_checkpoint(args.shape, checkpoint, layers=args.layers, device=device)
    data = args.workdir / f"alpaca-{args.rows}-{args.seed}.jsonl"
    if not data.is_file():
        write_rows(data, args.rows, args.seed)
    return checkpoint, data


def _table(results: dict) -> list[str]:
    lines = [
        f"{'runner':<20}{'trained tok/s':>14}{'all tok/s':>11}{'peak GiB':>10}{'start-up s':>11}{'wall s':>8}"
    ]
    for name, r in results.items():
        trained = r.get("trained_tokens_per_s")
        lines.append(
            f"{LABELS[name]:<20}{trained or 0:>14,.0f}{r['tokens_per_s']:>11,.0f}{r['peak_gib']:>10.2f}"
            f"{r.get('startup_s') or 0:>11.1f}{r.get('wall_s') or 0:>8.1f}"
        )
    ours, theirs, bench = results.get("qlora"), results.get("unsloth"), results.get("benchmark")
    if ours and theirs:
        lines.append(
            f"qlora / Unsloth: {ours['trained_tokens_per_s'] / theirs['trained_tokens_per_s']:.2f}x trained "
            f"tokens/s at {ours['peak_gib'] / theirs['peak_gib']:.2f}x the memory (Unsloth: {theirs['note']})"
        )
    if ours and bench:
        lines.append(
            f"qlora train / benchmarks.compare: {ours['tokens_per_s'] / bench['tokens_per_s']:.1%} of its tokens/s"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen2.5-7b.yaml")
    parser.add_argument(
        "--shape", default="qwen2.5-7b", help="random checkpoint shape (benchmarks/shapes.py)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    parser.add_argument("--checkpoint", type=Path, default=None, help="use this model folder instead")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (max_steps)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="first steps left out of tokens/s")
    parser.add_argument("--runners", default="qlora,unsloth,benchmark")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qlora-e2e"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="change a config key for both runners"
    )
    parser.add_argument("--worker", choices=["unsloth"], help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    args.config = args.config.resolve()
    args.workdir = args.workdir.resolve()
    args.checkpoint = args.checkpoint.resolve() if args.checkpoint else None
    checkpoint, data = _inputs(args)
    if args.worker:
        print("RESULT " + json.dumps(run_unsloth(args, checkpoint)), flush=True)
        return
    results = {}
    for name in args.runners.split(","):
        try:
            if name == "qlora":
                results[name] = run_qlora(args, checkpoint, data)
            elif name == "benchmark":
                results[name] = run_benchmark(args, checkpoint)
            else:
                results[name] = _worker(name, args)
        except RuntimeError as error:
            print(f"{LABELS[name]}: {error}", flush=True)
            continue
        print(f"{LABELS[name]}: {json.dumps(results[name])}", flush=True)
    print(f"{args.config.name} on {checkpoint.name}, {args.rows} Alpaca-shaped rows, {args.steps} steps")
    print("\n".join(_table(results)))
    import torch

    write_json(args.json, "benchmarks.e2e", results, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
