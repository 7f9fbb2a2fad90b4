"""Decoding speed of `qlora generate` against HF + PEFT + bitsandbytes and Unsloth, same GPU, same run.

Usage: python -m benchmarks.generate [MODEL_DIR] [--shape qwen2.5-7b] [--layers N] [--batches 1,16]
       [--prompt-len 128] [--new-tokens 256] [--ttft-prompt-len 2048] [--runners qlora,hf,unsloth]
       [--json FILE]

Without MODEL_DIR a random checkpoint of --shape (benchmarks/shapes.py: Qwen2.5, Qwen3.5, Llama,
Mistral; benchmarks/random_checkpoint.py; --layers shortens it, a multiple of 4 keeps Qwen3.5's mix of
Gated DeltaNet and attention layers) is written to a temporary folder. Every runner puts LoRA r 16 on
every projection the model has with random nonzero B on the NF4 base (double quantization, bf16 compute) and decodes exactly
--new-tokens per row, greedily, from random prompt ids, timed as benchmarks/generate_baselines.py
times its stacks: one untimed warm-up, a generate of one token (time to first token), a generate of
all tokens; decode_tokens_per_s = batch * new_tokens / that generate's time (prefill included).
qlora runs in this process (KV cache and Gated DeltaNet states, nf4_matvec steps replayed as a CUDA
graph); each baseline in a subprocess of its own (HF's Qwen3.5 runs transformers' torch fallback
where flash-linear-attention is not installed; Unsloth may not load every shape, and then reports
its error). Cases: each --batches value at --prompt-len, and batch 1 at
--ttft-prompt-len for the time to first token of a long prompt. Prints each result and the ratios
(targets: batch 1 at least 5x HF+PEFT+bnb and 2x Unsloth; TTFT no more than HF's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.generate_baselines import LORA_ALPHA, LORA_RANK, WARMUP_TOKENS, random_prompts
from benchmarks.output import add_json_option, write_json
from benchmarks.random_checkpoint import write_checkpoint
from benchmarks.shapes import MODELS
from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.generate.sampling import Sampling, generate_ids
from qlora_cli.model import LoRAConfig, QLoRAModel

LABELS = {"qlora": "qlora", "hf": "HF+PEFT+bnb", "unsloth": "Unsloth"}


def qlora_model(model_dir: Path, device: str = "cuda") -> QLoRAModel:
    """The NF4 base with r 16 LoRA on every projection, B random and nonzero as the baselines set it."""
    lora = LoRAConfig(r=LORA_RANK, alpha=LORA_ALPHA)
    model = QLoRAModel.from_pretrained(model_dir, quantize=True, lora=lora, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.01 * torch.randn(param.shape, generator=generator, device=device))
    return model.eval().requires_grad_(False)


def qlora_decode(model: QLoRAModel, batch: int, prompt_len: int, new_tokens: int) -> dict:
    engine = DecodingEngine(model)
    cuda = engine.decoder.device.type == "cuda"
    prefill = "row-per-prompt" if model.spec.linear_attention else "packed"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompts = random_prompts(model.spec.vocab_size, batch, prompt_len, "cpu").tolist()

    def generate(tokens: int) -> float:
        sync()
        start = time.perf_counter()
        completions = generate_ids(engine, prompts, Sampling(max_new_tokens=tokens), set())
        sync()
        if any(len(c.ids) != tokens for c in completions):
            raise RuntimeError(f"qlora generated fewer than {tokens} tokens in a row")
        return time.perf_counter() - start

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine.prepare(
        batch, prompt_len + new_tokens
    )  # the cache and its graph, as the warm-up's call reuses them
    generate(min(new_tokens, WARMUP_TOKENS))
    ttft = generate(1)
    seconds = generate(new_tokens)
    return {
        "decode_tokens_per_s": batch * new_tokens / seconds,
        "decode_only_tokens_per_s": batch * (new_tokens - 1) / max(seconds - ttft, 1e-9),
        "generate_s": seconds,
        "ttft_s": ttft,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "note": f"qlora: {prefill} prefill on the training kernels, nf4_matvec decode steps as a CUDA graph",
    }


def baseline_decode(name: str, model_dir: Path, batch: int, prompt_len: int, new_tokens: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.generate_baselines",
        name,
        str(model_dir),
        "--batch",
        str(batch),
        "--prompt-len",
        str(prompt_len),
        "--new-tokens",
        str(new_tokens),
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1][len("RESULT ") :])


def ratios(case: dict) -> dict:
    ours = case.get("qlora", {})
    found = {}
    for name in ("hf", "unsloth"):
        other = case.get(name, {})
        if "decode_tokens_per_s" in ours and "decode_tokens_per_s" in other:
            found[f"speed_vs_{name}"] = ours["decode_tokens_per_s"] / other["decode_tokens_per_s"]
            found[f"ttft_vs_{name}"] = ours["ttft_s"] / other["ttft_s"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, nargs="?", help="a checkpoint folder (default: random)")
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ttft-prompt-len", type=int, default=2048)
    parser.add_argument("--runners", default="qlora,hf,unsloth")
    add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    runners = args.runners.split(",")
    cases = [(int(b), args.prompt_len, args.new_tokens) for b in args.batches.split(",")]
    if args.ttft_prompt_len:
        cases.append((1, args.ttft_prompt_len, min(args.new_tokens, 32)))
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir or write_checkpoint(
            args.shape, Path(scratch) / args.shape, layers=args.layers, device="cuda"
        )
        results = [{"batch": b, "prompt_len": p, "new_tokens": n} for b, p, n in cases]
        if "qlora" in runners:
            model = qlora_model(model_dir)
            for case in results:
                case["qlora"] = qlora_decode(model, case["batch"], case["prompt_len"], case["new_tokens"])
                print(f"qlora {case['batch']}x{case['prompt_len']}: {json.dumps(case['qlora'])}", flush=True)
            del model
            torch.cuda.empty_cache()
        for name in (r for r in runners if r != "qlora"):
            for case in results:
                case[name] = baseline_decode(
                    name, model_dir, case["batch"], case["prompt_len"], case["new_tokens"]
                )
                print(
                    f"{LABELS[name]} {case['batch']}x{case['prompt_len']}: {json.dumps(case[name])}",
                    flush=True,
                )
    for case in results:
        case["ratios"] = ratios(case)
        cells = [
            f"{LABELS[name]} {case[name]['decode_tokens_per_s']:.1f} tok/s, TTFT {case[name]['ttft_s'] * 1000:.1f} ms"
            for name in runners
            if "decode_tokens_per_s" in case.get(name, {})
        ]
        shown = ", ".join(f"{key} {value:.2f}x" for key, value in case["ratios"].items())
        print(f"batch {case['batch']} x prompt {case['prompt_len']}: {'; '.join(cells)}; {shown}")
    write_json(args.json, "benchmarks.generate", results)


if __name__ == "__main__":
    main()
