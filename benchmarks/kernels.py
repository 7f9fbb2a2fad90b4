"""Each Triton kernel against the torch eager composition it replaces, forward + backward, at Qwen2.5-7B shapes
(Qwen3.5-9B shapes for the Qwen3.5 variants).

Usage: python -m benchmarks.kernels [--tokens 8192] [--only NAME ...] [--markdown FILE] [--json FILE]
Prints one row per kernel: median time (CUDA events, qlora_cli/profiler/timing.py) and peak extra
memory for ours and for torch, and the ratio; --json also keeps each side's fastest call. --only keeps
the kernels whose names contain one of the given words (e.g. --only conv1d).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.table import Table

from benchmarks.output import add_json_option, write_json
from qlora_cli.core.console import OutputConsole
from qlora_cli.profiler.timing import Timing, measure
from qlora_kernels.attention import attention
from qlora_kernels.conv1d import causal_conv1d, causal_conv1d_reference
from qlora_kernels.cross_entropy import linear_cross_entropy
from qlora_kernels.linear import lora_linear
from qlora_kernels.nf4 import dequantize_nf4, dequantize_nf4_reference, quantize_nf4
from qlora_kernels.rmsnorm import add_rms_norm, gated_rms_norm, gated_rms_norm_reference
from qlora_kernels.rope import apply_rope, rope_reference
from qlora_kernels.sigmoid_gate import sigmoid_gate, sigmoid_gate_reference
from qlora_kernels.swiglu import swiglu

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, RANK = 3584, 18944, 28, 4, 128, 152064, 16
BF16 = torch.bfloat16
# Qwen3.5-9B: full attention 16 heads (4 kv) of 256 dims, 64 of them rotary; Gated DeltaNet 32 value heads of 128.
Q35_HEADS, Q35_KV_HEADS, Q35_HEAD_DIM, Q35_ROTARY, Q35_V_HEADS, Q35_V_DIM = 16, 4, 256, 64, 32, 128
# Its short convolution runs over q, k and v of the delta rule: 2 * 16 key heads of 128 + 32 value heads of 128.
Q35_CONV_CHANNELS, Q35_CONV_WIDTH = 2 * 16 * 128 + Q35_V_HEADS * Q35_V_DIM, 4


def time_and_memory(fn: Callable[[], None]) -> tuple[Timing, float]:
    """fn's time per call and the peak memory (GiB) it allocates above what was live before."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return measure(fn, "cuda", repeats=25, warmup=3), peak


def fwd_bwd(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    def run():
        for t in inputs:
            t.grad = None
        out = forward()
        out.backward(torch.ones_like(out) if out.dim() else None)

    return run


def leaf(*shape, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_()


def eager_rms(x, r, w, eps=1e-6):
    s = x + r
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(s.dtype), s


def eager_rope(q, k, positions, inv_freq):
    angle = positions[..., None].float() * inv_freq
    emb = torch.cat([angle, angle], -1)
    cos, sin = emb.cos().to(q.dtype)[:, :, None], emb.sin().to(q.dtype)[:, :, None]

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], -1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def qwen3_5_cases(tokens: int) -> dict[str, tuple[Callable, Callable]]:
    """The Qwen3.5 variants against the torch references (HF's eager code, op for op)."""
    batch, seq = tokens // 2048, 2048
    q_gate = leaf(batch, seq, Q35_HEADS, 2 * Q35_HEAD_DIM)
    q, gate = q_gate[..., :Q35_HEAD_DIM], q_gate[..., Q35_HEAD_DIM:]
    k = leaf(batch, seq, Q35_KV_HEADS, Q35_HEAD_DIM)
    norm_weight = torch.zeros(Q35_HEAD_DIM, device="cuda", dtype=torch.float32)
    positions = torch.arange(seq, device="cuda").expand(batch, seq)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, Q35_ROTARY, 2, device="cuda").float() / Q35_ROTARY))
    rope_args = (q, k, positions, inv_freq, norm_weight, norm_weight, 1e-6)
    attn = leaf(batch, seq, Q35_HEADS, Q35_HEAD_DIM)
    o, z = leaf(batch, seq, Q35_V_HEADS, Q35_V_DIM), leaf(batch, seq, Q35_V_HEADS, Q35_V_DIM)
    v_weight = torch.ones(Q35_V_DIM, device="cuda", dtype=torch.float32)
    conv_x = leaf(batch, seq, Q35_CONV_CHANNELS)
    conv_weight = leaf(Q35_CONV_CHANNELS, Q35_CONV_WIDTH, scale=0.5)
    conv_docs = (torch.arange(seq, device="cuda") // 700).expand(batch, seq)
    conv_args = (conv_x, conv_weight, None, conv_docs)
    conv_dy = torch.randn_like(conv_x)
    # Backward alone: one forward kept, its graph retained, so the profile's conv1d_bwd row is timed by itself.
    conv_y, conv_ref = causal_conv1d(*conv_args), causal_conv1d_reference(*conv_args)
    return {
        "qwen3.5 qk-norm + partial rope": (
            fwd_bwd(
                lambda: sum(t.float().sum() for t in apply_rope(*rope_args, zero_centred_norm=True)),
                [q_gate, k],
            ),
            fwd_bwd(
                lambda: sum(t.float().sum() for t in rope_reference(*rope_args, zero_centred_norm=True)),
                [q_gate, k],
            ),
        ),
        "qwen3.5 attention output gate": (
            fwd_bwd(lambda: sigmoid_gate(attn, gate).float().sum(), [attn, q_gate]),
            fwd_bwd(lambda: sigmoid_gate_reference(attn, gate).float().sum(), [attn, q_gate]),
        ),
        "qwen3.5 gated rms_norm": (
            fwd_bwd(lambda: gated_rms_norm(o, z, v_weight, 1e-6).float().sum(), [o, z]),
            fwd_bwd(lambda: gated_rms_norm_reference(o, z, v_weight, 1e-6).float().sum(), [o, z]),
        ),
        "qwen3.5 conv1d + silu forward": (
            lambda: causal_conv1d(*conv_args),
            lambda: causal_conv1d_reference(*conv_args),
        ),
        "qwen3.5 conv1d + silu backward": (
            lambda: torch.autograd.grad(conv_y, (conv_x, conv_weight), conv_dy, retain_graph=True),
            lambda: torch.autograd.grad(conv_ref, (conv_x, conv_weight), conv_dy, retain_graph=True),
        ),
    }


def cases(tokens: int) -> dict[str, tuple[Callable, Callable]]:
    batch, seq = tokens // 2048, 2048
    x, r = leaf(tokens, HIDDEN), leaf(tokens, HIDDEN)
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.float32)
    q, k = leaf(batch, seq, HEADS, HEAD_DIM), leaf(batch, seq, KV_HEADS, HEAD_DIM)
    v = leaf(batch, seq, KV_HEADS, HEAD_DIM)
    positions = torch.arange(seq, device="cuda").expand(batch, seq)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    gate_up = leaf(tokens, 2 * INTER)
    hidden = leaf(tokens, HIDDEN, scale=0.5)
    lm_head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=BF16) * 0.02
    labels = torch.randint(0, VOCAB, (tokens,), device="cuda")
    # An SFT row's shape: the first 40 % of each 2048-token row a prompt no loss reads.
    prompted = labels.view(batch, seq).clone()
    prompted[:, : seq * 2 // 5] = -100
    prompted = prompted.view(-1)
    weight = torch.randn(INTER, HIDDEN, device="cuda", dtype=BF16) * 0.02
    nf4 = [quantize_nf4(weight), quantize_nf4(weight)]
    lora_a = [leaf(RANK, HIDDEN, scale=0.02, dtype=torch.float32) for _ in range(2)]
    lora_b = [leaf(INTER, RANK, scale=0.02, dtype=torch.float32) for _ in range(2)]
    lin_x = leaf(tokens, HIDDEN)
    scratch = torch.empty(2 * INTER * (HIDDEN + 2 * RANK), device="cuda", dtype=BF16)

    def eager_lora_linear():
        outs = []
        for wq, a, b in zip(nf4, lora_a, lora_b, strict=True):
            dense = dequantize_nf4(wq)
            outs.append(F.linear(lin_x, dense) + 2.0 * (lin_x.float() @ a.T @ b.T).to(BF16))
        return torch.cat(outs, -1)

    def eager_attention():
        kk = k.repeat_interleave(HEADS // KV_HEADS, 2).transpose(1, 2)
        vv = v.repeat_interleave(HEADS // KV_HEADS, 2).transpose(1, 2)
        scores = (q.transpose(1, 2) @ kk.transpose(-1, -2)).float() / HEAD_DIM**0.5
        scores = scores.masked_fill(
            torch.ones(seq, seq, device="cuda", dtype=torch.bool).triu(1), float("-inf")
        )
        return (scores.softmax(-1).to(BF16) @ vv).transpose(1, 2)

    doc_ids = (torch.arange(seq, device="cuda") // 700).expand(batch, seq).to(torch.int32)
    return {
        "add_rms_norm": (
            fwd_bwd(lambda: sum(t.sum() for t in add_rms_norm(x, r, w, 1e-6)), [x, r]),
            fwd_bwd(lambda: sum(t.sum() for t in eager_rms(x, r, w)), [x, r]),
        ),
        "rope (q and k)": (
            fwd_bwd(lambda: sum(t.float().sum() for t in apply_rope(q, k, positions, inv_freq)), [q, k]),
            fwd_bwd(lambda: sum(t.float().sum() for t in eager_rope(q, k, positions, inv_freq)), [q, k]),
        ),
        "swiglu": (
            fwd_bwd(lambda: swiglu(gate_up).float().sum(), [gate_up]),
            fwd_bwd(lambda: (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]).float().sum(), [gate_up]),
        ),
        "attention triton vs eager": (
            fwd_bwd(lambda: attention(q, k, v, backend="triton").float().sum(), [q, k, v]),
            fwd_bwd(lambda: eager_attention().float().sum(), [q, k, v]),
        ),
        "attention triton vs sdpa": (
            fwd_bwd(lambda: attention(q, k, v, backend="triton").float().sum(), [q, k, v]),
            fwd_bwd(lambda: attention(q, k, v, backend="sdpa").float().sum(), [q, k, v]),
        ),
        "attention packed triton vs sdpa": (
            fwd_bwd(lambda: attention(q, k, v, doc_ids, backend="triton").float().sum(), [q, k, v]),
            fwd_bwd(lambda: attention(q, k, v, doc_ids, backend="sdpa").float().sum(), [q, k, v]),
        ),
        "lm_head + cross-entropy": (
            fwd_bwd(lambda: linear_cross_entropy(hidden, lm_head, labels)[0], [hidden]),
            fwd_bwd(lambda: F.cross_entropy((hidden @ lm_head.T).float(), labels, reduction="sum"), [hidden]),
        ),
        "lm_head, trained rows only vs all, 40 % masked": (
            fwd_bwd(
                lambda: linear_cross_entropy(hidden, lm_head, prompted, trained_rows_only=True)[0], [hidden]
            ),
            fwd_bwd(lambda: linear_cross_entropy(hidden, lm_head, prompted)[0], [hidden]),
        ),
        "lm_head, trained rows only vs all, none masked": (
            fwd_bwd(
                lambda: linear_cross_entropy(hidden, lm_head, labels, trained_rows_only=True)[0], [hidden]
            ),
            fwd_bwd(lambda: linear_cross_entropy(hidden, lm_head, labels)[0], [hidden]),
        ),
        "nf4 dequantize (gate)": (
            lambda: dequantize_nf4(nf4[0], out=scratch),
            lambda: dequantize_nf4_reference(nf4[0]),
        ),
        "nf4 gate/up + LoRA": (
            fwd_bwd(
                lambda: (
                    lora_linear(lin_x, nf4, [None, None], lora_a, lora_b, 2.0, buffer=scratch).float().sum()
                ),
                [lin_x, *lora_a, *lora_b],
            ),
            fwd_bwd(lambda: eager_lora_linear().float().sum(), [lin_x, *lora_a, *lora_b]),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--only", nargs="+", help="only kernels whose names contain one of these")
    parser.add_argument("--markdown", help="also write the table as Markdown here")
    add_json_option(parser)
    args = parser.parse_args()
    table = Table(
        title=(
            f"kernels vs torch eager, fwd+bwd, {args.tokens} tokens, {torch.cuda.get_device_name()}, "
            "median of 25 calls"
        )
    )
    for column in ("kernel", "ours ms", "torch ms", "speed-up", "ours GiB", "torch GiB"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    rows, results = [], {}
    for name, (ours, theirs) in (cases(args.tokens) | qwen3_5_cases(args.tokens)).items():
        if args.only and not any(part in name for part in args.only):
            continue
        ours_time, ours_gib = time_and_memory(ours)
        torch_time, torch_gib = time_and_memory(theirs)
        ours_ms, torch_ms = ours_time.median_ms, torch_time.median_ms
        results[name] = {
            "ours": ours_time.to_json() | {"peak_gib": ours_gib},
            "torch": torch_time.to_json() | {"peak_gib": torch_gib},
            "speed_up": torch_ms / ours_ms,
        }
        row = (
            name,
            f"{ours_ms:.3f}",
            f"{torch_ms:.3f}",
            f"{torch_ms / ours_ms:.2f}x",
            f"{ours_gib:.2f}",
            f"{torch_gib:.2f}",
        )
        rows.append(row)
        table.add_row(*row)
        torch.cuda.empty_cache()
    OutputConsole().print(table)
    if args.markdown:
        lines = ["| " + " | ".join(c.header for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    write_json(args.json, "benchmarks.kernels", {"tokens": args.tokens, "kernels": results})


if __name__ == "__main__":
    main()
