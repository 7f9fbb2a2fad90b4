"""Shared memory, registers and spills of every attention, delta-rule, conv1d, FP8, RMSNorm and MoE
(expert rows, grouped NF4) Triton kernel, compiled for a GPU that need not be here: what decides whether a kernel launches (Hopper allows 232,448 bytes of
shared memory per block) and how many blocks share an SM.

Usage: python -m benchmarks.kernel_resources [--arch 90] [--shape 9b ...]
Runs the real launchers (forward, backward, decode step) on meta tensors with every
JITFunction.run intercepted, so each kernel is compiled with exactly the arguments, constexprs,
num_warps and num_stages its launcher passes (no device needed; Triton ships ptxas). Pointers are
16-byte aligned and integers divisible by 16 are marked so, and integers equal to 1 become
constants, as Triton's launcher specialises them. Registers and spills come from `ptxas -v` on the
generated PTX. A kernel that exceeds the target's shared memory is flagged "OVER". --kernels picks
kernels by name and --warps / --stages try other launch settings on them without editing a launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime.jit import JITFunction

from qlora_kernels import (
    attention,
    conv1d,
    delta_rule,
    expert_rows,
    fp8,
    grouped_linear,
    grouped_lora,
    rmsnorm,
)
from qlora_kernels.delta_rule.step import _step as delta_rule_step
from qlora_kernels.nf4 import NF4Weight

# Per block, by compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}

# (k-heads, v-heads, head dim) of Qwen3.5's Gated DeltaNet layers; "tests" is the interpreter tests' shape.
SHAPES = {
    "9b": (16, 32, 128, 128),
    "27b": (16, 48, 128, 128),
    "0.8b": (16, 16, 128, 128),
    "tests": (2, 4, 24, 40),
}
BATCH, SEQ, CONV_WIDTH = 2, 2048, 4
# Attention's head sizes in the shipped families, at Qwen3.5-9B's 16 query and 4 kv heads.
ATTENTION_HEAD_DIMS, ATTENTION_HEADS = (64, 128, 256), (16, 4)
LORA_RANK = 16

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
}


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recorded_launches():
    """Every fn[grid](...) in the block is recorded instead of run."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _signature(launch: Launch):
    names = launch.kernel.arg_names
    values = dict(zip(names, launch.args, strict=False))
    values.update({k: v for k, v in launch.kwargs.items() if k in names})
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values[name]
        if launch.kernel.params[i].is_constexpr or (type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return signature, constexprs, attrs, options


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """(registers per thread, spill bytes stored) from ptxas -v."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", source.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores", log)
    return registers, int(spills.group(1)) if spills else 0


def compile_launch(launch: Launch, arch: int) -> dict:
    signature, constexprs, attrs, options = _signature(launch)
    source = triton.compiler.ASTSource(
        fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, spills = _ptxas_usage(compiled.asm["ptx"], arch)
    return {
        "kernel": launch.kernel.__name__,
        "warps": compiled.metadata.num_warps,
        "stages": compiled.metadata.num_stages,
        "shared": compiled.metadata.shared,
        "registers": registers,
        "spills": spills,
        "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
    }


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(grad)


def delta_rule_launches(k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> list[Launch]:
    """One forward + backward with an initial and a final state, on a packed row, and one decode step."""
    q, k = _meta(BATCH, SEQ, k_heads, k_dim, grad=True), _meta(BATCH, SEQ, k_heads, k_dim, grad=True)
    v = _meta(BATCH, SEQ, v_heads, v_dim, grad=True)
    g = _meta(BATCH, SEQ, v_heads, dtype=torch.float32, grad=True)
    beta = _meta(BATCH, SEQ, v_heads, grad=True)
    state = _meta(BATCH, v_heads, k_dim, v_dim, dtype=torch.float32, grad=True)
    docs = _meta(BATCH, SEQ, dtype=torch.int32)
    with recorded_launches() as launches:
        o, final = delta_rule.GatedDeltaRuleFunction.apply(
            q, k, v, g, beta, docs, state, k_dim**-0.5, True, True, None
        )
        torch.autograd.grad(
            (o, final), (q, k, v, g, beta, state), (torch.empty_like(o), torch.empty_like(final))
        )
        step_state = _meta(BATCH, v_heads, k_dim, v_dim, dtype=torch.float32)
        delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], step_state, k_dim**-0.5, True)
    return launches


def conv1d_launches(k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> list[Launch]:
    """Forward, backward and decode step over the q, k, v channels the delta rule's convolution sees."""
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    x = _meta(BATCH, SEQ, channels, grad=True)
    weight, bias = _meta(channels, CONV_WIDTH, grad=True), _meta(channels, grad=True)
    docs = _meta(BATCH, SEQ, dtype=torch.int32)
    with recorded_launches() as launches:
        y = conv1d.CausalConv1dFunction.apply(x, weight, bias, docs, "silu")
        torch.autograd.grad(y, (x, weight, bias), torch.empty_like(y))
        conv_state = _meta(BATCH, channels, CONV_WIDTH - 1)
        conv1d._conv_step(x[:, 0], conv_state, weight, bias, "silu")
    return launches


def attention_launches(head_dim: int) -> list[Launch]:
    """Forward and backward on packed rows, with the tiles the launcher picks on a GPU (meta tensors
    are not CUDA ones, so its device test is answered for them)."""
    q_heads, kv_heads = ATTENTION_HEADS
    q = _meta(BATCH, SEQ, q_heads, head_dim, grad=True)
    k, v = _meta(BATCH, SEQ, kv_heads, head_dim, grad=True), _meta(BATCH, SEQ, kv_heads, head_dim, grad=True)
    docs = _meta(BATCH, SEQ, dtype=torch.int32)
    on_gpu = attention._block_config
    attention._block_config = lambda d_pad, dtype, is_cuda: on_gpu(d_pad, dtype, True)
    try:
        with recorded_launches() as launches:
            out = attention.TritonAttention.apply(q, k, v, docs, head_dim**-0.5)
            torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    finally:
        attention._block_config = on_gpu
    return launches


def fp8_launches(rows: int = 18944, in_features: int = 3584, tokens: int = 8192) -> list[Launch]:
    """The activation quantizer and both NF4-to-e4m3 layouts, at Qwen2.5-7B's gate/up shape."""
    blocks = rows * in_features // 64
    weight = NF4Weight(
        packed=_meta(rows * in_features // 2, dtype=torch.uint8),
        absmax=_meta(blocks, dtype=torch.uint8),
        nested_absmax=_meta(-(-blocks // 256), dtype=torch.float32),
        nested_offset=0.5,
        shape=torch.Size((rows, in_features)),
        dtype=torch.bfloat16,
    )
    inverse = _meta(max(rows, in_features), dtype=torch.float32)
    out = _meta(rows, in_features, dtype=torch.float8_e4m3fn)
    with recorded_launches() as launches:
        fp8._quantize_rows_triton(_meta(tokens, in_features))
        fp8._nf4_to_e4m3_triton(weight, inverse, out, transposed=False)
        fp8._nf4_to_e4m3_triton(weight, inverse, out.view(in_features, rows), transposed=True)
    return launches


def moe_launches(experts: int = 256, hidden: int = 2048, inter: int = 512, tokens: int = 4096, k: int = 8):
    """A routed MoE MLP's kernels, forward and backward, at Qwen3.5-35B-A3B's shape (4096 tokens routed
    to 8 experts each): the tokens' copies spread to their sorted rows, gate and up as one paired
    grouped NF4 GEMM (each half a strided view, the second input gradient added into the first's),
    down, the weighted combine with its weights' gradient, and LoRA r 16 on gate/up (plain grouped
    GEMMs through the rank, and the grouped outer products of A's and B's gradients)."""
    rows = tokens * k

    def nf4_experts(out: int, inner: int) -> grouped_linear.GroupedNF4Weight:
        blocks = out * inner // 64
        return grouped_linear.GroupedNF4Weight(
            packed=_meta(experts, out * inner // 2, dtype=torch.uint8),
            absmax=_meta(experts, blocks, dtype=torch.uint8),
            nested_absmax=_meta(experts, -(-blocks // 256), dtype=torch.float32),
            nested_offset_table=_meta(experts, dtype=torch.float32),
            shape=torch.Size((experts, out, inner)),
            dtype=torch.bfloat16,
        )

    gate, up, down = nf4_experts(inter, hidden), nf4_experts(inter, hidden), nf4_experts(hidden, inter)
    offsets, positions = _meta(experts + 1, dtype=torch.int64), _meta(tokens, k, dtype=torch.int64)
    weights = _meta(tokens, k)
    with recorded_launches() as launches:
        sorted_rows = expert_rows._spread(_meta(tokens, hidden), positions, None)
        gate_up = _meta(rows, 2 * inter)
        for weight, half in ((gate, gate_up[:, :inter]), (up, gate_up[:, inter:])):
            grouped_linear._grouped_matmul(sorted_rows, weight, offsets, transposed=False, out=half)
        routed = grouped_linear._grouped_matmul(_meta(rows, inter), down, offsets, transposed=False)
        expert_rows._combine(routed, positions, weights)
        dout = _meta(tokens, hidden)
        expert_rows._spread(dout, positions, weights)
        expert_rows._row_dots(routed, positions, dout, weights.dtype)
        grouped_linear._grouped_matmul(_meta(rows, hidden), down, offsets, transposed=True)
        dx = grouped_linear._grouped_matmul(gate_up[:, :inter], gate, offsets, transposed=True)
        grouped_linear._grouped_matmul(
            gate_up[:, inter:], up, offsets, transposed=True, out=dx, accumulate=True
        )
        expert_rows._combine(dx, positions, None)
        lora_a, lora_b = _meta(experts, LORA_RANK, hidden), _meta(experts, 2 * inter, LORA_RANK)
        t = grouped_linear._grouped_matmul(sorted_rows, lora_a, offsets, transposed=False)
        grouped_linear._grouped_matmul(t, lora_b, offsets, transposed=False)
        dt = grouped_linear._grouped_matmul(gate_up, lora_b, offsets, transposed=True)
        grouped_linear._grouped_matmul(dt, lora_a, offsets, transposed=True)
        grouped_lora._grouped_outer(dt, sorted_rows, offsets)
        grouped_lora._grouped_outer(gate_up, t, offsets)
    return launches


def rmsnorm_launches(k_heads: int, v_heads: int, k_dim: int, v_dim: int, hidden: int = 4096) -> list[Launch]:
    """The Gated DeltaNet's gated norm over each value head (its gate z read in place from in_proj's
    output), and a layer's norm over the hidden size, forward and backward."""
    conv = 2 * k_heads * k_dim + v_heads * v_dim
    projected = _meta(BATCH * SEQ, conv + v_heads * v_dim + 2 * v_heads)
    z = projected[:, conv : conv + v_heads * v_dim].view(BATCH * SEQ, v_heads, v_dim)
    gated = (_meta(BATCH * SEQ * v_heads, v_dim), z)
    layer = _meta(BATCH * SEQ, hidden)
    with recorded_launches() as launches:
        for x, gate in (gated, (layer, None)):
            weight = _meta(x.shape[-1], dtype=torch.float32)
            _, x2d, rstd = rmsnorm._rms_norm_forward(x, None, weight, 1e-6, 0.0, gate)
            rmsnorm._rms_norm_backward(x, None, x2d, weight, rstd, 0.0, True, gate)
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--shape", choices=SHAPES, nargs="+", default=["9b"])
    parser.add_argument("--kernels", nargs="+", help="only kernels whose names contain one of these")
    parser.add_argument("--warps", type=int, help="compile the chosen kernels with this num_warps instead")
    parser.add_argument("--stages", type=int, help="compile the chosen kernels with this num_stages instead")
    args = parser.parse_args()
    limit = SHARED_LIMIT.get(args.arch)
    print(f"triton {triton.__version__}, sm_{args.arch}, shared memory limit {limit} bytes per block")
    for shape in args.shape:
        print(f"\n{shape}: (Hk, Hv, Dk, Dv) = {SHAPES[shape]}, B x T = {BATCH} x {SEQ}")
        print(
            f"{'kernel':<26} {'warps':>5} {'stages':>6} {'shared':>8} {'regs':>5} {'spills':>6}  constexprs"
        )
        seen = set()
        launches = delta_rule_launches(*SHAPES[shape]) + conv1d_launches(*SHAPES[shape]) + fp8_launches()
        launches += rmsnorm_launches(*SHAPES[shape]) + moe_launches()
        launches += [launch for dim in ATTENTION_HEAD_DIMS for launch in attention_launches(dim)]
        for launch in launches:
            name = launch.kernel.__name__
            if args.kernels and not any(part in name for part in args.kernels):
                continue
            key = (name, tuple(sorted((k, str(v)) for k, v in launch.kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            overrides = {"num_warps": args.warps, "num_stages": args.stages}
            launch.kwargs.update({k: v for k, v in overrides.items() if v is not None})
            row = compile_launch(launch, args.arch)
            over = "  OVER" if limit and row["shared"] > limit else ""
            print(
                f"{row['kernel']:<26} {row['warps']:>5} {row['stages']:>6} {row['shared']:>8} "
                f"{row['registers']:>5} {row['spills']:>6}  {row['constexprs']}{over}",
                flush=True,
            )


if __name__ == "__main__":
    main()
