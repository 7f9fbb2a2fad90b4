"""qlora against HF transformers + PEFT + bitsandbytes (with and without Liger kernels) and Unsloth, same GPU, same run.

Usage: python -m benchmarks.compare CHECKPOINT|random:SHAPE[:LAYERS] [--batch 4] [--seq 2048] [--steps 5] [--warmup 2]
       [--runners qlora,qlora-eager,qlora-fp8,hf,liger,unsloth] [--checkpointing true|false|auto] [--budget-gb 60]
       [--offload auto|true|false] [--memory-cap-gb 80] [--lora-dropout 0.05] [--packed 512] [--kernels 25]
       [--json FILE]

Each runner trains LoRA r=16 on every decoder linear but a MoE's routed experts (each prints how many weights
it trains) of the same checkpoint (benchmarks/random_checkpoint.py writes one of any shape in
benchmarks/shapes.py: Qwen2.5, Qwen3.5, Qwen3.5 MoE, Qwen3 MoE, Llama 3.1, Mistral Small; `random:SHAPE`
has qlora's runners draw that shape's weights on the GPU instead, for shapes too large to write), on the same
random batch, in its own process so peak memory is its own. For Qwen3.5 every linear is q/k/v/o, the MLP's,
and the Gated DeltaNet layers' in_proj_qkv/z/b/a and out_proj; HF runs transformers' torch fallback of
the delta rule and conv (without flash-linear-attention installed), Unsloth its own Qwen3.5 patching. `qlora` replays
each step's forward and backward as a CUDA graph, as `qlora train` does with packed rows; `qlora-eager`
launches op by op; `qlora-fp8` multiplies the frozen NF4 projections in FP8 (config key fp8). `unsloth` is Unsloth with the settings its documentation recommends (4-bit
base, `use_gradient_checkpointing="unsloth"`, which offloads each layer's input to host memory).
Prints tokens/s, peak GPU memory allocated (warm-up included, where a graph is captured) and
reserved, MFU and the ratios against HF+PEFT+bnb and Unsloth. `--memory-cap-gb` caps every runner's
GPU memory (torch.cuda.set_per_process_memory_fraction), to show what trains inside a smaller GPU.
`--lora-dropout` gives qlora's runners LoRA dropout (a new mask seed each step), to time what it costs.
`--packed N` packs qlora's rows with documents of N tokens (document masks in attention and state
resets in the delta rule, as `sample_packing` trains); the other runners take no document ids and
run the same rows as one document each.
Each step is timed on its own (CUDA events, qlora_cli/profiler/timing.py); tokens/s comes from the
median step, and --json keeps the fastest step too. `--kernels N` profiles one more step of each runner
and prints its N longest GPU kernels, summed by name: where each runner's step goes, in the same call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks.bnb import load_nf4_model
from benchmarks.kernel_table import kernel_lines, kernel_ms
from benchmarks.output import add_json_option, write_json
from benchmarks.random_checkpoint import random_tensors
from benchmarks.shapes import model_config
from qlora_cli.profiler.timing import measure
from qlora_cli.sources.model_config import read_spec, spec_from_config
from qlora_cli.sources.spec import FULL_ATTENTION, LINEAR_ATTENTION

# Liger's patch for each model_type (Qwen3.5 has none: the liger runner fails with that name).
LIGER_PATCH = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "mistral": "mistral"}

RANDOM_BASE = "random:"
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16; MFU is reported against it


def model_flops_per_token(config: dict, seq: int) -> float:
    """Forward (2N) plus the input-gradient half of backward (2N), plus causal attention in the full
    attention layers and the delta rule in Qwen3.5's Gated DeltaNet layers, three times their forward
    each; LoRA is negligible. The delta rule counts as its recurrence: three rank-1 products of
    Dk x Dv a value head and token (its chunked form does about as much)."""
    spec = spec_from_config(config)
    dense = sum(out * inp for kind in spec.layer_types for out, inp in spec.projection_shapes(kind).values())
    full = spec.layer_types.count(FULL_ATTENTION)
    attention = 3 * 2 * 2 * full * spec.num_heads * spec.head_dim * seq / 2
    delta_rule = 0.0
    if spec.linear_attention is not None:
        linear = spec.linear_attention
        per_layer = 6 * linear.num_value_heads * linear.key_head_dim * linear.value_head_dim
        delta_rule = 3 * per_layer * spec.layer_types.count(LINEAR_ATTENTION)
    return 4 * (dense + spec.vocab_size * spec.hidden_size) + attention + delta_rule


def base_config(checkpoint) -> dict:
    """The checkpoint folder's config.json, or for `random:SHAPE[:LAYERS]` a benchmark shape's
    (benchmarks/shapes.py), whose random weights qlora's runners draw on the GPU: nothing is written,
    where the 27B alone would be 54 GB of bf16 on disk."""
    checkpoint = str(checkpoint)
    if checkpoint.startswith(RANDOM_BASE):
        name, _, layers = checkpoint[len(RANDOM_BASE) :].partition(":")
        return model_config(name, int(layers) if layers else None)
    with open(f"{checkpoint}/config.json") as f:
        return json.load(f)


# A MoE layer's routed experts, as PEFT matches module names.
ROUTED_EXPERTS = r".*\.mlp\.experts(\..*)?"


def lora_targets(checkpoint) -> list[str]:
    """Every decoder linear of the checkpoint's layers, as PEFT and Unsloth name them."""
    spec = spec_from_config(base_config(checkpoint))
    return sorted({name for kind in spec.layer_types for name in spec.projection_shapes(kind)})


def _needs_folder(args, runner: str) -> None:
    if args.checkpoint.startswith(RANDOM_BASE):
        raise SystemExit(
            f"{runner} loads a checkpoint folder; {args.checkpoint} is drawn by qlora's runners only"
        )


def _batch(vocab: int, args):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator)
    return ids.to(args.device), ids.roll(-1, dims=1).to(args.device)


def _packing(args) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Positions and document ids of rows packed with documents of args.packed tokens (None, None
    unpacked): what `qlora train` hands the model for sample_packing."""
    if not args.packed:
        return None, None
    tokens = torch.arange(args.seq, device=args.device).expand(args.batch, args.seq)
    return tokens % args.packed, tokens // args.packed


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_qlora(args, graphs: bool, fp8: bool = False) -> dict:
    from qlora_cli.model import LoRAConfig, QLoRAModel
    from qlora_cli.model.planner import (
        RunShape,
        estimated_peak_bytes,
        layers_to_checkpoint,
        offloads_activations,
    )
    from qlora_cli.train.graphs import GraphedLoss
    from qlora_cli.train.step import clear_gradients, micro_batch_backward

    spec = spec_from_config(base_config(args.checkpoint))
    setting = {"true": True, "false": False, "auto": "auto"}[args.checkpointing]
    offload_setting = {"true": True, "false": False, "auto": "auto"}[args.offload]
    lora = LoRAConfig(
        r=16, alpha=32, dropout=args.lora_dropout, target_modules=tuple(lora_targets(args.checkpoint))
    )
    shape = RunShape(args.batch * args.seq, lora, args.budget_gb)
    offload = offloads_activations(offload_setting, setting, spec, shape, args.device)
    recompute = layers_to_checkpoint(setting, spec, shape, offload=offload)
    start = time.perf_counter()
    placement = dict(lora=lora, checkpoint_layers=recompute, offload_activations=offload)
    if args.checkpoint.startswith(RANDOM_BASE):
        model = QLoRAModel.on_device(spec, device=args.device, **placement)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model.load_base(random_tensors(spec, device=args.device), quantize=True, dtype=dtype)
    else:
        model = QLoRAModel.from_pretrained(args.checkpoint, device=args.device, **placement)
    model.train()
    if fp8:
        model.use_fp8()
    _sync(args.device)
    load_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-5, fused=args.device == "cuda")
    ids, labels = _batch(spec.vocab_size, args)
    position_ids, doc_ids = _packing(args)
    count = labels.numel()
    # As cuda_graphs auto trains: op by op after a capture that runs out of memory (said in the result).
    graphed = (
        GraphedLoss(model.loss, torch.device(args.device), spec.vocab_size, eager_when_out_of_memory=True)
        if graphs
        else None
    )

    steps = iter(range(1 << 62))

    def step():
        model.set_dropout_seed(next(steps))
        loss_sum = micro_batch_backward(model.loss, (ids, labels, position_ids, doc_ids), 1 / count, graphed)
        optimizer.step()
        clear_gradients(optimizer, graphed)
        return loss_sum / count

    estimate = estimated_peak_bytes(spec, shape, recompute, offload=offload) / 2**30
    return _timed(step, args) | {
        "load_s": load_s,
        "trained_weights": sum(p.numel() for p in model.trainable_parameters()),
        "recomputed_layers": recompute,
        "offloaded": offload,
        "estimated_peak_gib": estimate,
        "graphs_fell_back": graphed is not None and graphed.eager_only,
    }


def run_hf(args, liger: bool) -> dict:
    _needs_folder(args, "HF+PEFT+bnb")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if liger:
        import liger_kernel.transformers

        model_type = read_spec(args.checkpoint).model_type
        patch = LIGER_PATCH.get(model_type)
        if patch is None:
            raise SystemExit(f"Liger has no patch for model_type {model_type}")
        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{patch}")()
    start = time.perf_counter()
    model = load_nf4_model(args.checkpoint, args.device)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing != "false")
    # That call casts embeddings, norms and biases to fp32; trainers (Axolotl among them) cast them back,
    # so the baseline computes in bf16 as users run it.
    for param in model.parameters():
        if param.dtype == torch.float32 and type(param).__name__ != "Params4bit":
            param.data = param.data.to(torch.bfloat16)
    targets = lora_targets(args.checkpoint)
    # qlora's routed experts take no LoRA: PEFT is kept off transformers' fused experts, which it would
    # otherwise adapt under the MLP's names, so both train the same targets.
    experts = ROUTED_EXPERTS if read_spec(args.checkpoint).moe else None
    model = get_peft_model(
        model,
        LoraConfig(
            r=16, lora_alpha=32, target_modules=targets, exclude_modules=experts, task_type="CAUSAL_LM"
        ),
    )
    return _train_transformers_model(model, args, start)


def run_unsloth(args) -> dict:
    _needs_folder(args, "Unsloth")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from unsloth import FastLanguageModel

    start = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(
        model_name=args.checkpoint, max_seq_length=args.seq, load_in_4bit=True, dtype=torch.bfloat16
    )
    targets = lora_targets(args.checkpoint)
    checkpointing = {"true": "unsloth", "false": False, "auto": "unsloth"}[args.checkpointing]
    # On a MoE Unsloth adds LoRA on the routed experts' fused tensors unless target_parameters is
    # given (94M weights against qlora's 2.1M on the 35B-A3B cut to 4 layers): none, as qlora trains.
    experts = {"target_parameters": []} if read_spec(args.checkpoint).moe else {}
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=0,
        target_modules=targets,
        use_gradient_checkpointing=checkpointing,
        random_state=0,
        **experts,
    )
    return _train_transformers_model(model, args, start)


def _train_transformers_model(model, args, start: float) -> dict:
    """The timed steps of a transformers model with LoRA (PEFT's or Unsloth's), loaded since `start`."""
    model.train()
    _sync(args.device)
    load_s = time.perf_counter() - start
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=args.device == "cuda")
    ids, _ = _batch(model.config.vocab_size, args)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return _timed(step, args) | {"load_s": load_s, "trained_weights": sum(p.numel() for p in trainable)}


def _timed(step, args) -> dict:
    """The peak covers the warm-up too: a CUDA graph takes its memory when it is captured there.
    With --kernels one more step is profiled after the timed ones, outside the timing."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    timing = measure(lambda: losses.append(step()), args.device, repeats=args.steps, warmup=args.warmup)
    seconds = timing.median_ms / 1e3
    kernels = {"kernels_ms": kernel_ms(step, repeats=1)} if args.kernels and args.device == "cuda" else {}
    return kernels | {
        "step_s": seconds,
        "step_ms_min": timing.min_ms,
        "tokens_per_s": args.batch * args.seq / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else 0.0,
        "loss": float(losses[-1].detach()),
    }


RUNNERS = {
    "qlora": lambda a: run_qlora(a, graphs=a.device == "cuda"),
    "qlora-eager": lambda a: run_qlora(a, graphs=False),
    "qlora-fp8": lambda a: run_qlora(a, graphs=a.device == "cuda", fp8=True),
    "hf": lambda a: run_hf(a, liger=False),
    "liger": lambda a: run_hf(a, liger=True),
    "unsloth": run_unsloth,
}
LABELS = {
    "qlora": "qlora",
    "qlora-eager": "qlora, no graphs",
    "qlora-fp8": "qlora, fp8",
    "hf": "HF+PEFT+bnb",
    "liger": "HF+PEFT+bnb+Liger",
    "unsloth": "Unsloth",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runners", default="qlora,qlora-eager,hf,liger")
    parser.add_argument("--checkpointing", choices=["true", "false", "auto"], default="true")
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="memory budget for --checkpointing auto"
    )
    parser.add_argument(
        "--offload", choices=["true", "false", "auto"], default="auto", help="qlora's activation_offloading"
    )
    parser.add_argument("--memory-cap-gb", type=float, default=None, help="cap each runner's GPU memory")
    parser.add_argument("--device", default="cuda", help="cpu only to check the runners work")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="qlora runners' LoRA dropout")
    parser.add_argument(
        "--packed",
        type=int,
        default=0,
        help="qlora runners' rows packed with documents of this many tokens (the others' stay one document)",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also print each runner's N longest GPU kernels in one more step (torch's profiler)",
    )
    parser.add_argument("--worker", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.checkpointing == "auto" and args.budget_gb is None:
        parser.error("--checkpointing auto needs --budget-gb")
    if args.worker:
        if args.worker.startswith("qlora"):
            from qlora_cli.core.allocator import prefer_expandable_segments

            prefer_expandable_segments()
        if args.memory_cap_gb and args.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 2**30 / total))
        print("RESULT " + json.dumps(RUNNERS[args.worker](args)), flush=True)
        return
    config = base_config(args.checkpoint)
    flops = model_flops_per_token(config, args.seq)
    results = {}
    for name in args.runners.split(","):
        command = [sys.executable, "-m", "benchmarks.compare", *sys.argv[1:], "--worker", name]
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{LABELS[name]}: failed\n{proc.stderr[-3000:]}")
            continue
        results[name] = json.loads(lines[-1][len("RESULT ") :])
        print(f"{LABELS[name]}: {json.dumps(results[name])}", flush=True)
    base = results.get("hf", {}).get("tokens_per_s")
    anchor = results.get("unsloth", {})
    print(
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {args.batch} x {args.seq} tokens, "
        f"gradient checkpointing {args.checkpointing}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
    )
    print(
        f"{'runner':<20}{'tok/s':>10}{'peak GiB':>10}{'reserved':>10}{'MFU':>8}{'vs HF':>8}"
        f"{'vs Unsloth':>11}{'memory':>8}{'load s':>8}{'loss':>8}"
    )
    for name, r in results.items():
        mfu = r["tokens_per_s"] * flops / (DATASHEET_BF16_TFLOPS * 1e12)
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        speed = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else "-"
        memory = f"{r['peak_gib'] / anchor['peak_gib']:.2f}x" if anchor else "-"
        print(
            f"{LABELS[name]:<20}{r['tokens_per_s']:>10,.0f}{r['peak_gib']:>10.2f}{r['reserved_gib']:>10.2f}"
            f"{mfu:>8.1%}{ratio:>8}{speed:>11}{memory:>8}"
            f"{r['load_s']:>8.1f}{r['loss']:>8.3f}"
        )
        if "estimated_peak_gib" in r:
            print(f"{'':<20}planner's estimate of the peak: {r['estimated_peak_gib']:.2f} GiB")
        if r.get("graphs_fell_back"):
            print(f"{'':<20}its CUDA graph's capture ran out of memory: the timed steps ran op by op")
    trained = {LABELS[name]: r["trained_weights"] for name, r in results.items() if "trained_weights" in r}
    if len(set(trained.values())) > 1:
        counts = ", ".join(f"{label} {count:,}" for label, count in trained.items())
        print(f"the runners train different LoRA weights ({counts}): their speeds do not compare")
    for name, r in results.items():
        if r.get("kernels_ms"):
            print(f"{LABELS[name]}, one step")
            print("\n".join(kernel_lines(r["kernels_ms"], top=args.kernels)))
    print("JSON " + json.dumps(results))
    write_json(args.json, "benchmarks.compare", results, args.device)


if __name__ == "__main__":
    main()
