"""Frozen projections (NF4, plain, or any kernels.formats format) plus LoRA, fused for projections
that share one input.

One call computes, for P projections side by side (P=3 fused QKV, P=2 gate/up, P=1 o/down):

    y = concat_p( x @ W_p^T + bias_p + scaling * (lora_x @ A_p^T) @ B_p^T )

The frozen weights are dequantized into a scratch buffer shared across layers and multiplied by
cuBLAS. LoRA's rank-r products are bound by memory, not FLOPs, so each layout is chosen for
the bytes it moves:
  - B as extra columns (wide projections, sum(out) >= 2 in, e.g. gate/up): t = lora_x @ A_cat^T
    first, then [x | scaling * t] @ [W | B]^T, which costs a copy of x instead of a pass over
    the wide y.
  - Otherwise (qkv, o, down) y = x @ W^T, t = lora_x @ A_cat^T, then y += scaling * t @ B^T in
    place. Timed on an H200 as CUDA-graph replays, this beat carrying A as extra rows of W (one
    GEMM writes y and t side by side, then torch.addmm copies the row-strided y) by 30-100 us a
    call at Qwen2.5 1.5B and 7B shapes.
The MLP splits LoRA across its ops (kernels.swiglu): the gate/up projection stops at t =
lora_x @ A^T (`lora_linear_a`), SwiGLU adds B, and the down projection starts from the t that
SwiGLU forms (`lora_linear_b`), so neither of their GEMMs carries rank columns.
Backward re-dequantizes W instead of keeping it and goes through the small rank first: with B
as extra columns, dY @ [W | B] gives dX and g = dY @ B in one GEMM, so nothing of size out x in
outlives a call. Inside a 7B training step on an H200 that beat separate dX and g GEMMs, for
which cuBLAS picked a slower kernel at down's shape (benchmarks/RESULTS.md). A checkpoint
recompute can skip the GEMM (`need_output=False`): backward needs only x and t. The only Triton
kernel on this path is the weights' dequantize (kernels.nf4's for NF4); the GEMMs are cuBLAS through torch, so
this module has none of its own. With a group's FP8 scales (kernels.fp8) the frozen products, forward
and dX, are e4m3 GEMMs instead, and B is never an extra column: LoRA stays in x.dtype.

Numerics: everything is computed in x.dtype with fp32 accumulation (cuBLAS); the fp32 LoRA
master weights are cast to x.dtype for the matmuls and get their gradients back in fp32.
"""

from collections.abc import Sequence

import torch

from qlora_kernels._dispatch import use_triton
from qlora_kernels.formats import FrozenWeight, frozen_format
from qlora_kernels.fp8 import FP8Scales, fp8_input_grad, fp8_linear


def _out_features(weight: FrozenWeight) -> int:
    return weight.shape[0]


def _in_features(weight: FrozenWeight) -> int:
    return weight.shape[1]


def _total_rank(lora_a: Sequence[torch.Tensor | None]) -> int:
    return sum(a.shape[0] for a in lora_a if a is not None)


def _takes_extra_columns(weights: Sequence[FrozenWeight]) -> bool:
    """Whether every weight can dequantize into rows wider than itself (its format says)."""
    return all(frozen_format(w).fills_row_views(w) for w in weights)


def _lora_layout(weights: Sequence[FrozenWeight], fp8: FP8Scales | None) -> str:
    """B as extra "columns" of a wide projection, when its frozen weights can dequantize into wider
    rows; else "added". FP8 products keep B out of the e4m3 GEMM: LoRA stays in the compute dtype."""
    wide = sum(_out_features(w) for w in weights) >= 2 * _in_features(weights[0])
    return "columns" if wide and fp8 is None and _takes_extra_columns(weights) else "added"


def buffer_numel(weights: Sequence[FrozenWeight], lora_a: Sequence[torch.Tensor | None] = ()) -> int:
    """Scratch size (elements) one call needs: the weights with B as extra columns. Size a buffer
    shared across layers with the largest projection group of a layer."""
    rows = sum(_out_features(w) for w in weights)
    return rows * (_in_features(weights[0]) + _total_rank(lora_a))


# ----------------------------------------------------------------------------- reference


def lora_linear_reference(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor | None],
    lora_b: Sequence[torch.Tensor | None],
    scaling: float,
    lora_x: torch.Tensor | None = None,
) -> torch.Tensor:
    lora_x = x if lora_x is None else lora_x
    outputs = []
    for weight, bias, a, b in zip(weights, biases, lora_a, lora_b, strict=True):
        weight = frozen_format(weight).dequantize_reference(weight, x.dtype)
        y = torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
        if a is not None:
            y = y + scaling * ((lora_x @ a.to(x.dtype).T) @ b.to(x.dtype).T)
        outputs.append(y)
    return torch.cat(outputs, dim=-1)


def lora_linear_a_reference(x, weights, biases, lora_a, lora_x=None):
    none = [None] * len(weights)
    y = lora_linear_reference(x, weights, biases, none, none, 0.0)
    present = [a.to(x.dtype) for a in lora_a if a is not None]
    t = ((x if lora_x is None else lora_x) @ torch.cat(present).T) if present else None
    return y, t


def lora_linear_b_reference(x, lora_t, weights, biases, lora_b, scaling):
    y = lora_linear_reference(x, weights, biases, [None] * len(weights), [None] * len(weights), 0.0)
    parts, rank_start = [], 0
    for weight, b in zip(weights, lora_b, strict=True):
        if b is None:
            parts.append(torch.zeros(*x.shape[:-1], _out_features(weight), dtype=x.dtype, device=x.device))
            continue
        t = lora_t[..., rank_start : rank_start + b.shape[1]]
        parts.append(scaling * (t @ b.to(x.dtype).T))
        rank_start += b.shape[1]
    return y + torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- launcher


def _stacked_weight(
    weights: Sequence[FrozenWeight],
    dtype: torch.dtype,
    buffer: torch.Tensor | None,
    *,
    extra_columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """All frozen weights as one [sum(out), in] matrix in `dtype`, in the scratch, with
    `extra_columns` (B, [sum(out), ranks]) beside it. A single plain weight already in `dtype`
    with nothing beside it is used as it is."""
    first = weights[0]
    dense = frozen_format(first).dense_view(first, dtype)
    if extra_columns is None and len(weights) == 1 and dense is not None:
        return dense
    in_features = _in_features(first)
    rows = sum(_out_features(w) for w in weights)
    shape = (rows, in_features + (0 if extra_columns is None else extra_columns.shape[1]))
    total = shape[0] * shape[1]
    if buffer is None:
        buffer = torch.empty(total, dtype=dtype, device=first.device)
    if buffer.dtype != dtype or buffer.numel() < total or not buffer.is_contiguous():
        raise ValueError(
            f"buffer must be contiguous {dtype} with at least {total} values (qlora_kernels.linear.buffer_numel), "
            f"got {buffer.dtype} with {buffer.numel()}"
        )
    stacked = buffer.reshape(-1)[:total].view(shape)
    start = 0
    for weight in weights:
        block = stacked[start : start + _out_features(weight), :in_features]
        frozen_format(weight).dequantize(weight, dtype, out=block)
        start += _out_features(weight)
    if extra_columns is not None:
        stacked[:, in_features:].copy_(extra_columns)
    return stacked


def _lora_b_columns(lora_b, slices, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Every B as one [sum(out), ranks] matrix: B_p in its output rows and rank columns, zeros
    elsewhere, so one product with it gives each projection its own rank slice."""
    if len(lora_b) == 1 and lora_b[0].shape[0] == rows:
        return lora_b[0].to(dtype)
    ranks = sum(rank_slice.stop - rank_slice.start for rank_slice, _ in slices)
    columns = lora_b[0].new_zeros(rows, ranks, dtype=dtype)
    for b, (rank_slice, out_slice) in zip(lora_b, slices, strict=True):
        columns[out_slice, rank_slice].copy_(b)
    return columns


def _a_cat(lora_a, dtype: torch.dtype) -> torch.Tensor:
    """Every A as one [ranks, in] matrix in the compute dtype: one concatenation, one cast."""
    return (lora_a[0] if len(lora_a) == 1 else torch.cat(list(lora_a))).to(dtype)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * a @ b in fp32, for the LoRA weight gradients: on CUDA cuBLAS writes its fp32
    accumulator out, which saves a rounding to bf16 and a cast kernel per gradient."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        out = torch.mm(a, b, out_dtype=torch.float32)
    else:
        out = torch.mm(a, b).float()
    return out if scale == 1 else out.mul_(scale)


def _dx_and_g(dy, weights, dtype, buffer, b_columns, need_dx: bool, fp8: FP8Scales | None):
    """(dX = dY @ W or None, g = dY @ B). With B as extra weight columns the dX GEMM yields g
    too, and dX comes back as a row-strided view."""
    if need_dx and fp8 is None and _takes_extra_columns(weights):
        joined = dy @ _stacked_weight(weights, dtype, buffer, extra_columns=b_columns)
        in_features = joined.shape[1] - b_columns.shape[1]
        return joined[:, :in_features], joined[:, in_features:]
    dx = _frozen_input_grad(dy, weights, dtype, buffer, fp8) if need_dx else None
    return dx, dy @ b_columns


def _matmul(inputs: torch.Tensor, stacked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return inputs @ stacked.T if bias is None else torch.addmm(bias, inputs, stacked.T)


def _frozen_product(rows, weights, dtype, buffer, bias, fp8: FP8Scales | None) -> torch.Tensor:
    """rows @ W^T + bias: cuBLAS in `dtype`, or an e4m3 GEMM under `fp8`'s scales (kernels.fp8)."""
    if fp8 is not None:
        return fp8_linear(rows, weights, fp8, buffer, bias)
    return _matmul(rows, _stacked_weight(weights, dtype, buffer), bias)


def _frozen_input_grad(dy, weights, dtype, buffer, fp8: FP8Scales | None) -> torch.Tensor:
    """dY @ W, in `dtype` or as an e4m3 GEMM."""
    if fp8 is not None:
        return fp8_input_grad(dy, weights, fp8, buffer)
    return dy @ _stacked_weight(weights, dtype, buffer)


def _stacked_bias(
    biases: Sequence[torch.Tensor | None], weights: Sequence[FrozenWeight], like: torch.Tensor
) -> torch.Tensor | None:
    if all(bias is None for bias in biases):
        return None
    parts = [
        like.new_zeros(_out_features(w)) if bias is None else bias.to(like.dtype)
        for w, bias in zip(weights, biases, strict=True)
    ]
    return torch.cat(parts)


def _check_arguments(x, weights, biases, lora_a, lora_b, lora_x) -> None:
    """lora_a or lora_b may be None as a whole (the split calls take one side only)."""
    count = len(weights)
    sides = [side for side in (lora_a, lora_b) if side is not None]
    if count == 0 or len(biases) != count or any(len(side) != count for side in sides):
        raise ValueError("weights, biases, lora_a and lora_b need one entry per projection")
    in_features = x.shape[-1]
    for p, weight in enumerate(weights):
        if len(weight.shape) != 2 or _in_features(weight) != in_features:
            raise ValueError(
                f"projection {p}: weight shape {tuple(weight.shape)} does not take {in_features} inputs"
            )
        a = None if lora_a is None else lora_a[p]
        b = None if lora_b is None else lora_b[p]
        if lora_a is not None and lora_b is not None and (a is None) != (b is None):
            raise ValueError(f"projection {p}: lora_a and lora_b must both be given or both be None")
        fits_a = a is None or a.shape[1] == in_features
        fits_b = b is None or b.shape[0] == _out_features(weight)
        fits_ranks = a is None or b is None or a.shape[0] == b.shape[1]
        if not (fits_a and fits_b and fits_ranks):
            shapes = ", ".join(f"{n} {tuple(m.shape)}" for n, m in (("A", a), ("B", b)) if m is not None)
            raise ValueError(f"projection {p}: LoRA shapes {shapes} do not fit weight {tuple(weight.shape)}")
    if lora_x is not None and lora_x.shape != x.shape:
        raise ValueError(f"lora_x has shape {tuple(lora_x.shape)}, x has {tuple(x.shape)}")


# ----------------------------------------------------------------------------- autograd Function


class LoRALinearFunction(torch.autograd.Function):
    """Arguments after `scaling`: the frozen weights, biases, scratch buffer and FP8 scales (not
    differentiated), whether the output is needed, which projections carry LoRA, then their A
    and B tensors flattened."""

    @staticmethod
    def forward(ctx, x, lora_x, scaling, weights, biases, buffer, fp8, need_output, lora_index, *lora_params):
        dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])
        lora_rows = rows if lora_x is None else lora_x.reshape(-1, x.shape[-1])
        lora_a, lora_b = lora_params[0::2], lora_params[1::2]
        out_features = sum(_out_features(w) for w in weights)
        bias = _stacked_bias(biases, weights, x) if need_output else None
        out = t = None
        a_cat = b_columns = None
        slices = list(_lora_slices(weights, lora_index, [a.shape[0] for a in lora_a]))
        if lora_index:
            a_cat = _a_cat(lora_a, dtype)
            b_columns = _lora_b_columns(lora_b, slices, out_features, dtype)
            t = lora_rows @ a_cat.T
            if need_output and _lora_layout(weights, fp8) == "columns":
                stacked = _stacked_weight(weights, dtype, buffer, extra_columns=b_columns)
                out = _matmul(torch.cat([rows, t * scaling], dim=1), stacked, bias)
            elif need_output:
                out = _frozen_product(rows, weights, dtype, buffer, bias, fp8)
                out.addmm_(t, b_columns.T, alpha=scaling)
        elif need_output:
            out = _frozen_product(rows, weights, dtype, buffer, bias, fp8)
        if out is None:
            # A checkpoint recompute only needs what backward saves; this output is never read.
            out = rows.new_empty(rows.shape[0], out_features)
        # A and B in the compute dtype are kept (a few MB a layer), so backward casts nothing.
        ctx.save_for_backward(x, lora_x, t, a_cat, b_columns)
        ctx.scaling = scaling
        ctx.weights = weights
        ctx.buffer, ctx.fp8 = buffer, fp8
        ctx.lora_index = lora_index
        ctx.slices = slices
        ctx.grad_dtypes = [p.dtype for p in lora_params]
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        x, lora_x, t, a_cat, b_columns = ctx.saved_tensors
        scaling, weights, lora_index = ctx.scaling, ctx.weights, ctx.lora_index
        a_dtypes, b_dtypes = ctx.grad_dtypes[0::2], ctx.grad_dtypes[1::2]
        dtype = x.dtype
        in_features = x.shape[-1]
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        need_dx = ctx.needs_input_grad[0]
        dx = dlora_x = None
        grads = []
        if not lora_index:
            if need_dx:
                dx = _frozen_input_grad(dy, weights, dtype, ctx.buffer, ctx.fp8)
        else:
            # The LoRA gradient goes through the rank first, g = dY @ B [tokens, ranks].
            dx, g = _dx_and_g(dy, weights, dtype, ctx.buffer, b_columns, need_dx, ctx.fp8)
            if lora_x is None:
                lora_rows = x.reshape(-1, in_features)
                if need_dx:
                    dx.addmm_(g, a_cat, alpha=scaling)
            else:
                lora_rows = lora_x.reshape(-1, in_features)
                if ctx.needs_input_grad[1]:
                    dlora_x = torch.mm(g, a_cat).mul_(scaling).view(x.shape)
            da_cat = _mm_fp32(g.T, lora_rows, scaling)
            db_cat = _mm_fp32(dy.T, t, scaling)
            for slot, (rank_slice, out_slice) in enumerate(ctx.slices):
                grads += [
                    da_cat[rank_slice].to(a_dtypes[slot]),
                    db_cat[out_slice, rank_slice].to(b_dtypes[slot]),
                ]
        if dx is not None:
            dx = dx.view(x.shape)
        return dx, dlora_x, None, None, None, None, None, None, None, *grads


class LoRAAFunction(torch.autograd.Function):
    """y = x @ W^T + bias and, beside it, t = lora_x @ A_cat^T; LoRA's B is the consumer's.

    Backward: dX = dY @ W + dt @ A_cat (in place), dA = dt^T @ lora_x. Arguments after
    `need_output` are the A's of the projections that carry LoRA.
    """

    @staticmethod
    def forward(ctx, x, lora_x, weights, biases, buffer, fp8, need_output, *lora_a):
        dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])
        lora_rows = rows if lora_x is None else lora_x.reshape(-1, x.shape[-1])
        out_features = sum(_out_features(w) for w in weights)
        a_cat = _a_cat(lora_a, dtype)
        t = lora_rows @ a_cat.T
        if need_output:
            out = _frozen_product(rows, weights, dtype, buffer, _stacked_bias(biases, weights, x), fp8)
        else:
            out = rows.new_empty(rows.shape[0], out_features)
        ctx.save_for_backward(x, lora_x, a_cat)
        ctx.weights, ctx.buffer, ctx.fp8 = weights, buffer, fp8
        ctx.ranks = [a.shape[0] for a in lora_a]
        ctx.grad_dtypes = [a.dtype for a in lora_a]
        lead = x.shape[:-1]
        return out.view(*lead, out_features), t.view(*lead, t.shape[1])

    @staticmethod
    def backward(ctx, grad_out, grad_t):
        x, lora_x, a_cat = ctx.saved_tensors
        dtype = x.dtype
        in_features = x.shape[-1]
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        dt = grad_t.reshape(-1, grad_t.shape[-1]).to(dtype)
        dx = dlora_x = None
        if ctx.needs_input_grad[0]:
            dx = _frozen_input_grad(dy, ctx.weights, dtype, ctx.buffer, ctx.fp8)
        if lora_x is None:
            lora_rows = x.reshape(-1, in_features)
            if dx is not None:
                dx.addmm_(dt, a_cat)
        else:
            lora_rows = lora_x.reshape(-1, in_features)
            if ctx.needs_input_grad[1]:
                dlora_x = (dt @ a_cat).view(x.shape)
        da_cat = _mm_fp32(dt.T, lora_rows, 1.0)
        grads, start = [], 0
        for rank, grad_dtype in zip(ctx.ranks, ctx.grad_dtypes, strict=True):
            grads.append(da_cat[start : start + rank].to(grad_dtype))
            start += rank
        return None if dx is None else dx.view(x.shape), dlora_x, None, None, None, None, None, *grads


class LoRABFunction(torch.autograd.Function):
    """y = x @ W^T + bias + scaling * t @ B^T for a t formed elsewhere (kernels.swiglu's down_t).

    Backward needs only t: dX = dY @ W with g = dY @ B as its extra columns, dt = scaling * g,
    dB = scaling * dY^T @ t. Arguments after `lora_index` are the B's of the projections with LoRA.
    """

    @staticmethod
    def forward(ctx, x, lora_t, scaling, weights, biases, buffer, fp8, need_output, lora_index, *lora_b):
        dtype = x.dtype
        rows = x.reshape(-1, x.shape[-1])
        t = lora_t.reshape(-1, lora_t.shape[-1]).to(dtype)
        out_features = sum(_out_features(w) for w in weights)
        slices = list(_lora_slices(weights, lora_index, [b.shape[1] for b in lora_b]))
        b_columns = _lora_b_columns(lora_b, slices, out_features, dtype)
        if need_output:
            out = _frozen_product(rows, weights, dtype, buffer, _stacked_bias(biases, weights, x), fp8)
            out.addmm_(t, b_columns.T, alpha=scaling)
        else:
            out = rows.new_empty(rows.shape[0], out_features)
        ctx.save_for_backward(lora_t, b_columns)
        ctx.grad_dtypes = [b.dtype for b in lora_b]
        ctx.x_shape, ctx.scaling, ctx.slices = x.shape, scaling, slices
        ctx.weights, ctx.buffer, ctx.fp8 = weights, buffer, fp8
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        lora_t, b_columns = ctx.saved_tensors
        weights, scaling, slices = ctx.weights, ctx.scaling, ctx.slices
        dtype = grad_out.dtype
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        t = lora_t.reshape(-1, lora_t.shape[-1]).to(dtype)
        dx, g = _dx_and_g(dy, weights, dtype, ctx.buffer, b_columns, ctx.needs_input_grad[0], ctx.fp8)
        dt = (g * scaling).to(lora_t.dtype).view(lora_t.shape)
        db_cat = _mm_fp32(dy.T, t, scaling)
        grads = [
            db_cat[out_slice, rank_slice].to(grad_dtype)
            for grad_dtype, (rank_slice, out_slice) in zip(ctx.grad_dtypes, slices, strict=True)
        ]
        dx = None if dx is None else dx.reshape(ctx.x_shape)
        return dx, dt, None, None, None, None, None, None, None, *grads


def _lora_slices(weights, lora_index, ranks):
    """(rank columns of t, output columns of y) for each projection with LoRA, of the given ranks."""
    out_starts = [0]
    for weight in weights:
        out_starts.append(out_starts[-1] + _out_features(weight))
    rank_start = 0
    for p, rank in zip(lora_index, ranks, strict=True):
        yield slice(rank_start, rank_start + rank), slice(out_starts[p], out_starts[p + 1])
        rank_start += rank


# ----------------------------------------------------------------------------- public


def _runs_function(x: torch.Tensor, fp8: FP8Scales | None) -> bool:
    """The Functions run where Triton does, and wherever FP8 products are asked for: the torch
    references compute in x.dtype, and kernels.fp8 runs its own references where Triton cannot."""
    return fp8 is not None or use_triton(x)


def _lora_index(lora_params) -> tuple[int, ...]:
    return tuple(p for p, tensor in enumerate(lora_params) if tensor is not None)


def lora_linear_a(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor | None],
    lora_x: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
    need_output: bool = True,
    fp8: FP8Scales | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x @ W^T + bias [..., sum(out_p)], t = lora_x @ A^T [..., sum(r_p)] or None without LoRA):
    the frozen projection with LoRA's first product only; whoever reads y adds t @ B^T."""
    _check_arguments(x, weights, biases, lora_a, None, lora_x)
    if lora_x is x:
        lora_x = None
    none = [None] * len(weights)
    lora_index = _lora_index(lora_a)
    if not lora_index:
        y = lora_linear(x, weights, biases, none, none, 0.0, buffer=buffer, need_output=need_output, fp8=fp8)
        return y, None
    if not _runs_function(x, fp8):
        return lora_linear_a_reference(x, weights, biases, lora_a, lora_x)
    present = [lora_a[p] for p in lora_index]
    return LoRAAFunction.apply(x, lora_x, tuple(weights), tuple(biases), buffer, fp8, need_output, *present)


def lora_linear_b(
    x: torch.Tensor,
    lora_t: torch.Tensor | None,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None],
    lora_b: Sequence[torch.Tensor | None],
    scaling: float,
    buffer: torch.Tensor | None = None,
    need_output: bool = True,
    fp8: FP8Scales | None = None,
) -> torch.Tensor:
    """x @ W^T + bias + scaling * lora_t @ B^T, lora_t's columns being the ranks of the B's given
    in order. need_output=False skips the GEMM as in `lora_linear`; backward never reads x."""
    _check_arguments(x, weights, biases, None, lora_b, None)
    none = [None] * len(weights)
    lora_index = _lora_index(lora_b)
    if not lora_index:
        return lora_linear(
            x, weights, biases, none, none, 0.0, buffer=buffer, need_output=need_output, fp8=fp8
        )
    present = [lora_b[p] for p in lora_index]
    ranks = sum(b.shape[1] for b in present)
    if lora_t is None or lora_t.shape[:-1] != x.shape[:-1] or lora_t.shape[-1] != ranks:
        raise ValueError(f"lora_t must be [..., {ranks}] beside x {tuple(x.shape)}")
    if not _runs_function(x, fp8):
        return lora_linear_b_reference(x, lora_t, weights, biases, lora_b, scaling)
    return LoRABFunction.apply(
        x, lora_t, scaling, tuple(weights), tuple(biases), buffer, fp8, need_output, lora_index, *present
    )


def lora_linear(
    x: torch.Tensor,
    weights: Sequence[FrozenWeight],
    biases: Sequence[torch.Tensor | None],
    lora_a: Sequence[torch.Tensor | None],
    lora_b: Sequence[torch.Tensor | None],
    scaling: float,
    lora_x: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
    need_output: bool = True,
    fp8: FP8Scales | None = None,
) -> torch.Tensor:
    """x [..., in] -> [..., sum(out_p)]; `lora_x` is the LoRA branch input (x after dropout,
    default x); `buffer` is a scratch tensor of x.dtype reused across layers (see buffer_numel).

    need_output=False, for a checkpoint recompute, which only needs what backward saves, skips
    the GEMM and returns an uninitialised tensor of the output's shape (the fused path only).
    `fp8`, the group's scales (kernels.fp8.fp8_scales), multiplies the frozen weights in e4m3.
    """
    _check_arguments(x, weights, biases, lora_a, lora_b, lora_x)
    if lora_x is x:
        lora_x = None
    if not _runs_function(x, fp8):
        return lora_linear_reference(x, weights, biases, lora_a, lora_b, scaling, lora_x)
    lora_index = tuple(p for p, a in enumerate(lora_a) if a is not None)
    lora_params = [tensor for p in lora_index for tensor in (lora_a[p], lora_b[p])]
    return LoRALinearFunction.apply(
        x, lora_x, scaling, tuple(weights), tuple(biases), buffer, fp8, need_output, lora_index, *lora_params
    )
