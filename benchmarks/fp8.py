"""FP8 against bf16 for the frozen NF4 projections: each product alone at a model's shapes, and a
training run of each whose losses are compared step by step.

Usage: python -m benchmarks.fp8 projections [--shape qwen2.5-7b] [--tokens 8192] [--json FILE]
       python -m benchmarks.fp8 accuracy CHECKPOINT DATA.jsonl [--steps 200] [--output DIR] [--json FILE]

`projections` times, for every projection group of the shape (q/k/v, o, gate/up, down; Qwen3.5's
in_proj and out_proj too), the forward product x @ W^T and the input gradient dY @ W as qlora runs them:
bf16 (NF4 dequantized to bf16, then cuBLAS) and FP8 (rows quantized to e4m3, NF4 dequantized to
e4m3, then a rowwise-scaled FP8 GEMM), and each FP8 part alone, so that what holds FP8 back (the
quantizing, the dequantizing, the GEMM) is in the table. The relative error of each against the
fp32 product of the same NF4 weights is ||y - y_fp32|| / ||y_fp32||, on unit-normal inputs.

`accuracy` runs `qlora train` twice on the same rows (benchmarks.synthetic_data), fp8: false and
fp8: true, logging every step and evaluating at the end, and prints the largest relative loss
difference of any step and the final eval losses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from benchmarks.output import add_json_option, write_json
from benchmarks.shapes import model_config
from qlora_cli.model.layers import layer_groups
from qlora_cli.profiler.timing import measure
from qlora_cli.sources.model_config import spec_from_config
from qlora_kernels.fp8 import fp8_input_grad, fp8_linear, fp8_scales, nf4_to_e4m3, quantize_rows
from qlora_kernels.linear import _stacked_weight
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4


def _ms(function) -> float:
    return measure(function, "cuda", repeats=20, warmup=5).median_ms


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact).norm() / exact.norm())


def _group_row(label: str, shapes: dict, names: tuple[str, ...], tokens: int) -> dict:
    torch.manual_seed(0)
    in_features = shapes[names[0]][1]
    weights = [
        quantize_nf4(torch.randn(shapes[n][0], in_features, device="cuda", dtype=torch.bfloat16) * 0.02)
        for n in names
    ]
    out_features = sum(w.shape[0] for w in weights)
    scales = fp8_scales(weights)
    buffer = torch.empty(out_features * in_features, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    dense = torch.cat([dequantize_nf4(w).float() for w in weights])
    exact_y, exact_dx = x.float() @ dense.T, dy.float() @ dense
    del dense
    stacked = _stacked_weight(weights, torch.bfloat16, buffer).clone()
    q, x_scale = quantize_rows(x)
    e4m3 = nf4_to_e4m3(weights, scales, transposed=False, buffer=buffer).clone()

    def fp8_gemm():
        return torch._scaled_mm(
            q, e4m3.T, scale_a=x_scale[:, None], scale_b=scales.row[None, :], out_dtype=torch.bfloat16
        )

    return {
        "group": label,
        "shape": f"{tokens}x{in_features} @ {in_features}x{out_features}",
        "bf16_forward_ms": _ms(lambda: x @ _stacked_weight(weights, torch.bfloat16, buffer).T),
        "bf16_input_grad_ms": _ms(lambda: dy @ _stacked_weight(weights, torch.bfloat16, buffer)),
        "fp8_forward_ms": _ms(lambda: fp8_linear(x, weights, scales, buffer)),
        "fp8_input_grad_ms": _ms(lambda: fp8_input_grad(dy, weights, scales, buffer)),
        "bf16_gemm_ms": _ms(lambda: x @ stacked.T),
        "fp8_gemm_ms": _ms(fp8_gemm),
        "quantize_rows_ms": _ms(lambda: quantize_rows(x)),
        "nf4_to_bf16_ms": _ms(lambda: _stacked_weight(weights, torch.bfloat16, buffer)),
        "nf4_to_e4m3_ms": _ms(lambda: nf4_to_e4m3(weights, scales, transposed=False, buffer=buffer)),
        "nf4_to_e4m3_transposed_ms": _ms(
            lambda: nf4_to_e4m3(weights, scales, transposed=True, buffer=buffer)
        ),
        "bf16_forward_error": _relative_error(x @ stacked.T, exact_y),
        "fp8_forward_error": _relative_error(fp8_linear(x, weights, scales, buffer), exact_y),
        "bf16_input_grad_error": _relative_error(dy @ stacked, exact_dx),
        "fp8_input_grad_error": _relative_error(fp8_input_grad(dy, weights, scales, buffer), exact_dx),
        "gflop": 2 * tokens * in_features * out_features / 1e9,
    }


def projection_rows(shape: str, tokens: int) -> list[dict]:
    spec = spec_from_config(model_config(shape))
    kinds = list(dict.fromkeys(spec.layer_types))
    rows = []
    for kind in kinds:
        shapes = spec.projection_shapes(kind)
        for group, names in layer_groups(kind).items():
            label = group if len(kinds) == 1 else f"{kind}.{group}"
            rows.append(_group_row(label, shapes, names, tokens))
            torch.cuda.empty_cache()
    return rows


def print_projections(rows: list[dict]) -> None:
    print(
        f"{'group':<24}{'shape':<28}{'fwd bf16':>9}{'fwd fp8':>9}{'x':>6}{'dX bf16':>9}{'dX fp8':>9}{'x':>6}"
        f"{'gemm16':>8}{'gemm8':>8}{'q rows':>8}{'nf4>8':>8}{'nf4>8T':>8}{'err16':>9}{'err8':>9}{'dXerr8':>9}"
    )
    for r in rows:
        print(
            f"{r['group']:<24}{r['shape']:<28}{r['bf16_forward_ms']:>9.3f}{r['fp8_forward_ms']:>9.3f}"
            f"{r['bf16_forward_ms'] / r['fp8_forward_ms']:>5.2f}x{r['bf16_input_grad_ms']:>9.3f}"
            f"{r['fp8_input_grad_ms']:>9.3f}{r['bf16_input_grad_ms'] / r['fp8_input_grad_ms']:>5.2f}x"
            f"{r['bf16_gemm_ms']:>8.3f}{r['fp8_gemm_ms']:>8.3f}{r['quantize_rows_ms']:>8.3f}"
            f"{r['nf4_to_e4m3_ms']:>8.3f}{r['nf4_to_e4m3_transposed_ms']:>8.3f}"
            f"{r['bf16_forward_error']:>9.2e}{r['fp8_forward_error']:>9.2e}{r['fp8_input_grad_error']:>9.2e}"
        )


def _train(args, fp8: bool) -> list[dict]:
    name = "fp8" if fp8 else "bf16"
    output_dir = args.output / name
    config = {
        "base_model": str(args.checkpoint),
        "load_in_4bit": True,
        "adapter": "qlora",
        "datasets": [{"path": str(args.data), "type": "completion"}],
        "val_set_size": 0.02,
        "sequence_len": args.seq,
        "sample_packing": True,
        "micro_batch_size": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "max_steps": args.steps,
        "eval_steps": args.steps,
        "learning_rate": 2e-4,
        "lr_scheduler": "cosine",
        "warmup_steps": 10,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_linear": True,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "save_steps": args.steps,
        "seed": 42,
        "fp8": fp8,
    }
    path = args.output / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "qlora_cli", "train", str(path), "--overwrite"]
    print(f"$ {' '.join(command)}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def accuracy(args) -> dict:
    args.output.mkdir(parents=True, exist_ok=True)
    runs = {fp8: _train(args, fp8) for fp8 in (False, True)}
    losses = {fp8: {r["step"]: r["loss"] for r in records if "loss" in r} for fp8, records in runs.items()}
    evals = {fp8: [r["eval_loss"] for r in records if "eval_loss" in r][-1] for fp8, records in runs.items()}
    speeds = {
        fp8: [r["tokens_per_s"] for r in records if "tokens_per_s" in r] for fp8, records in runs.items()
    }
    differences = {step: abs(losses[True][step] - loss) / loss for step, loss in losses[False].items()}
    worst = max(differences, key=differences.get)
    steady = {fp8: sorted(rates)[len(rates) // 2] for fp8, rates in speeds.items()}
    result = {
        "steps": len(differences),
        "largest_step_difference": differences[worst],
        "at_step": worst,
        "first_loss": losses[False][1],
        "last_loss_bf16": losses[False][max(losses[False])],
        "last_loss_fp8": losses[True][max(losses[True])],
        "eval_loss_bf16": evals[False],
        "eval_loss_fp8": evals[True],
        "eval_difference": abs(evals[True] - evals[False]) / evals[False],
        "median_tokens_per_s_bf16": steady[False],
        "median_tokens_per_s_fp8": steady[True],
    }
    for key, value in result.items():
        print(f"{key:<28}{value}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    products = commands.add_parser("projections")
    products.add_argument("--shape", default="qwen2.5-7b")
    products.add_argument("--tokens", type=int, default=8192)
    add_json_option(products)
    run = commands.add_parser("accuracy")
    run.add_argument("checkpoint", type=Path)
    run.add_argument("data", type=Path)
    run.add_argument("--steps", type=int, default=200)
    run.add_argument("--seq", type=int, default=2048)
    run.add_argument("--micro-batch", type=int, default=4)
    run.add_argument("--output", type=Path, default=Path("outputs/fp8_accuracy"))
    add_json_option(run)
    args = parser.parse_args()
    if args.command == "projections":
        rows = projection_rows(args.shape, args.tokens)
        print(f"{args.shape}, {args.tokens} tokens, {torch.cuda.get_device_name()}")
        print_projections(rows)
        write_json(args.json, "benchmarks.fp8", rows)
    else:
        write_json(args.json, "benchmarks.fp8", accuracy(args))


if __name__ == "__main__":
    main()
