"""Write a random-weight checkpoint of a Qwen2.5 shape, sharded like the hub's, for benchmarks and GPU runs.

Usage: python -m benchmarks.random_checkpoint qwen2.5-0.5b OUT_DIR [--layers N] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.shapes import QWEN25, qwen25_config
from qlora_cli.sources.weights import spec_from_config

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "configs" / "demo" / "tiny-qwen3"
SHARD_BYTES = 4 << 30


def write_checkpoint(
    name: str, out: Path, *, layers: int | None = None, device: str = "cpu", seed: int = 0
) -> Path:
    overrides = {"num_hidden_layers": layers} if layers else {}
    config = qwen25_config(name, **overrides)
    spec = spec_from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / file, out / file)
    generator = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensor_name, shape in spec.expected_tensors().items():
        if tensor_name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator, device=device)
        else:
            tensor = torch.randn(shape, generator=generator, device=device) * (0.5 / shape[-1] ** 0.5)
        tensor = tensor.to(torch.bfloat16).cpu()
        if size + tensor.numel() * 2 > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][tensor_name] = tensor
        size += tensor.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(QWEN25))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(write_checkpoint(args.shape, args.out, layers=args.layers, device=args.device))


if __name__ == "__main__":
    main()
