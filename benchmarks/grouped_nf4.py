"""The grouped NF4 GEMM over experts against the bf16 grouped GEMM, at mixture-of-experts shapes.

Usage: python -m benchmarks.grouped_nf4 [--shapes qwen3.5-35b-a3b,qwen3-30b-a3b] [--tokens 4096]
       [--before FILE] [--variant rows=128,warps=8 ...] [--json FILE]

For each shape's routed experts (NF4 with double quantization, bf16 activations), tokens routed to
top-k experts drawn at random and sorted by expert, times (median, CUDA events) the gate/up and down
projections, forward (y = x W_e^T) and the backward's input gradient (dx = dy W_e):
  - ours, `qlora_kernels.grouped_linear.grouped_linear`, decoding NF4 tiles inside the GEMM, and the
    same kernel on the bf16 experts (what a MoE with `load_in_4bit: false` runs);
  - torch's bf16 grouped GEMM (`torch._grouped_mm`) on the same weights dequantized once, the
    throughput the NF4 kernel is held to (the target is at least 70 % of it);
  - one bf16 matmul per expert, as the fixes that dequantize one expert at a time run.
TFLOP/s counts 2 x rows x in x out per projection. `--before FILE` also times another copy of the
kernel module (`git show REV:kernels/grouped_linear.py > FILE`) on the same experts, quantized by that
copy, so that a change's before and after come from one call. Each `--variant` also times our NF4
kernel with launch settings replaced: rows of one expert a program (`rows`), output columns (`cols`),
inner step (`inner`), `warps`, `stages` and whether NF4 codes are picked from the 16 values (tl.gather)
or each load its own (`gather=1/0`) (kernels/grouped_linear.py's _NF4_ROWS, _BLOCK_N, _BLOCK_K,
_NF4_WARPS, _NF4_STAGES, _NF4_GATHER_CODES; NF4 tiles stay whole quantization blocks wide).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType

import torch

from benchmarks.output import add_json_option, write_json
from benchmarks.variants import patched, variant
from qlora_cli.profiler.timing import measure
from qlora_kernels import grouped_linear as grouped_module
from qlora_kernels.grouped_linear import dequantize_grouped_nf4, grouped_linear, quantize_grouped_nf4

# Routed experts of each model: (experts, top-k, hidden size, expert intermediate size).
SHAPES = {
    "qwen3.5-35b-a3b": (256, 8, 2048, 512),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


VARIANT_KEYS = {
    "rows": lambda rows: {(grouped_module, "_NF4_ROWS"): rows},
    "cols": lambda cols: {(grouped_module, "_BLOCK_N"): cols},
    "inner": lambda inner: {(grouped_module, "_BLOCK_K"): inner},
    "warps": lambda warps: {(grouped_module, "_NF4_WARPS"): warps},
    "stages": lambda stages: {(grouped_module, "_NF4_STAGES"): stages},
    "gather": lambda gather: {(grouped_module, "_NF4_GATHER_CODES"): bool(gather)},
}


def routed_offsets(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [experts + 1]: where each expert's rows start when every token picks top_k distinct
    experts at random and the tokens' copies are sorted by expert."""
    choices = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    counts = torch.bincount(choices.flatten(), minlength=experts)
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])


def _bf16_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor):
    """torch's grouped GEMM: each expert's rows of a [rows, k] times its b [E, k, n], which it takes
    column-major; the experts' row ends are offsets[1:] as int32."""
    ends = offsets[1:].to(torch.int32)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return lambda: torch._grouped_mm(a, b, offs=ends)


def _per_expert(x: torch.Tensor, dense: torch.Tensor, bounds: list[int]):
    def run():
        return torch.cat([x[a:b] @ w.T for a, b, w in zip(bounds[:-1], bounds[1:], dense, strict=True)])

    return run


def load_before(path: str) -> ModuleType:
    """An earlier copy of kernels/grouped_linear.py, imported beside ours under its own name."""
    name = "qlora_kernels.grouped_linear_before"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise SystemExit(f"--before {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _patched_call(fn, overrides: dict):
    def run():
        with patched(overrides):
            return fn()

    return run


def time_projection(
    name: str,
    rows: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    before: ModuleType | None,
    variants: dict[str, dict],
) -> dict:
    """ms and TFLOP/s of each implementation for one projection, forward and input gradient."""
    grouped = quantize_grouped_nf4(weights)
    dense = dequantize_grouped_nf4(grouped)
    bounds = offsets.tolist()
    offsets = offsets.cuda()
    x = rows.requires_grad_()
    dy = torch.randn(rows.shape[0], weights.shape[1], device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows.shape[0] * weights.shape[1] * weights.shape[2]
    forward = lambda: grouped_linear(x, grouped, offsets)  # noqa: E731
    y = forward()
    plain = lambda: grouped_linear(x, dense, offsets)  # noqa: E731
    y_plain = plain()
    cases = {
        "ours NF4, forward": forward,
        "ours NF4, input gradient": lambda: torch.autograd.grad(y, x, dy, retain_graph=True),
        "ours bf16, forward": plain,
        "ours bf16, input gradient": lambda: torch.autograd.grad(y_plain, x, dy, retain_graph=True),
        "bf16 grouped GEMM, forward": _bf16_grouped(rows.detach(), dense.transpose(1, 2), offsets),
        "bf16 grouped GEMM, input gradient": _bf16_grouped(dy, dense, offsets),
        "bf16 per expert, forward": _per_expert(rows.detach(), dense, bounds),
    }
    for text, overrides in variants.items():
        run = _patched_call(forward, overrides)
        y_variant = run()
        cases[f"ours NF4 {text}, forward"] = run
        cases[f"ours NF4 {text}, input gradient"] = _patched_call(
            lambda y=y_variant: torch.autograd.grad(y, x, dy, retain_graph=True), overrides
        )
    if before is not None:
        before_grouped = before.quantize_grouped_nf4(weights)
        before_forward = lambda: before.grouped_linear(x, before_grouped, offsets)  # noqa: E731
        y_before = before_forward()
        cases["before NF4, forward"] = before_forward
        cases["before NF4, input gradient"] = lambda: torch.autograd.grad(y_before, x, dy, retain_graph=True)
    results = {}
    for case, fn in cases.items():
        try:
            ms = measure(fn, "cuda", repeats=20, warmup=3).median_ms
        except (RuntimeError, AttributeError) as error:
            print(f"  {name:8} {case:44} not run: {str(error).splitlines()[0]}")
            continue
        results[case] = {"ms": ms, "tflops": flops / ms / 1e9}
        print(f"  {name:8} {case:44} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s", flush=True)
    for side in ("forward", "input gradient"):
        ours, bf16 = results.get(f"ours NF4, {side}"), results.get(f"bf16 grouped GEMM, {side}")
        if ours and bf16:
            print(
                f"  {name:8} {side}: ours at {bf16['ms'] / ours['ms']:.0%} of the bf16 grouped GEMM's throughput"
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--before", help="also time this copy of kernels/grouped_linear.py, as 'before'")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help=f"also time our NF4 kernel with these settings, e.g. rows=128,warps=8 (keys: {', '.join(VARIANT_KEYS)})",
    )
    add_json_option(parser)
    args = parser.parse_args()
    before = load_before(args.before) if args.before else None
    variants = {text: variant(text, VARIANT_KEYS) for text in args.variant}
    generator = torch.Generator().manual_seed(0)
    results = {}
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        experts, top_k, hidden, inter = SHAPES[shape]
        offsets = routed_offsets(args.tokens, experts, top_k, generator)
        rows = int(offsets[-1])
        print(
            f"{shape}: {args.tokens} tokens, top-{top_k} of {experts} experts, {rows} routed rows", flush=True
        )
        results[shape] = {}
        for name, out_features, in_features in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            weights = 0.02 * torch.randn(experts, out_features, in_features, generator=generator)
            x = torch.randn(rows, in_features, generator=generator).cuda().bfloat16()
            results[shape][name] = time_projection(
                name, x, weights.cuda().bfloat16(), offsets, before, variants
            )
    write_json(args.json, "benchmarks.grouped_nf4", results)


if __name__ == "__main__":
    main()
