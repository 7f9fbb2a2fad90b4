"""Decoding speed of the usual QLoRA inference stacks, the baselines for `qlora generate`.

Usage: python -m benchmarks.generate_baselines hf|unsloth MODEL_DIR [--adapter DIR] [--batch 1]
       [--prompt-len 128] [--new-tokens 256] [--json FILE]

Both load MODEL_DIR (benchmarks/random_checkpoint.py writes one) in NF4 with double quantization
and bf16 compute, put a LoRA adapter on it (the one in --adapter, else r 16 on every
projection the model has, with random nonzero B, so LoRA really computes) and decode greedily from random
prompt ids, exactly `--new-tokens` per row (min_new_tokens = max_new_tokens):
  - `hf`: transformers + bitsandbytes (BitsAndBytesConfig nf4) + PEFT, SDPA attention;
  - `unsloth`: FastLanguageModel.from_pretrained(load_in_4bit=True) + get_peft_model, then
    FastLanguageModel.for_inference, Unsloth's own decoding path.
Run each in its own process: Unsloth patches transformers and must be imported before it.

One untimed warm-up generate, then, each between torch.cuda.synchronize calls: a generate of one
new token (time to first token: the prefill) and a generate of all new tokens. Reports
decode_tokens_per_s = batch * new_tokens / that generate's time (prefill included, as a user
waits for it), decode_only_tokens_per_s = batch * (new_tokens - 1) / (generate - first token),
ttft_s, and the peak GPU memory allocated over the warm-up and both timed generates.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.bnb import load_nf4_model
from benchmarks.output import add_json_option, write_json
from qlora_cli.core.names import ALL_PROJECTIONS

# Every projection name qlora trains; PEFT puts LoRA on those the model has (Qwen3.5's linear-attention
# layers have in_proj_qkv/z/b/a and out_proj instead of q/k/v/o).
LORA_TARGETS = list(ALL_PROJECTIONS)
LORA_RANK = 16
LORA_ALPHA = 32
WARMUP_TOKENS = 16


def randomize_lora_b(model: torch.nn.Module, seed: int = 0) -> int:
    """PEFT starts B at zero (LoRA adds nothing); give every B small random values so the adapter
    computes as a trained one does. Returns how many B matrices it filled."""
    generator = torch.Generator().manual_seed(seed)
    filled = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                values = torch.randn(param.shape, generator=generator) * 0.01
                param.copy_(values.to(device=param.device, dtype=param.dtype))
                filled += 1
    return filled


def random_prompts(vocab_size: int, batch: int, prompt_len: int, device: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, prompt_len), generator=generator).to(device)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_generation(model, batch: int, prompt_len: int, new_tokens: int, device: str = "cuda") -> dict:
    """Warm-up, time to first token and full greedy generate of `new_tokens` per row (see module doc)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time decoding, got {new_tokens}")
    ids = random_prompts(model.config.vocab_size, batch, prompt_len, device)
    mask = torch.ones_like(ids)

    def generate(tokens: int) -> torch.Tensor:
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            min_new_tokens=tokens,
            max_new_tokens=tokens,
            pad_token_id=0,
            use_cache=True,
        )

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        generate(min(new_tokens, WARMUP_TOKENS))
        _sync(device)
        start = time.perf_counter()
        generate(1)
        _sync(device)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = generate(new_tokens)
        _sync(device)
        seconds = time.perf_counter() - start
    generated = out.shape[1] - prompt_len
    if generated != new_tokens:
        raise RuntimeError(f"generate produced {generated} tokens per row, asked for {new_tokens}")
    return {
        "decode_tokens_per_s": batch * new_tokens / seconds,
        "decode_only_tokens_per_s": batch * (new_tokens - 1) / max(seconds - ttft, 1e-9),
        "generate_s": seconds,
        "ttft_s": ttft,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )


def attach_lora(model, adapter_dir: Path | None):
    """PEFT's LoRA on `model`: the saved adapter, or a fresh r 16 one with random B."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir)), f"adapter {adapter_dir.name}"
    model = get_peft_model(model, _lora_config())
    filled = randomize_lora_b(model)
    return model, f"random LoRA r{LORA_RANK} on every projection ({filled} B matrices)"


def hf_peft_bnb_decode(
    model_dir: Path,
    adapter_dir: Path | None,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    device: str = "cuda",
) -> dict:
    """transformers + bitsandbytes NF4 (double quant, bf16 compute) + PEFT LoRA, greedy decode."""
    import bitsandbytes
    import peft
    import transformers

    model = load_nf4_model(model_dir, device)
    model, lora = attach_lora(model, adapter_dir)
    model.eval()
    result = time_generation(model, batch, prompt_len, new_tokens, device)
    versions = f"transformers {transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}"
    return result | {"note": f"HF+PEFT+bnb ({versions}), SDPA, {lora}"}


def unsloth_decode(
    model_dir: Path, adapter_dir: Path | None, batch: int, prompt_len: int, new_tokens: int
) -> dict:
    """Unsloth's 4-bit model + LoRA, switched to its inference path, greedy decode."""
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import unsloth
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(model_dir),
        max_seq_length=prompt_len + new_tokens,
        load_in_4bit=True,
        dtype=torch.bfloat16,
    )
    if adapter_dir is not None:
        model, lora = attach_lora(model, adapter_dir)
    else:
        model = FastLanguageModel.get_peft_model(
            model,
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0,
            target_modules=LORA_TARGETS,
            use_gradient_checkpointing=False,
            random_state=0,
        )
        filled = randomize_lora_b(model)
        lora = f"random LoRA r{LORA_RANK} on every projection ({filled} B matrices)"
    FastLanguageModel.for_inference(model)
    result = time_generation(model, batch, prompt_len, new_tokens, "cuda")
    return result | {"note": f"Unsloth {unsloth.__version__}, for_inference, {lora}"}


BASELINES = {"hf": hf_peft_bnb_decode, "unsloth": unsloth_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", choices=sorted(BASELINES))
    parser.add_argument("model_dir", type=Path)
    parser.add_argument(
        "--adapter", type=Path, default=None, help="a PEFT adapter folder (default: random LoRA)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    result = BASELINES[args.baseline](
        args.model_dir, args.adapter, args.batch, args.prompt_len, args.new_tokens
    )
    print("RESULT " + json.dumps(result), flush=True)
    write_json(args.json, "benchmarks.generate_baselines", {args.baseline: result})


if __name__ == "__main__":
    main()
