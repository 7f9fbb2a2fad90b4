"""Where a training step's memory peaks, without a GPU: every tensor an op makes is counted until its
storage dies, and the peak is given in rows of hidden_size a token, beside the highest count reached
inside each qlora function.

Usage: python -m benchmarks.live_bytes SHAPE [--layers 1] [--tokens 1024] [--set KEY=JSON ...]
       [--mlp-slices 7] [--top 12]

It also lists what is alive at the peak, summed by the function that made each tensor.

SHAPE is a benchmark shape (benchmarks/shapes.py), usually scaled down with --set (hidden_size=256
...), since every op runs on the CPU with its Triton kernel interpreted, in bf16, every layer
recomputed. --mlp-slices sets the MLP's slice to a share of the row, as a long row has it on the
GPU. Only what torch allocates counts, so the split between phases (a MLP's backward, the delta
rule's) is what it says; the GPU's peak adds the allocator's rounding and cuBLAS's workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

OUR_PACKAGES = ("/qlora_cli/", "/kernels/")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops made that are still alive: now, at the peak, and the most reached
    within each of our functions (the innermost on the stack when an op allocated); `at_peak` holds
    what was alive at the peak, summed by the function that made it."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.now = self.peak = 0
        self.by_function: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place op returns an input's storage: counted already, or made before.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue
            where = _innermost_function()
            self.live[key] = storage.nbytes(), where
            self.now += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
            self.by_function[where] = max(self.by_function.get(where, 0), self.now)
            if self.now > self.peak:
                self.peak = self.now
                self.at_peak = {}
                for nbytes, maker in self.live.values():
                    self.at_peak[maker] = self.at_peak.get(maker, 0) + nbytes
        return out


def _innermost_function() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if any(package in path for package in OUR_PACKAGES) and "site-packages" not in path:
            return "/".join(path.split("/")[-2:]) + ":" + frame.f_code.co_name
        frame = frame.f_back
    return "(outside qlora)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shape")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--mlp-slices", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"

    from benchmarks.compare import lora_targets
    from benchmarks.random_checkpoint import random_tensors
    from benchmarks.shapes import model_config
    from qlora_cli.model import LoRAConfig, QLoRAModel, sliced_mlp
    from qlora_cli.sources.model_config import spec_from_config
    from qlora_cli.train.step import micro_batch_backward

    config = model_config(args.shape, args.layers)
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = json.loads(value)
    spec = spec_from_config(config)
    sliced_mlp.SLICE_BYTES = args.tokens // args.mlp_slices * 2 * spec.intermediate_size * 2
    lora = LoRAConfig(r=16, alpha=32, target_modules=tuple(lora_targets(f"random:{args.shape}")))
    model = QLoRAModel.on_device(spec, device="cpu", lora=lora, checkpoint_layers=spec.num_layers)
    model.load_base(random_tensors(spec, device="cpu"), quantize=True, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, spec.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    batch = (ids, ids.roll(-1, dims=1), torch.arange(args.tokens)[None], None)
    micro_batch_backward(model.loss, batch, 1 / args.tokens, None)
    with LiveBytes() as counter:
        micro_batch_backward(model.loss, batch, 1 / args.tokens, None)
    row = args.tokens * spec.hidden_size * 2
    print(
        f"{args.tokens} tokens, hidden {spec.hidden_size}: peak {counter.peak / row:.2f} rows of hidden_size a token"
    )
    print("the most reached inside each function:")
    for where, most in sorted(counter.by_function.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{most / row:8.2f}  {where}")
    print("alive at the peak, by the function that made it:")
    for maker, nbytes in sorted(counter.at_peak.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{nbytes / row:8.2f}  {maker}")


if __name__ == "__main__":
    main()
