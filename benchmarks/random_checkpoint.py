"""Write a random-weight checkpoint of a benchmark shape, sharded like the hub's, for benchmarks and GPU runs.

Usage: python -m benchmarks.random_checkpoint SHAPE OUT_DIR [--layers N] [--device cuda]
SHAPE: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b, qwen3.5-9b, qwen3.5-27b, llama-3.1-8b,
mistral-7b, mistral-small-24b
(benchmarks/shapes.py). Every tensor the shape's ModelSpec expects, under the names transformers
loads: a Qwen3.5's Gated DeltaNet layers get A_log = log(U(0.01, 16)) and dt_bias = 1 as transformers
initialises them; norms scale near 1 (a zero-centred norm's weight is near 0, it scales by 1 + w).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.shapes import MODELS, model_config
from qlora_cli.sources.model_config import spec_from_config

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "configs" / "demo" / "tiny-qwen3"
SHARD_BYTES = 4 << 30


def write_checkpoint(
    name: str, out: Path, *, layers: int | None = None, device: str = "cpu", seed: int = 0
) -> Path:
    return write_config_checkpoint(model_config(name, layers), out, device=device, seed=seed)


def random_tensors(spec, *, device: str = "cpu", seed: int = 0):
    """(name, bf16 tensor on `device`) for every tensor the spec expects, drawn as the checkpoints are."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for tensor_name, shape in spec.expected_tensors().items():
        if tensor_name.endswith("norm.weight"):
            # Qwen3.5's zero-centred norms scale by 1 + w; its gated norm, like every other family's, by w.
            centre = 0.0 if spec.zero_centred_norms and "linear_attn" not in tensor_name else 1.0
            tensor = centre + 0.1 * torch.randn(shape, generator=generator, device=device)
        elif tensor_name.endswith("A_log"):
            tensor = torch.empty(shape, device=device).uniform_(0.01, 16, generator=generator).log()
        elif tensor_name.endswith("dt_bias"):
            tensor = torch.ones(shape, device=device)
        else:
            tensor = torch.randn(shape, generator=generator, device=device) * (0.5 / shape[-1] ** 0.5)
        yield tensor_name, tensor.to(torch.bfloat16)


def write_config_checkpoint(config: dict, out: Path, *, device: str = "cpu", seed: int = 0) -> Path:
    """Random weights for any config.json qlora reads (a benchmark shape, or one a test edits)."""
    spec = spec_from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / file, out / file)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensor_name, tensor in random_tensors(spec, device=device, seed=seed):
        tensor = tensor.cpu()
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
    parser.add_argument("shape", choices=sorted(MODELS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(write_checkpoint(args.shape, args.out, layers=args.layers, device=args.device))


if __name__ == "__main__":
    main()
