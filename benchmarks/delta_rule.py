"""The gated delta rule (Qwen3.5 Gated DeltaNet) at 9B shapes: ours against flash-linear-attention and transformers.

Usage: python -m benchmarks.delta_rule [--variant columns=64,warps=8,stages=1 ...] [--kernels]
    [--before PATH] [--ours-only] [--shapes 4x2048,1x32768] [--json FILE]
Forward and forward+backward median times (CUDA events, qlora_cli/profiler/timing.py) and the
forward+backward's peak memory above its inputs, of kernels.delta_rule.gated_delta_rule, of fla's
chunk_gated_delta_rule (the fla package where it imports, its backward refusing Hopper with triton <
3.7.1; else the copy Unsloth vendors in unsloth_zoo, which runs there) and of transformers'
torch_chunk_gated_delta_rule, for B x T = 4 x 2048 and 1 x 32768 tokens, each a single document and
(ours and fla) packed with documents of 512 tokens, and ours in the passes Qwen3.5-9B's layers bound
it to (qlora_cli/model/mixers/gated_deltanet.py's delta_rule_tokens_per_pass).
Each `--variant` also times ours with some settings replaced: the scans' value columns per program
(`columns`, default kernels/delta_rule/scan.py's _block_v), `warps` and software-pipelining `stages`;
the per-chunk backward kernels' Dv and Dk blocks (`chunk_block`) and stages
(`chunk_stages`); and the warps of the chunk solve (`solve_warps`), of the W/U/Aqk tables
(`table_warps`) and of the backward's per-chunk kernels (`backward_warps`).
`--kernels` prints ours' forward and forward+backward by GPU kernel, and fla's where it imports. `--before PATH`
also times another copy of the delta rule (`git archive REV kernels/delta_rule | tar -x -C DIR`, then
DIR/kernels/delta_rule; before the package, `git show REV:kernels/delta_rule.py > FILE`), so that a
change's before and after come from one call. `--ours-only` leaves out fla and transformers, whose
import and autotuning take minutes on a fresh machine; `--shapes` times only some of the shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import qlora_kernels.delta_rule as delta_rule_module
from benchmarks.kernel_table import kernel_lines, kernel_ms
from benchmarks.output import add_json_option, write_json
from benchmarks.variants import patched, variant
from qlora_cli.profiler.timing import measure
from qlora_kernels.delta_rule import backward, common, scan, tables

K_HEADS, V_HEADS, K_DIM, V_DIM = 16, 32, 128, 128
SHAPES = [(4, 2048), (1, 32768)]
PACKED_LENGTH = 512


def shapes(text: str) -> list[tuple[int, int]]:
    """`4x2048,1x32768` as [(4, 2048), (1, 32768)]."""
    try:
        return [(int(b), int(t)) for b, t in (item.split("x") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give shapes as BxT, comma-separated") from None


def inputs(batch: int, seq: int) -> list[torch.Tensor]:
    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype).requires_grad_()

    q, k = leaf(batch, seq, K_HEADS, K_DIM), leaf(batch, seq, K_HEADS, K_DIM)
    v = leaf(batch, seq, V_HEADS, V_DIM)
    g = (-torch.nn.functional.softplus(torch.randn(batch, seq, V_HEADS, device="cuda"))).requires_grad_()
    beta = torch.rand(batch, seq, V_HEADS, device="cuda").bfloat16().requires_grad_()
    return [q, k, v, g, beta]


def ours(
    doc_ids: torch.Tensor | None, module: ModuleType = delta_rule_module, tokens_per_pass: int | None = None
) -> Callable:
    passes = {} if tokens_per_pass is None else {"tokens_per_pass": tokens_per_pass}
    return lambda q, k, v, g, beta: module.gated_delta_rule(q, k, v, g, beta, doc_ids, **passes)[0]


def model_tokens_per_pass(tokens: int) -> int:
    """The bound Qwen3.5-9B's Gated DeltaNet layers put on a pass at this many tokens."""
    from benchmarks.shapes import model_config
    from qlora_cli.model.mixers.gated_deltanet import delta_rule_tokens_per_pass
    from qlora_cli.model.mlps import DenseMLP
    from qlora_cli.sources.model_config import spec_from_config

    spec = spec_from_config(model_config("qwen3.5-9b"))
    return delta_rule_tokens_per_pass(spec, tokens, DenseMLP.backward_working_bytes)


def load_before(path: str) -> ModuleType:
    """A saved copy of the delta rule, imported beside ours under its own name: a copy of the package
    kernels/delta_rule/ (its modules import each other relatively) or of the single file it was."""
    folder = Path(path)
    name = "qlora_kernels.delta_rule_before"
    if folder.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
    else:
        spec = importlib.util.spec_from_file_location(name, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def value_columns(columns: int) -> dict:
    """The scans with `columns` value columns per program."""
    return {(scan, "_block_v"): lambda v_dim: min(columns, common._block(v_dim))}


VARIANT_KEYS = {
    "columns": value_columns,
    "warps": lambda warps: {(scan, "_SCAN_WARPS"): warps},
    "stages": lambda stages: {(scan, "_SCAN_STAGES"): stages},
    "decays_on_tiles": lambda on: {(scan, "_decays_on_tiles"): lambda programs, device: bool(on)},
    "chunk_block": lambda columns: {(backward, "_CHUNK_BLOCK"): columns},
    "chunk_stages": lambda stages: {(backward, "_CHUNK_STAGES"): stages},
    "solve_warps": lambda warps: {(tables, "_SOLVE_WARPS"): warps},
    "table_warps": lambda warps: {(tables, "_TABLE_WARPS"): warps},
    "backward_warps": lambda warps: {(backward, "_WARPS"): warps},
}


def fla_chunk_gated_delta_rule() -> tuple[Callable | None, str]:
    """flash-linear-attention's chunked kernels and where they came from: the fla package where it
    imports, else the copy Unsloth vendors in unsloth_zoo, registered as `fla` the way Unsloth does
    (what Unsloth trains Qwen3.5 with). (None, why neither imports) otherwise."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule, "fla"
    except Exception as error:  # noqa: BLE001 - any import failure means "try the vendored copy"
        package_error = f"fla: {type(error).__name__}: {error}"
    if importlib.util.find_spec("unsloth_zoo") is None:
        return None, f"{package_error}; unsloth_zoo is not installed"
    try:
        import unsloth  # noqa: F401 - unsloth_zoo imports only under Unsloth, which announces itself on import
        from unsloth_zoo.temporary_patches.fla_vendor import _inject_vendored_fla

        injected, _ = _inject_vendored_fla()
        if not injected:
            return None, f"{package_error}; unsloth_zoo did not register its vendored fla"
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as error:  # noqa: BLE001 - reported in the table
        return None, f"{package_error}; unsloth_zoo's vendored fla: {type(error).__name__}: {error}"
    return chunk_gated_delta_rule, "unsloth_zoo's vendored fla"


def fla_chunk(chunk_gated_delta_rule: Callable, cu_seqlens: torch.Tensor | None) -> Callable:
    """fla's call as Qwen3.5 makes it; packed rows go as one row with cu_seqlens, fla's layout, and
    come back in the rows' shape, which the gradient is drawn in."""

    def call(q, k, v, g, beta):
        if cu_seqlens is None:
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        flat = [t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o = chunk_gated_delta_rule(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)[0]
        return o.view(v.shape)

    return call


def transformers_chunk() -> Callable | None:
    """transformers' torch reference, given q and k repeated to the value heads as its model does."""
    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    except ImportError:
        return None

    def call(q, k, v, g, beta):
        repeat = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    return call


def kernel_times(
    fn: Callable, leaves: list[torch.Tensor], backward: bool, repeats: int = 5
) -> dict[str, float]:
    """Each GPU kernel's mean milliseconds in one forward (under no_grad), or with `backward` one
    forward+backward: the two apart tell a forward kernel's share from its rerun in backward."""
    do = torch.randn(leaves[2].shape, device="cuda").bfloat16()

    def run():
        if backward:
            for t in leaves:
                t.grad = None
            fn(*leaves).backward(do)
        else:
            with torch.no_grad():
                fn(*leaves)

    return kernel_ms(run, repeats)


def time_one(fn: Callable, leaves: list[torch.Tensor]) -> dict:
    """Forward under no_grad, then forward+backward; an implementation that raises gets the error."""
    do = torch.randn(leaves[2].shape, device="cuda").bfloat16()

    def forward():
        with torch.no_grad():
            fn(*leaves)

    def forward_backward():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(do)

    result = {}
    for name, call in (("fwd", forward), ("fwd+bwd", forward_backward)):
        try:
            result[name] = measure(call, "cuda", repeats=10, warmup=2).median_ms
        except Exception as error:  # noqa: BLE001 - reported in the table, not fatal
            result[name] = None
            result[f"{name} error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    if result["fwd+bwd"] is not None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        result["fwd+bwd peak MiB"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    torch.cuda.empty_cache()
    return result


def print_row(name: str, row: dict, base: dict) -> None:
    """One implementation's line, as soon as it is timed (a call cut short keeps what it had)."""
    cells = [f"{row[key]:.3f}" if row[key] is not None else "-" for key in ("fwd", "fwd+bwd")]
    ratios = [
        f"{row[key] / base[key]:.2f}x" if row[key] is not None and base[key] else "-"
        for key in ("fwd", "fwd+bwd")
    ]
    peak = row.get("fwd+bwd peak MiB")
    peak_cell = f"{peak:.0f}" if peak is not None else "-"
    print(
        f"{name:45s} {cells[0]:>9s} {cells[1]:>11s} {ratios[0]:>12s} {ratios[1]:>12s} {peak_cell:>13s}",
        flush=True,
    )
    for key, value in row.items():
        if "error" in key:
            print(f"    {key}: {value}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="also time ours with these settings, e.g. columns=64,warps=8,stages=1 (repeatable)",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="also print ours' (and fla's) time by GPU kernel"
    )
    parser.add_argument(
        "--before", help="also time this copy of the delta rule (folder or file), as 'before'"
    )
    parser.add_argument("--ours-only", action="store_true", help="leave out fla and transformers")
    parser.add_argument(
        "--shapes", type=shapes, default=SHAPES, help="BxT, comma-separated (default: 4x2048,1x32768)"
    )
    add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.delta_rule needs a CUDA device")
    variants = {f"ours, {text}": variant(text, VARIANT_KEYS) for text in args.variant}
    fla, fla_source = (None, "") if args.ours_only else fla_chunk_gated_delta_rule()
    before = load_before(args.before) if args.before else None
    results = []
    for batch, seq in args.shapes:
        leaves = inputs(batch, seq)
        doc_ids = (torch.arange(seq, device="cuda") // PACKED_LENGTH).expand(batch, seq)
        cu_seqlens = torch.arange(0, batch * seq + 1, PACKED_LENGTH, device="cuda")
        passes = model_tokens_per_pass(batch * seq)
        implementations = {
            "ours": (ours(None), {}),
            f"ours, packed {PACKED_LENGTH}": (ours(doc_ids), {}),
            f"ours, passes of <= {passes} tokens (9B)": (ours(None, tokens_per_pass=passes), {}),
            **{name: (ours(None), overrides) for name, overrides in variants.items()},
            **(
                {
                    "before": (ours(None, before), {}),
                    f"before, packed {PACKED_LENGTH}": (ours(doc_ids, before), {}),
                }
                if before
                else {}
            ),
        }
        if not args.ours_only:
            if fla:
                implementations[f"{fla_source} chunk_gated_delta_rule"] = (fla_chunk(fla, None), {})
                implementations[f"{fla_source}, packed {PACKED_LENGTH}"] = (fla_chunk(fla, cu_seqlens), {})
            else:
                implementations["fla chunk_gated_delta_rule"] = (None, {})
            implementations["transformers torch_chunk_gated_delta_rule"] = (transformers_chunk(), {})
        print(f"\nB x T = {batch} x {seq}  (Hk={K_HEADS}, Hv={V_HEADS}, Dk={K_DIM}, Dv={V_DIM}, bf16)")
        print(
            f"{'implementation':45s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'fwd vs ours':>12s} {'f+b vs ours':>12s}"
            f" {'f+b peak MiB':>13s}",
            flush=True,
        )
        rows = {}
        for name, (fn, overrides) in implementations.items():
            if fn is None:
                row = {
                    "fwd": None,
                    "fwd+bwd": None,
                    "error": fla_source if "fla" in name else "not importable",
                }
            else:
                with patched(overrides):
                    row = time_one(fn, leaves)
            rows[name] = row
            print_row(name, row, rows["ours"])
        if args.kernels:
            profiled = {"ours": ours(None), **({"before": ours(None, before)} if before else {})}
            if fla:
                profiled[f"{fla_source} chunk_gated_delta_rule"] = fla_chunk(fla, None)
            for name, fn in profiled.items():
                for part, backward in (("forward", False), ("forward+backward", True)):
                    try:
                        times = kernel_times(fn, leaves, backward)
                    except Exception as error:  # noqa: BLE001 - another project's kernels: report, keep the rows
                        print(f"  {name}, {part} by kernel: not profiled: {type(error).__name__}: {error}")
                        continue
                    print(f"  {name}, {part}")
                    print("\n".join(kernel_lines(times, top=len(times), indent="    ")))
                    rows[name][f"{part} kernels ms"] = times
        results.append({"batch": batch, "seq": seq, "implementations": rows})
    write_json(args.json, "benchmarks.delta_rule", {"before": args.before, "shapes": results})


if __name__ == "__main__":
    main()
