"""Attention over packed rows against rows of one document: our kernel, torch's sdpa, FlexAttention and
torch's variable-length flash attention.

Usage: python -m benchmarks.packed_attention [--family qwen2.5-7b] [--seqs 2048,4096,16384] [--batch 1]
       [--backends triton,sdpa,flex,varlen] [--repeats 20] [--sweep] [--json FILE]

Forward + backward at a family's attention heads (`--family`, any shape in benchmarks/shapes.py:
qwen2.5-7b's 28 query heads, 4 kv heads and head_dim 128 by default, qwen3.5-9b's 16, 4 and 256),
bf16, each row either one causal document or Alpaca-like documents packed to the row's length
(lognormal token lengths, median 330, the tail cut at the row). A document mask leaves only the pairs
inside each document: `ideal` is the speed-up that skipping the emptied key blocks could give, the
causal pairs of one document over those left. Each backend's `speed-up` is its one-document time over
its packed time, so it shows how much of that a kernel takes. FlexAttention runs compiled, with its
block mask built once per doc_ids (kernels/attention.py); `flex mask ms` is that build, which a training
step pays once per micro-batch for all its layers. sdpa on packed rows needs a materialized mask.
`varlen` is torch.nn.attention.varlen (FlashAttention 2 over the documents as sequences, where this
torch has it); its time includes the documents' offsets read back to the host, which a CUDA graph
cannot capture. `--sweep` times our kernel's tile sizes for the family's head size on packed rows,
forward and backward apart (kernels/attention.py `_block_config` takes the winners).
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
from dataclasses import dataclass

import torch
import triton
from triton.runtime.errors import OutOfResources

from benchmarks.output import add_json_option, write_json
from benchmarks.shapes import MODELS, model_config
from qlora_cli.profiler.timing import measure
from qlora_cli.sources.model_config import spec_from_config
from qlora_kernels import attention as attention_module
from qlora_kernels.attention import attention

MEDIAN_TOKENS, SIGMA = 330, 0.6
# Tile sizes --sweep tries, per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages); a few around each head
# size's defaults, since each one compiles anew.
SWEEP = {
    "fwd": [(64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
    "dkdv": [(32, 32, 8, 2), (32, 32, 8, 3), (32, 64, 8, 2), (16, 64, 8, 2), (64, 32, 8, 2), (32, 64, 4, 3)],
    "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2), (64, 64, 4, 2)],
}


@dataclass(frozen=True)
class Heads:
    query: int
    kv: int
    dim: int


def family_heads(family: str) -> Heads:
    spec = spec_from_config(model_config(family))
    return Heads(spec.num_heads, spec.num_kv_heads, spec.head_dim)


def packed_doc_ids(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Rows filled with documents of Alpaca-like token lengths; the last one is cut at the row's end."""
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < seq_len:
            length = max(8, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA)))
            ids += [doc] * min(length, seq_len - len(ids))
            doc += 1
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.int32)


def ideal_speedup(doc_ids: torch.Tensor) -> float:
    """Causal pairs of one document over the causal pairs inside each document."""
    seq_len = doc_ids.shape[1]
    whole = seq_len * (seq_len + 1) / 2
    kept = 0.0
    for row in doc_ids:
        lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
        kept += float((lengths * (lengths + 1) / 2).sum())
    return whole * doc_ids.shape[0] / kept


def _inputs(batch: int, seq_len: int, heads: Heads):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(count):
        return torch.randn(
            batch, seq_len, count, heads.dim, generator=generator, device="cuda", dtype=torch.bfloat16
        ).requires_grad_(True)

    q, k, v = tensor(heads.query), tensor(heads.kv), tensor(heads.kv)
    dout = torch.randn(q.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    return q, k, v, dout


def varlen_attention(q, k, v, doc_ids):
    """torch's variable-length flash attention over the documents of every row as sequences."""
    from torch.nn.attention.varlen import varlen_attn

    batch, seq_len = q.shape[:2]
    if doc_ids is None:
        lengths = torch.full((batch,), seq_len, device=q.device, dtype=torch.int32)
    else:
        lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in doc_ids])
    offsets = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max())
    group = q.shape[2] // k.shape[2]
    options = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in options else {"window_size": (-1, 0)}
    if "enable_gqa" in options:
        causal["enable_gqa"] = group > 1
    elif group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = varlen_attn(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), offsets, offsets, longest, longest, **causal
    )
    return out.view(q.shape)


def _attend(backend: str, q, k, v, doc_ids):
    if backend == "varlen":
        return varlen_attention(q, k, v, doc_ids)
    return attention(q, k, v, doc_ids, backend=backend)


def time_backend(backend: str, q, k, v, dout, doc_ids, repeats: int) -> float:
    """Median milliseconds of one forward + backward."""

    def step():
        out = _attend(backend, q, k, v, doc_ids)
        torch.autograd.grad(out, (q, k, v), dout)

    return measure(step, "cuda", repeats=repeats, warmup=3).median_ms


def time_flex_mask(doc_ids: torch.Tensor, batch: int, seq_len: int, repeats: int) -> float:
    def build():
        attention_module._BlockMaskCache.key = None
        attention_module._BlockMaskCache.get(doc_ids, batch, seq_len, doc_ids.device)

    return measure(build, "cuda", repeats=repeats, warmup=2).median_ms


def run(seqs: list[int], batch: int, backends: list[str], repeats: int, heads: Heads) -> list[dict]:
    results = []
    for seq_len in seqs:
        q, k, v, dout = _inputs(batch, seq_len, heads)
        doc_ids = packed_doc_ids(batch, seq_len).cuda()
        row = {
            "seq_len": seq_len,
            "batch": batch,
            "documents_per_row": float(doc_ids.max(dim=1).values.float().mean() + 1),
            "ideal": ideal_speedup(doc_ids.cpu()),
        }
        for backend in backends:
            try:
                one = time_backend(backend, q, k, v, dout, None, repeats)
                packed = time_backend(backend, q, k, v, dout, doc_ids, repeats)
            except (RuntimeError, ImportError, torch.OutOfMemoryError) as error:
                row[backend] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
                torch.cuda.empty_cache()
                continue
            row[backend] = {"one_document_ms": one, "packed_ms": packed, "speedup": one / packed}
        if "flex" in backends and "error" not in row.get("flex", {}):
            row["flex"]["mask_ms"] = time_flex_mask(doc_ids, batch, seq_len, repeats)
        results.append(row)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return results


def _table(results: list[dict], backends: list[str]) -> list[str]:
    lines = [
        f"{'seq':>7}{'docs':>6}{'ideal':>7}  "
        + "".join(f"{b + ' 1 doc / packed ms (x)':>34}" for b in backends)
    ]
    for row in results:
        cells = []
        for backend in backends:
            r = row.get(backend, {})
            if "error" in r:
                cells.append(f"{'failed':>34}")
            else:
                cells.append(f"{r['one_document_ms']:>14.3f} / {r['packed_ms']:>8.3f} ({r['speedup']:.2f}x)")
        lines.append(
            f"{row['seq_len']:>7}{row['documents_per_row']:>6.1f}{row['ideal']:>6.1f}x  " + "".join(cells)
        )
        if "flex" in row and "mask_ms" in row["flex"]:
            lines.append(f"{'':>22}flex block mask: {row['flex']['mask_ms']:.3f} ms per micro-batch")
    fastest = []
    for row in results:
        times = {b: row[b]["packed_ms"] for b in backends if "packed_ms" in row.get(b, {})}
        if times:
            fastest.append(f"{row['seq_len']}: {min(times, key=times.get)}")
    lines.append("fastest on packed rows: " + ", ".join(fastest))
    return lines


def sweep(seq_len: int, batch: int, repeats: int, heads: Heads) -> dict:
    """Each kernel's median ms on packed rows at every tile size in SWEEP, the others at their
    defaults: the forward alone, and the backward alone after one forward."""
    q, k, v, dout = _inputs(batch, seq_len, heads)
    doc_ids = packed_doc_ids(batch, seq_len).cuda()
    default = attention_module._block_config
    base = default(max(16, triton.next_power_of_2(heads.dim)), torch.bfloat16, True)
    timings: dict = {}
    try:
        for kind, candidates in SWEEP.items():
            timings[kind] = {}
            for candidate in candidates:
                config = {**base, kind: candidate}
                attention_module._block_config = lambda *_, config=config: config
                try:
                    if kind == "fwd":
                        ms = measure(
                            lambda: attention(q, k, v, doc_ids), "cuda", repeats=repeats, warmup=2
                        ).median_ms
                    else:
                        out = attention(q, k, v, doc_ids)
                        ms = measure(
                            lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                            "cuda",
                            repeats=repeats,
                            warmup=2,
                        ).median_ms
                except (OutOfResources, RuntimeError) as error:  # a tile too large for shared memory
                    timings[kind][str(candidate)] = f"{type(error).__name__}"
                    continue
                timings[kind][str(candidate)] = ms
    finally:
        attention_module._block_config = default
    return {"seq_len": seq_len, "batch": batch, "default": {k: str(v) for k, v in base.items()}, **timings}


def _sweep_table(result: dict) -> list[str]:
    lines = [f"tile sweep, packed rows {result['batch']} x {result['seq_len']}:"]
    for kind in SWEEP:
        times = {c: t for c, t in result[kind].items() if isinstance(t, float)}
        ranked = sorted(times, key=times.get)
        default = result["default"][kind]
        lines.append(
            f"  {kind:<5} default {default} {times.get(default, float('nan')):.3f} ms; best "
            + ", ".join(f"{c} {times[c]:.3f}" for c in ranked[:3])
        )
        failed = [c for c, t in result[kind].items() if not isinstance(t, float)]
        if failed:
            lines.append(f"        did not launch: {', '.join(failed)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2.5-7b", choices=sorted(MODELS))
    parser.add_argument("--seqs", default="2048,4096,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backends", default="triton,sdpa,flex")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time our kernel's tile sizes instead")
    add_json_option(parser)
    args = parser.parse_args()
    heads = family_heads(args.family)
    seqs = [int(s) for s in args.seqs.split(",")]
    where = (
        f"{heads.query}/{heads.kv} heads of {heads.dim} ({args.family}), bf16, {torch.cuda.get_device_name()}"
    )
    if args.sweep:
        results = [sweep(seq_len, args.batch, args.repeats, heads) for seq_len in seqs]
        print(where)
        for result in results:
            print("\n".join(_sweep_table(result)))
        write_json(args.json, "benchmarks.packed_attention --sweep", results)
        return
    backends = args.backends.split(",")
    results = run(seqs, args.batch, backends, args.repeats, heads)
    print(f"forward + backward, batch {args.batch}, {where}")
    print("\n".join(_table(results, backends)))
    write_json(args.json, "benchmarks.packed_attention", results)


if __name__ == "__main__":
    main()
