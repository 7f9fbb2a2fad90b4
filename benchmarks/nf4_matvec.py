"""Decode-time NF4 projections: our Triton GEMV against dequantize + matmul and bitsandbytes.

Usage: python -m benchmarks.nf4_matvec [--model qwen2.5-7b] [--rows 1,16] [--sweep] [--json FILE]

At a model's projection groups (qkv with biases, o, gate/up, down; NF4 with double quantization,
bf16 activations) and M decode rows, times as CUDA-graph replays (median of 50; Python's launch
overhead left out, as a decoder replaying a graph sees it):
  - `qlora_kernels.nf4_matvec.nf4_matvec`, the whole group in one call (and eagerly, launches
    included, for a decoder without graphs);
  - `dequantize_nf4` of the group into one scratch matrix, then one bf16 matmul (+ bias): the
    training forward's path;
  - bitsandbytes' `matmul_4bit` one weight at a time, as HF + PEFT decode: its fused GEMV kernel
    at M = 1, dequantize + matmul above. Skipped with a note when bitsandbytes is not installed.
GB/s counts the bytes a call must read (the NF4 codes, absmaxes, x) and write (y) once.
`--sweep` also times our kernel at one row over a grid of tile sizes per shape and prints the fastest, to
retune `default_config`.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict

import torch

from benchmarks.output import add_json_option, write_json
from benchmarks.shapes import QWEN25
from qlora_cli.profiler.timing import Timing, measure
from qlora_kernels.nf4 import NF4Weight, dequantize_nf4, quantize_nf4
from qlora_kernels.nf4_matvec import MatvecConfig, _nf4_matvec_triton, default_config, nf4_matvec


def projection_groups(name: str) -> dict[str, tuple[int, list[tuple[int, bool]]]]:
    """Group → (in features, [(out features, has bias)]) for a Qwen2.5 shape."""
    shape = QWEN25[name]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {
        "qkv": (h, [(h, True), (kv, True), (kv, True)]),
        "o": (h, [(h, False)]),
        "gate_up": (h, [(inter, False), (inter, False)]),
        "down": (inter, [(h, False)]),
    }


def _replay(fn) -> Timing:
    """CUDA-graph replays; a call that cannot be captured is timed eagerly (the method says so)."""
    try:
        return measure(fn, "cuda", repeats=50, warmup=3, graph=True)
    except RuntimeError:
        torch.cuda.synchronize()
        return measure(fn, "cuda", repeats=50, warmup=3)


def _nf4_bytes(weight: NF4Weight) -> int:
    nested = 0 if weight.nested_absmax is None else weight.nested_absmax.nbytes
    return weight.packed.nbytes + weight.absmax.nbytes + nested


def _bnb_runner(dense: list[torch.Tensor], biases, x: torch.Tensor):
    """bitsandbytes' matmul_4bit over the group's weights, or a note why there is none."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        return None, "bitsandbytes not installed: pip install bitsandbytes"
    states = [
        bnb_functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        for w in dense
    ]

    def run():
        return [
            bnb.matmul_4bit(x, packed.t(), quant_state=state, bias=bias)
            for (packed, state), bias in zip(states, biases, strict=True)
        ]

    return run, f"bitsandbytes {bnb.__version__}"


def _sweep_configs() -> list[MatvecConfig]:
    """Tiles x warps x (programs per SM, longest program) that choose the K split."""
    tiles = itertools.product([16, 32, 64], [128, 256, 512], [4, 8])
    splits = list(itertools.product([2, 4, 8], [2, 4, 8, 16]))
    return [
        MatvecConfig(n, k, warps, programs_per_sm=programs, k_tiles_per_program=length)
        for (n, k, warps), (programs, length) in itertools.product(tiles, splits)
    ]


def _sweep(x, weights, biases) -> dict:
    """Fastest configuration for this shape over _sweep_configs."""
    best = None
    for candidate in _sweep_configs():
        try:
            timing = _replay(lambda c=candidate: _nf4_matvec_triton(x, weights, biases, c))
        except Exception as error:  # a tile the compiler rejects (registers, shared memory)
            print(f"    {candidate}: {type(error).__name__}")
            continue
        if best is None or timing.median_ms < best[1].median_ms:
            best = (candidate, timing)
    config, timing = best
    return {"config": asdict(config), "median_ms": timing.median_ms}


def bench_group(in_features: int, specs, rows: int, sweep: bool) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    dense = [
        (torch.randn(out, in_features, device="cuda", generator=generator) * in_features**-0.5).bfloat16()
        for out, _ in specs
    ]
    weights = [quantize_nf4(w) for w in dense]
    biases = [torch.randn(out, device="cuda").bfloat16() * 0.1 if bias else None for out, bias in specs]
    x = torch.randn(rows, in_features, device="cuda", generator=generator).bfloat16()
    total_out = sum(out for out, _ in specs)
    scratch = torch.empty(total_out, in_features, device="cuda", dtype=torch.bfloat16)
    stacked_bias = torch.cat(
        [
            b if b is not None else torch.zeros(out, device="cuda", dtype=torch.bfloat16)
            for (out, _), b in zip(specs, biases, strict=True)
        ]
    )
    has_bias = any(b is not None for b in biases)

    def dequantize_matmul():
        row = 0
        for weight in weights:
            dequantize_nf4(weight, out=scratch[row : row + weight.shape[0]])
            row += weight.shape[0]
        return torch.nn.functional.linear(x, scratch, stacked_bias if has_bias else None)

    ours = nf4_matvec(x, weights, biases)
    error = (ours.float() - dequantize_matmul().float()).abs().max().item()
    moved = sum(_nf4_bytes(w) for w in weights) + x.nbytes + ours.nbytes
    timings = {
        "nf4_matvec": _replay(lambda: nf4_matvec(x, weights, biases)),
        "nf4_matvec_eager": measure(lambda: nf4_matvec(x, weights, biases), "cuda", repeats=50, warmup=3),
        "dequantize_matmul": _replay(dequantize_matmul),
    }
    bnb_run, bnb_note = _bnb_runner(dense, biases, x)
    if bnb_run is not None:
        timings["bnb_matmul_4bit"] = _replay(bnb_run)
    result = {
        "rows": rows,
        "in": in_features,
        "outs": [out for out, _ in specs],
        "bytes": moved,
        "max_abs_diff_vs_dequantize_matmul": error,
        "bnb": bnb_note,
        "config": asdict(default_config()),
        "timings": {
            name: t.to_json() | {"gb_per_s": moved / (t.median_ms * 1e6)} for name, t in timings.items()
        },
    }
    if sweep and rows == 1:
        result["sweep_best"] = _sweep(x, weights, biases)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(QWEN25))
    parser.add_argument("--rows", default="1,16", help="decode rows (batch) to time, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="also search tile sizes per shape")
    add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{args.model}, bf16 x, NF4 double-quantized weights, {torch.cuda.get_device_name()}")
    print(
        f"{'group':<9}{'M':>4}{'ours us':>10}{'GB/s':>7}{'eager us':>10}{'deq+mm us':>11}{'GB/s':>7}{'bnb us':>9}{'GB/s':>7}"
    )
    results = {}
    with torch.inference_mode():
        for rows in rows_list:
            for group, (in_features, specs) in projection_groups(args.model).items():
                r = bench_group(in_features, specs, rows, args.sweep)
                results[f"{group}/M={rows}"] = r
                t = r["timings"]

                def cell(name, t=t):
                    if name not in t:
                        return f"{'-':>9}{'-':>7}"
                    return f"{t[name]['median_ms'] * 1e3:>9.1f}{t[name]['gb_per_s']:>7.0f}"

                print(
                    f"{group:<9}{rows:>4} {cell('nf4_matvec')}{t['nf4_matvec_eager']['median_ms'] * 1e3:>10.1f}"
                    f"  {cell('dequantize_matmul')}{cell('bnb_matmul_4bit')}",
                    flush=True,
                )
                if "sweep_best" in r:
                    best = r["sweep_best"]
                    print(f"{'':<13}fastest tiles: {best['config']} {best['median_ms'] * 1e3:.1f} us")
    notes = {r["bnb"] for r in results.values()}
    print("bnb: " + "; ".join(sorted(notes)))
    write_json(args.json, "benchmarks.nf4_matvec", results)


if __name__ == "__main__":
    main()
