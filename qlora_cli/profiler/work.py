"""FLOPs and bytes each timed op does, from the named values of its call.

A work model reads the arguments of the op's call by their parameter names (bound to the
function's signature), never by position: if a kernel's parameters change, the model fails with
an error naming the op, rather than reading the wrong tensor.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from qlora_cli.core.ops import Op


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes moved by one forward call and by its backward."""

    flops: float = 0.0
    bytes: float = 0.0
    bwd_flops: float = 0.0
    bwd_bytes: float = 0.0


def gemm_work(*, x, output, need_output, **_) -> Work:
    """Frozen projection [M, K] x [K, N]: 2·M·N·K forward, the same again for dX (W is frozen, no dW).

    LoRA's rank-r products are left out of the FLOPs; their time is in the row (see lora_fwd/bwd).
    A recompute that skips the GEMM (need_output=False) does no forward work.
    """
    k = x.shape[-1]
    m = x.numel() // k
    n = output.shape[-1]
    size = x.element_size()
    flops = 2.0 * m * n * k
    moved = (m * k + m * n + n * k) * size
    backward = (flops, moved) if x.requires_grad else (0.0, m * n * size)
    return Work(flops, moved, *backward) if need_output else Work(0.0, 0.0, *backward)


def attention_work(*, q, k, v, output, **_) -> Work:
    """Causal: half of 4·B·H·S²·D forward, 2.5x that backward (the full triangle, even when packed)."""
    b, s, h, d = q.shape
    flops = 2.0 * b * h * s * s * d
    qkv_bytes = sum(t.numel() * t.element_size() for t in (q, k, v))
    out_bytes = output.numel() * output.element_size()
    return Work(flops, qkv_bytes + out_bytes, 2.5 * flops, 2 * qkv_bytes + 2 * out_bytes)


def norm_work(*, x, residual, **_) -> Work:
    """(Residual-add +) RMSNorm: x (+ residual) in, normed (+ sum) out; backward reads dy (+ dsum) and x."""
    elements = x.numel() * x.element_size()
    if residual is None:
        return Work(0.0, 2 * elements, 0.0, 3 * elements)
    return Work(0.0, 4 * elements, 0.0, 4 * elements)


def rope_work(*, q, k, q_norm_weight, **_) -> Work:
    """Q and K read and written once; backward also rereads them when QK-norm is fused."""
    elements = (q.numel() + k.numel()) * q.element_size()
    return Work(0.0, 2 * elements, 0.0, (3 if q_norm_weight is not None else 2) * elements)


def swiglu_work(*, output, need_output, **_) -> Work:
    """gate_up [T, 2I] in, [T, I] out (not written in a recompute); backward reads dout and
    gate_up, writes dgate_up. LoRA's rank-r products are left out, as for the GEMMs."""
    elements = output.numel() * output.element_size()
    return Work(0.0, (3 if need_output else 2) * elements, 0.0, 5 * elements)


def conv1d_work(*, x, output, **_) -> Work:
    """The depthwise conv (K taps a channel): x in, y out; backward reads dy and x, writes dx."""
    elements = x.numel() * x.element_size()
    k = 4
    return Work(2.0 * k * x.numel(), 2 * elements, 4.0 * k * x.numel(), 3 * elements)


def delta_rule_work(*, q, v, output, **_) -> Work:
    """The chunked delta rule per value head: within a chunk of C tokens the [C, C] products over Dk
    and Dv, across chunks the [Dk, Dv] state read and written; backward about 2.5x (the lead's
    estimate from the kernels' products, not a measurement)."""
    b, t, heads, dv = v.shape
    dk, chunk = q.shape[-1], 64
    flops = 2.0 * b * t * heads * (chunk * (2 * dk + dv) + 3 * dk * dv)
    moved = sum(x.numel() * x.element_size() for x in (q, v, output)) * 2
    return Work(flops, moved, 2.5 * flops, 2.5 * moved)


def gates_work(*, output, **_) -> Work:
    """Elementwise gates: two inputs read and one output written; backward reads three, writes two."""
    elements = output.numel() * output.element_size()
    return Work(0.0, 3 * elements, 0.0, 5 * elements)


def router_work(*, x, router, output, **_) -> Work:
    """The router's logits 2·T·H·E and their fp32 softmax; backward the same product for dx (the
    router is frozen)."""
    tokens, hidden = x.shape
    flops = 2.0 * tokens * hidden * router.shape[0]
    moved = (x.numel() + router.numel()) * x.element_size() + 2 * output.numel() * output.element_size()
    return Work(flops, moved, flops, moved)


def expert_sort_work(*, experts, **_) -> Work:
    """The copies' expert ids sorted, searched and inverted: a few int64 passes over them."""
    return Work(0.0, 4 * experts.numel() * experts.element_size())


def expert_rows_work(*, positions, output, weights=None, **_) -> Work:
    """Each token's hidden row read once and its k copies written once (spread), or the reverse
    (combine); backward the other way round, a weighted combine's rereading its rows for the weights'
    gradient."""
    copies, tokens = positions.numel(), positions.shape[0]
    row = output.shape[-1] * output.element_size()
    moved = (copies + tokens) * row
    return Work(0.0, moved, 0.0, moved if weights is None else moved + copies * row)


def _weight_bytes(weight) -> int:
    """What a frozen weight stores: a tensor's bytes, or an NF4 weight's codes and absmaxes."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    parts = (weight.packed, weight.absmax, weight.nested_absmax)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def grouped_gemm_work(*, x, output, weight=None, first=None, second=None, **_) -> Work:
    """Rows sorted by expert [M, K] times their experts' frozen weights: 2·M·N·K forward, the same
    again for dX; every expert's weight read (a paired call reads two)."""
    m, k = x.shape
    n = output.shape[-1]
    weights = sum(_weight_bytes(w) for w in (weight, first, second) if w is not None)
    flops = 2.0 * m * n * k
    moved = (m * k + m * n) * x.element_size() + weights
    return Work(flops, moved, *((flops, moved) if x.requires_grad else (0.0, 0.0)))


def grouped_lora_work(*, x, lora_a, lora_b, output, **_) -> Work:
    """The routed experts' LoRA: 2·M·r·(K + N) forward; backward about twice (dx, dA and dB)."""
    m, k = x.shape
    n, rank = output.shape[-1], lora_a.shape[1]
    flops = 2.0 * m * rank * (k + n)
    moved = (m * k + m * n) * x.element_size() + (lora_a.numel() + lora_b.numel()) * lora_a.element_size()
    return Work(flops, moved, 2 * flops, 2 * moved)


def embedding_work(*, input, output, **_) -> Work:
    return Work(0.0, input.numel() * input.element_size() + 2 * output.numel() * output.element_size())


def loss_work(*, hidden, weight, **_) -> Work:
    """lm_head + cross-entropy: logits 2·T·V·H, and as much again for d hidden when training.

    The fused kernel computes d hidden during forward (logits written, reread, rewritten as the
    softmax gradient and reread), so forward carries nearly all of it; backward only scales.
    """
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    size = hidden.element_size()
    training = hidden.requires_grad
    flops = 2.0 * tokens * vocab * width * (2 if training else 1)
    moved = (
        vocab * width + tokens * width * (2 if training else 1) + tokens * vocab * (4 if training else 2)
    ) * size
    return Work(flops, moved, 0.0, 2 * tokens * width * size)


def optimizer_work(tensors: Iterable[torch.Tensor]) -> Work:
    """AdamW reads param, grad, m, v and writes param, m, v; global-norm clipping reads and scales grads."""
    return Work(0.0, sum(t.numel() * t.element_size() for t in tensors) * 10)


WORK_MODELS: dict[Op, Callable[..., Work]] = {
    Op.QKV_GEMM: gemm_work,
    Op.O_PROJ: gemm_work,
    Op.IN_PROJ: gemm_work,
    Op.OUT_PROJ: gemm_work,
    Op.GATE_UP_GEMM: gemm_work,
    Op.DOWN_GEMM: gemm_work,
    Op.ATTENTION: attention_work,
    Op.RMSNORM_ATTN: norm_work,
    Op.RMSNORM_FFN: norm_work,
    Op.FINAL_NORM: norm_work,
    Op.ROPE: rope_work,
    Op.SILU: swiglu_work,
    Op.CONV1D: conv1d_work,
    Op.DELTA_RULE: delta_rule_work,
    Op.GATES: gates_work,
    Op.ROUTER: router_work,
    Op.EXPERT_SORT: expert_sort_work,
    Op.EXPERT_ROWS: expert_rows_work,
    Op.EXPERT_GATE_UP: grouped_gemm_work,
    Op.EXPERT_SWIGLU: functools.partial(swiglu_work, need_output=True),
    Op.EXPERT_DOWN: grouped_gemm_work,
    Op.EXPERT_LORA: grouped_lora_work,
    Op.EMBEDDING: embedding_work,
    Op.LM_HEAD_LOSS: loss_work,
}


@functools.cache
def _parameters(target: Callable) -> tuple[tuple[str, ...], dict]:
    """(names of the parameters a call may fill by position, {name: default})."""
    parameters = inspect.signature(target).parameters.values()
    positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return positional, {p.name: p.default for p in parameters if p.default is not p.empty}


def named_arguments(fn: Callable, args: tuple, kwargs: dict) -> dict:
    """The call fn(*args, **kwargs) as {parameter name: value}, defaults included.

    A module is read through its forward's signature, looked up on its class so the cache holds no
    model. The call itself checks its arguments; this only names them.
    """
    if isinstance(fn, torch.nn.Module):
        positional, defaults = _parameters(type(fn).forward)
        positional = positional[1:]
    else:
        positional, defaults = _parameters(fn)
    if len(args) > len(positional):
        raise TypeError(f"{fn} takes {len(positional)} positional arguments, the call gives {len(args)}")
    return {**defaults, **dict(zip(positional[: len(args)], args, strict=True)), **kwargs}


def work_of(op: Op, values: dict, output: torch.Tensor) -> Work:
    """The work of one call of `op`, from its named arguments and its (first) output."""
    try:
        return WORK_MODELS[op](output=output, **values)
    except TypeError as err:
        raise TypeError(
            f"the work model of {op} cannot read this call (its arguments: {', '.join(values)}): {err}"
        ) from None
