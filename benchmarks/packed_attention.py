"""Attention over packed rows against rows of one document: our kernel, torch's sdpa and FlexAttention.

Usage: python -m benchmarks.packed_attention [--seqs 2048,4096,16384] [--batch 1]
       [--backends triton,sdpa,flex] [--repeats 20] [--json FILE]

Forward + backward at Qwen2.5-7B's heads (28 query heads, 4 kv heads, head_dim 128, bf16), each row
either one causal document or Alpaca-like documents packed to the row's length (lognormal token
lengths, median 330, the tail cut at the row). A document mask leaves only the pairs inside each
document: `ideal` is the speed-up that skipping the emptied key blocks could give, the causal pairs
of one document over those left. Each backend's `speed-up` is its one-document time over its packed
time, so it shows how much of that a kernel takes. FlexAttention runs compiled, with its block mask
built once per doc_ids (kernels/attention.py); `flex mask ms` is that build, which a training step
pays once per micro-batch for all its layers. sdpa on packed rows needs a materialized mask.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from benchmarks.output import add_json_option, write_json
from qlora_cli.profiler.timing import measure
from qlora_kernels import attention as attention_module
from qlora_kernels.attention import attention

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
MEDIAN_TOKENS, SIGMA = 330, 0.6


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


def _inputs(batch: int, seq_len: int):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(heads):
        return torch.randn(
            batch, seq_len, heads, HEAD_DIM, generator=generator, device="cuda", dtype=torch.bfloat16
        ).requires_grad_(True)

    q, k, v = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
    dout = torch.randn(q.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    return q, k, v, dout


def time_backend(backend: str, q, k, v, dout, doc_ids, repeats: int) -> float:
    """Median milliseconds of one forward + backward."""

    def step():
        out = attention(q, k, v, doc_ids, backend=backend)
        torch.autograd.grad(out, (q, k, v), dout)

    return measure(step, "cuda", repeats=repeats, warmup=3).median_ms


def time_flex_mask(doc_ids: torch.Tensor, batch: int, seq_len: int, repeats: int) -> float:
    def build():
        attention_module._BlockMaskCache.key = None
        attention_module._BlockMaskCache.get(doc_ids, batch, seq_len, doc_ids.device)

    return measure(build, "cuda", repeats=repeats, warmup=2).median_ms


def run(seqs: list[int], batch: int, backends: list[str], repeats: int) -> list[dict]:
    results = []
    for seq_len in seqs:
        q, k, v, dout = _inputs(batch, seq_len)
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
            except (RuntimeError, torch.OutOfMemoryError) as error:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,4096,16384")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backends", default="triton,sdpa,flex")
    parser.add_argument("--repeats", type=int, default=20)
    add_json_option(parser)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    backends = args.backends.split(",")
    results = run(seqs, args.batch, backends, args.repeats)
    print(
        f"forward + backward, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, bf16, batch {args.batch}, "
        f"{torch.cuda.get_device_name()}"
    )
    print("\n".join(_table(results, backends)))
    write_json(args.json, "benchmarks.packed_attention", results)


if __name__ == "__main__":
    main()
