"""Time streaming a checkpoint from disk and quantizing it to NF4 on the GPU, tensor by tensor.

Usage: python benchmarks/load.py CHECKPOINT_DIR   (benchmarks/random_checkpoint.py writes one)
"""

from __future__ import annotations

import argparse
import time

import torch

from qlora_cli.model import LoRAConfig, QLoRAModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    torch.cuda.init()
    start = time.perf_counter()
    model = QLoRAModel.from_pretrained(args.checkpoint, quantize=True, lora=LoRAConfig(r=16), device="cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    spec = model.spec
    params = sum(o * i for o, i in spec.projection_shapes().values()) * spec.num_layers
    print(
        f"loaded and quantized {spec.num_layers} layers ({params / 1e9:.2f} B projection weights) in {seconds:.1f} s; "
        f"GPU memory {torch.cuda.memory_allocated() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
