"""LoRA's share of the projection and SwiGLU rows, measured apart from the step.

LoRA runs inside the projections' fused calls and, for the MLP, inside SwiGLU, so the step cannot
time it alone. The recorder keeps how the step first called each such op (`lora_call`); here each
is repeated with and without LoRA at the step's tokens per micro-batch, and the differences times
the step's calls of that op are the estimate.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from qlora_cli.core.ops import LORA_ROWS, Op
from qlora_cli.profiler.timing import measure
from qlora_kernels.linear import lora_linear
from qlora_kernels.swiglu import lora_swiglu

# Projection group (or SwiGLU, which does the MLP's share of LoRA) -> (its forward row, its
# backward row), for LoRA's share of both.
GROUP_ROWS = {
    "qkv": (Op.QKV_GEMM, Op.QKV_BWD),
    "o": (Op.O_PROJ, Op.O_PROJ_BWD),
    "in_proj": (Op.IN_PROJ, Op.IN_PROJ_BWD),
    "out_proj": (Op.OUT_PROJ, Op.OUT_PROJ_BWD),
    "gate_up": (Op.GATE_UP_GEMM, Op.GATE_UP_BWD),
    "down": (Op.DOWN_GEMM, Op.DOWN_BWD),
    "swiglu": (Op.SILU, Op.SWIGLU_BWD),
}
LORA_GROUP = {rows[0]: group for group, rows in GROUP_ROWS.items()}


def lora_call(op: Op, values: dict) -> dict:
    """What `lora_share` needs to repeat a call, from its named arguments: its mode, LoRA tensors and
    the model's dropout seed (LoRA dropout is LoRA's cost), never its activations (they would hold
    the step's autograd graph alive)."""
    if op != Op.SILU:
        return {
            "keep_lora_t": bool(values["keep_lora_t"]),
            "from_t": values["lora_t"] is not None,
            "dropout_seed": values["dropout_seed"],
        }
    lora_t = values["lora_t"]
    return {
        "width": values["gate_up"].shape[-1],
        "ranks": None if lora_t is None else lora_t.shape[-1],
        "lora": (values["gate_b"], values["up_b"], values["scaling"], _detached(values["down_a"])),
    }


def _detached(down_a: torch.Tensor | None) -> torch.Tensor | None:
    """Down's A as SwiGLU takes it is A times the adapter switch, made in the step's graph (or in
    a rerun without one): kept apart from it, and a leaf of its own where the call is repeated."""
    return None if down_a is None else down_a.detach()


def _projection_calls(group: torch.nn.Module, call: dict, tokens: int, device, dtype):
    """(with LoRA, without, the leaves each differentiates, incoming gradients) for one call of a
    projection group made as the step made it: whole, stopping at t (keep_lora_t) or from t."""
    count = len(group.names)
    x = torch.randn(tokens, group.weights[0].shape[1], device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, sum(group.out_features), device=device, dtype=dtype)
    ranks = sum(a.shape[0] for a in group.lora_A.values())
    t = torch.randn(tokens, ranks, device=device, dtype=dtype, requires_grad=True)
    seed = call["dropout_seed"]
    if call["keep_lora_t"]:
        leaves, grads = [x, *group.lora_A.values()], (dy, t.detach())

        def with_lora():
            return group(x, keep_lora_t=True, dropout_seed=seed)
    elif call["from_t"]:
        leaves, grads = [x, t, *group.lora_B.values()], (dy,)

        def with_lora():
            return (group(x, lora_t=t, dropout_seed=seed),)
    else:
        leaves, grads = [x, *group.lora_A.values(), *group.lora_B.values()], (dy,)

        def with_lora():
            return (group(x, dropout_seed=seed),)

    def without_lora():
        none = [None] * count
        return (lora_linear(x, group.weights, group.biases, none, none, 0.0, buffer=group.scratch),)

    return with_lora, without_lora, leaves, [x], grads


def _swiglu_calls(call: dict, tokens: int, device, dtype):
    """The same for SwiGLU with the MLP's LoRA (gate/up's B, down's A) against plain SwiGLU."""
    gate_b, up_b, scaling, down_a = call["lora"]
    down_a = None if down_a is None else down_a.clone().requires_grad_()
    g = torch.randn(tokens, call["width"], device=device, dtype=dtype, requires_grad=True)
    t = None
    if call["ranks"]:
        t = torch.randn(tokens, call["ranks"], device=device, dtype=dtype, requires_grad=True)
    dh = torch.randn(tokens, call["width"] // 2, device=device, dtype=dtype)
    loras = [m for m in (t, gate_b, up_b, down_a) if m is not None]
    grads = (
        (dh,) if down_a is None else (dh, torch.randn(tokens, down_a.shape[0], device=device, dtype=dtype))
    )

    def with_lora():
        h, down_t = lora_swiglu(g, t, gate_b, up_b, scaling, down_a)
        return (h,) if down_t is None else (h, down_t)

    return with_lora, lambda: (lora_swiglu(g)[0],), [g, *loras], [g], grads


def _carries_lora(group_name: str, fn: Callable, call: dict) -> bool:
    if group_name == "swiglu":
        return any(m is not None for m in call["lora"][:2] + call["lora"][3:])
    return len(fn.lora_A) > 0


def _best_ms(fn: Callable[[], object], device: torch.device) -> float:
    return measure(fn, device, repeats=10 if device.type == "cuda" else 7).min_ms


def _lora_ms(calls, device: torch.device) -> tuple[float, float]:
    """(forward, backward) ms that LoRA adds to one call: with minus without; best of a few each."""
    with_lora, without_lora, leaves, plain_leaves, grads = calls
    forward = _best_ms(with_lora, device) - _best_ms(without_lora, device)
    both = _best_ms(lambda: torch.autograd.grad(with_lora(), leaves, grads), device) - _best_ms(
        lambda: torch.autograd.grad(without_lora(), plain_leaves, grads[:1]), device
    )
    return max(0.0, forward), max(0.0, both - forward)


def lora_share(profiler, steps) -> dict[Op, tuple[float, float]]:
    """lora_fwd and lora_bwd -> (ms per step that LoRA adds inside the gemm and SwiGLU rows, calls
    per step), over the recorder's counted steps."""
    tokens = sum(s.tokens for s in steps) // max(1, sum(s.micro_batches for s in steps))
    share = dict.fromkeys(LORA_ROWS, (0.0, 0.0))
    device, dtype = profiler.device, profiler.dtype
    for group_name, (fn, call) in profiler.groups.items():
        if tokens == 0 or not _carries_lora(group_name, fn, call):
            continue
        if group_name == "swiglu":
            calls = _swiglu_calls(call, tokens, device, dtype)
        else:
            calls = _projection_calls(fn, call, tokens, device, dtype)
        forward, backward = _lora_ms(calls, device)
        for op, row, ms in zip(LORA_ROWS, GROUP_ROWS[group_name], (forward, backward), strict=True):
            row_calls = statistics.fmean(s.rows[row].calls if row in s.rows else 0 for s in steps)
            total_ms, total_calls = share[op]
            share[op] = (total_ms + ms * row_calls, total_calls + row_calls)
    return share
