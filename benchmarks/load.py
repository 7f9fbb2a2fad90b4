"""Time streaming a checkpoint from disk and quantizing it to NF4 on the GPU, tensor by tensor.

Usage: python -m benchmarks.load CHECKPOINT_DIR [--json FILE]   (benchmarks/random_checkpoint.py writes one)

One load, timed on the GPU's stream with CUDA events (qlora_cli/profiler/timing.py) from before the
first tensor is read to the end of the last quantization.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.output import add_json_option, write_json
from qlora_cli.model import LoRAConfig, QLoRAModel
from qlora_cli.profiler.timing import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    add_json_option(parser)
    args = parser.parse_args()
    torch.cuda.init()
    loaded = []

    def load():
        loaded.append(
            QLoRAModel.from_pretrained(args.checkpoint, quantize=True, lora=LoRAConfig(r=16), device="cuda")
        )

    seconds = measure(load, "cuda", repeats=1, warmup=0).median_ms / 1e3
    spec = loaded[0].spec
    params = sum(o * i for o, i in spec.projection_shapes().values()) * spec.num_layers
    memory_gib = torch.cuda.memory_allocated() / 2**30
    print(
        f"loaded and quantized {spec.num_layers} layers ({params / 1e9:.2f} B projection weights) in {seconds:.1f} s; "
        f"GPU memory {memory_gib:.2f} GiB"
    )
    result = {
        "layers": spec.num_layers,
        "projection_weights": params,
        "seconds": seconds,
        "memory_gib": memory_gib,
    }
    write_json(args.json, "benchmarks.load", result)


if __name__ == "__main__":
    main()
