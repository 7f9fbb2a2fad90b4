"""GPU time of each projection group with and without LoRA, timed as CUDA-graph replays.

Usage: python -m benchmarks.projections [--model qwen2.5-7b] [--tokens 8192] [--rank 16] [--json FILE]

At a model's shapes (NF4 weights, bf16 activations) times, bare and with LoRA on every
projection, forward and forward + backward of what the model runs: `qlora_kernels.linear.lora_linear`
for qkv and o, and for the MLP gate/up (`lora_linear_a`) → SwiGLU (`qlora_kernels.swiglu.lora_swiglu`)
→ down (`lora_linear_b`), where the MLP's LoRA is split across the three. Replaying a captured
graph leaves out Python's launch overhead, so the difference is what LoRA costs the GPU. Times are
the median of 20 replays (qlora_cli/profiler/timing.py); --json also keeps the fastest.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.output import add_json_option, write_json
from benchmarks.shapes import QWEN25
from qlora_cli.profiler.timing import Timing, measure
from qlora_kernels.linear import buffer_numel, lora_linear, lora_linear_a, lora_linear_b
from qlora_kernels.nf4 import quantize_nf4
from qlora_kernels.swiglu import lora_swiglu


def replay(fn) -> Timing:
    """Replays of `fn` captured as a CUDA graph, after two eager calls."""
    return measure(fn, "cuda", repeats=20, warmup=2, graph=True)


def projection_groups(name: str) -> dict[str, tuple[list[tuple[int, int]], bool]]:
    """Group name → ([(out, in) per projection], has bias) for a Qwen2.5 shape (q/k/v carry a bias)."""
    shape = QWEN25[name]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {
        "qkv": ([(h, h), (kv, h), (kv, h)], True),
        "o": ([(h, h)], False),
        "mlp": ([(inter, h), (inter, h), (h, inter)], False),
    }


def _randn(generator):
    def randn(*shape, scale=1.0, **kwargs):
        return torch.randn(*shape, device="cuda", generator=generator, **kwargs) * scale

    return randn


def _lora(randn, sizes, rank):
    weights = [quantize_nf4((randn(out, inp, scale=inp**-0.5)).bfloat16()) for out, inp in sizes]
    lora_a = [randn(rank, inp, scale=0.01).requires_grad_() for _, inp in sizes]
    lora_b = [randn(out, rank, scale=0.01).requires_grad_() for out, _ in sizes]
    return weights, lora_a, lora_b


def _timings(forward, both) -> dict[str, Timing]:
    return {
        "bare_fwd": replay(lambda: forward(False)),
        "bare_both": replay(lambda: both(False)),
        "lora_fwd": replay(lambda: forward(True)),
        "lora_both": replay(lambda: both(True)),
    }


def time_mlp(sizes, tokens: int, rank: int) -> dict[str, Timing]:
    """gate/up → SwiGLU → down as the model runs it, LoRA's B of gate/up and A of down in SwiGLU."""
    randn = _randn(torch.Generator(device="cuda").manual_seed(0))
    weights, lora_a, lora_b = _lora(randn, sizes, rank)
    hidden = sizes[0][1]
    buffer = torch.empty(
        max(buffer_numel(weights[:2], lora_a[:2]), buffer_numel(weights[2:], lora_a[2:])),
        dtype=torch.bfloat16,
        device="cuda",
    )
    x = randn(tokens, hidden).bfloat16().requires_grad_()
    dy = randn(tokens, hidden).bfloat16()

    def forward(lora):
        a, b = (lora_a, lora_b) if lora else ([None] * 3, [None] * 3)
        gate_up, t = lora_linear_a(x, weights[:2], [None, None], a[:2], buffer=buffer)
        h, down_t = lora_swiglu(gate_up, t, b[0], b[1], 2.0, a[2])
        return lora_linear_b(h, down_t, weights[2:], [None], b[2:], 2.0, buffer=buffer)

    def both(lora):
        leaves = [x, *lora_a, *lora_b] if lora else [x]
        return torch.autograd.grad(forward(lora), leaves, dy)

    return _timings(forward, both)


def time_group(sizes, bias: bool, tokens: int, rank: int) -> dict[str, Timing]:
    randn = _randn(torch.Generator(device="cuda").manual_seed(0))
    weights, lora_a, lora_b = _lora(randn, sizes, rank)
    biases = [randn(out, scale=0.1).bfloat16() if bias else None for out, _ in sizes]
    buffer = torch.empty(buffer_numel(weights, lora_a), dtype=torch.bfloat16, device="cuda")
    x = randn(tokens, sizes[0][1]).bfloat16().requires_grad_()
    dy = randn(tokens, sum(out for out, _ in sizes)).bfloat16()
    none = [None] * len(sizes)

    def forward(lora):
        a, b = (lora_a, lora_b) if lora else (none, none)
        return lora_linear(x, weights, biases, a, b, 2.0, buffer=buffer)

    def both(lora):
        leaves = [x, *lora_a, *lora_b] if lora else [x]
        return torch.autograd.grad(forward(lora), leaves, dy)

    return _timings(forward, both)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(QWEN25))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a GPU")
    print(f"{args.model}, {args.tokens} tokens, LoRA r {args.rank}, median µs per call (CUDA-graph replays)")
    print(f"{'group':<9}{'bare fwd':>10}{'LoRA fwd':>10}{'+':>8}{'bare f+b':>10}{'LoRA f+b':>10}{'+':>8}")
    results = {}
    for name, (sizes, bias) in projection_groups(args.model).items():
        if name == "mlp":
            timings = time_mlp(sizes, args.tokens, args.rank)
        else:
            timings = time_group(sizes, bias, args.tokens, args.rank)
        results[name] = {key: timing.to_json() for key, timing in timings.items()}
        t = {key: timing.median_ms * 1e3 for key, timing in timings.items()}
        print(
            f"{name:<9}{t['bare_fwd']:>10.1f}{t['lora_fwd']:>10.1f}{t['lora_fwd'] - t['bare_fwd']:>8.1f}"
            f"{t['bare_both']:>10.1f}{t['lora_both']:>10.1f}{t['lora_both'] - t['bare_both']:>8.1f}",
            flush=True,
        )
    settings = {"model": args.model, "tokens": args.tokens, "rank": args.rank}
    write_json(args.json, "benchmarks.projections", settings | {"groups": results})


if __name__ == "__main__":
    main()
