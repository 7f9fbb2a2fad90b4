"""GPU time of each projection group with and without LoRA, timed as CUDA-graph replays.

Usage: python -m benchmarks.projections [--model qwen2.5-7b] [--tokens 8192] [--rank 16]

For qkv, o, gate/up and down at a model's shapes (NF4 weights, bf16 activations), times
`kernels.linear.lora_linear` forward, and forward + backward, bare and with LoRA on every
projection. Replaying a captured graph leaves out Python's launch overhead, so the difference is
what LoRA costs the GPU.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.shapes import QWEN25
from kernels.linear import buffer_numel, lora_linear
from kernels.nf4 import quantize_nf4


def replay_us(fn, replays: int = 20) -> float:
    """Mean µs of one replay of `fn` captured as a CUDA graph (after an eager warm-up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def projection_groups(name: str) -> dict[str, tuple[list[tuple[int, int]], bool]]:
    """Group name → ([(out, in) per projection], has bias) for a Qwen2.5 shape (q/k/v carry a bias)."""
    shape = QWEN25[name]
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {
        "qkv": ([(h, h), (kv, h), (kv, h)], True),
        "o": ([(h, h)], False),
        "gate_up": ([(inter, h), (inter, h)], False),
        "down": ([(h, inter)], False),
    }


def time_group(sizes, bias: bool, tokens: int, rank: int) -> dict[str, float]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16

    def randn(*shape, scale=1.0, **kwargs):
        return torch.randn(*shape, device="cuda", generator=generator, **kwargs) * scale

    weights = [quantize_nf4(randn(out, inp, scale=inp**-0.5).to(dtype)) for out, inp in sizes]
    biases = [randn(out, scale=0.1).to(dtype) if bias else None for out, _ in sizes]
    in_features = sizes[0][1]
    lora_a = [randn(rank, in_features, scale=0.01).requires_grad_() for _ in sizes]
    lora_b = [randn(out, rank, scale=0.01).requires_grad_() for out, _ in sizes]
    buffer = torch.empty(buffer_numel(weights, lora_a), dtype=dtype, device="cuda")
    x = randn(tokens, in_features).to(dtype).requires_grad_()
    dy = randn(tokens, sum(out for out, _ in sizes)).to(dtype)
    none = [None] * len(sizes)

    def forward(a, b):
        return lora_linear(x, weights, biases, a, b, 2.0, buffer=buffer)

    def both(a, b):
        return torch.autograd.grad(forward(a, b), [x, *[t for t in a + b if t is not None]], dy)

    return {
        "bare_fwd": replay_us(lambda: forward(none, none)),
        "bare_both": replay_us(lambda: both(none, none)),
        "lora_fwd": replay_us(lambda: forward(lora_a, lora_b)),
        "lora_both": replay_us(lambda: both(lora_a, lora_b)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(QWEN25))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a GPU")
    print(f"{args.model}, {args.tokens} tokens, LoRA r {args.rank}, µs per call (CUDA-graph replays)")
    print(f"{'group':<9}{'bare fwd':>10}{'LoRA fwd':>10}{'+':>8}{'bare f+b':>10}{'LoRA f+b':>10}{'+':>8}")
    for name, (sizes, bias) in projection_groups(args.model).items():
        t = time_group(sizes, bias, args.tokens, args.rank)
        print(
            f"{name:<9}{t['bare_fwd']:>10.1f}{t['lora_fwd']:>10.1f}{t['lora_fwd'] - t['bare_fwd']:>8.1f}"
            f"{t['bare_both']:>10.1f}{t['lora_both']:>10.1f}{t['lora_both'] - t['bare_both']:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
