"""Data-parallel scaling: `qlora train` on one GPU against `qlora train --nproc N`, same global batch, same run.

Usage: python -m benchmarks.scaling CHECKPOINT DATA.jsonl [--nproc 2] [--micro-batch 4] [--accumulation 2]
       [--seq 2048] [--steps 30] [--skip 5] [--output DIR]

The one-GPU run accumulates N times as many micro-batches as each of the N processes, so both take the
same optimizer steps over the same rows (qlora_cli/train/distributed.py). Both log every step; tokens/s counts
the steps after the first `--skip` (compilation and warm-up). Prints tokens/s, tokens/s per GPU, peak
memory of each GPU, the scaling efficiency (tokens/s of N GPUs ÷ N × one GPU's) and the largest loss
difference between the two runs, step by step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml


def run_config(args, output_dir: Path, accumulation: int) -> dict:
    """A synthetic `completion` task packed into full rows, every layer recomputed."""
    return {
        "base_model": str(args.checkpoint),
        "datasets": [{"path": str(args.data), "type": "completion"}],
        "val_set_size": 0,
        "sequence_len": args.seq,
        "sample_packing": True,
        "micro_batch_size": args.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "max_steps": args.steps,
        "learning_rate": 2e-4,
        "lr_scheduler": "cosine",
        "warmup_steps": 5,
        "gradient_checkpointing": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_linear": True,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "seed": 42,
    }


def train(args, name: str, nproc: int, accumulation: int) -> list[dict]:
    """One `qlora train` in its own process(es); returns its metrics.jsonl records."""
    output_dir = args.output / name
    config = args.output / f"{name}.yaml"
    config.write_text(yaml.safe_dump(run_config(args, output_dir, accumulation)))
    command = [sys.executable, "-m", "qlora_cli", "train", str(config)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    print(f"$ {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


def steady_tokens_per_s(records: list[dict], skip: int) -> float:
    """All steps after `skip` together: every step has the same tokens, so the harmonic mean of the rates."""
    rates = [r["tokens_per_s"] for r in records if r["step"] > skip]
    return len(rates) / sum(1 / rate for rate in rates)


def _largest(values) -> float | None:
    """The largest peak memory; None on a CPU, which reports none."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _gib(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def summary(args, one: list[dict], many: list[dict]) -> dict:
    one_rate, many_rate = steady_tokens_per_s(one, args.skip), steady_tokens_per_s(many, args.skip)
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(one, many, strict=True)]
    return {
        "nproc": args.nproc,
        "global_batch_rows": args.micro_batch * args.accumulation * args.nproc,
        "seq": args.seq,
        "steps": args.steps,
        "one_gpu_tokens_per_s": one_rate,
        "many_gpu_tokens_per_s": many_rate,
        "many_gpu_tokens_per_s_per_gpu": many_rate / args.nproc,
        "scaling_efficiency": many_rate / (args.nproc * one_rate),
        "one_gpu_peak_gib": _largest(r["memory_gib"] for r in one),
        "many_gpu_peak_gib_per_rank": [
            _largest(r["memory_gib_per_rank"][rank] for r in many) for rank in range(args.nproc)
        ],
        "max_abs_loss_difference": max(differences),
        "max_rel_loss_difference": max(d / abs(a["loss"]) for d, a in zip(differences, one, strict=True)),
        "losses": [[a["step"], a["loss"], b["loss"]] for a, b in zip(one, many, strict=True)],
    }


def print_summary(result: dict) -> None:
    n = result["nproc"]
    print(f"\nglobal batch {result['global_batch_rows']} × {result['seq']} tokens, {result['steps']} steps")
    print(f"{'step':>5} {'loss, 1 GPU':>12} {f'loss, {n} GPUs':>13}")
    for step, a, b in result["losses"]:
        print(f"{step:>5} {a:>12.5f} {b:>13.5f}")
    peaks = ", ".join(_gib(p) for p in result["many_gpu_peak_gib_per_rank"])
    print("\n| run | tokens/s | tokens/s per GPU | peak GiB per GPU |\n|---|---|---|---|")
    one = result["one_gpu_tokens_per_s"]
    print(f"| 1 GPU | {one:,.0f} | {one:,.0f} | {_gib(result['one_gpu_peak_gib'])} |")
    many, per_gpu = result["many_gpu_tokens_per_s"], result["many_gpu_tokens_per_s_per_gpu"]
    print(f"| {n} GPUs | {many:,.0f} | {per_gpu:,.0f} | {peaks} |")
    print(f"\nscaling efficiency: {result['scaling_efficiency']:.1%} ({many / one:.2f}× on {n} GPUs)")
    print(
        f"largest loss difference: {result['max_abs_loss_difference']:.2e} "
        f"({result['max_rel_loss_difference']:.2e} relative)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2, help="per process in the N-GPU run")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("/tmp/qlora-scaling"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    one = train(args, "one-gpu", 1, args.accumulation * args.nproc)
    many = train(args, f"{args.nproc}-gpus", args.nproc, args.accumulation)
    result = summary(args, one, many)
    (args.output / "scaling.json").write_text(json.dumps(result, indent=1))
    print_summary(result)


if __name__ == "__main__":
    main()
