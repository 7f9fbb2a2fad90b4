"""Causal depthwise conv1d over time with SiLU: Qwen3.5's short convolution before the delta rule.

Channels stay last ([B, T, C], as the QKV projection writes them), so the kernels never transpose.
The window never reaches across a document start in a packed row: tokens of the previous document
read as zeros, exactly as if each document were convolved alone.
"""

import torch
import torch.nn.functional as F

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import document_index, documents_per_token, unit_last_stride

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return z
    if activation == "silu":
        return F.silu(z)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """y[t] = act(bias + sum_j weight[:, K-1-j] * x[t-j]) in fp32, x[t-j] zero before t's document."""
    width = weight.shape[1]
    h, w = x.float(), weight.float()
    docs = None if doc_ids is None else document_index(doc_ids)
    z = h * w[:, width - 1]
    for shift in range(1, min(width, x.shape[1] + 1)):
        earlier = F.pad(h[:, :-shift], (0, 0, shift, 0))
        if docs is not None:
            same = torch.zeros_like(docs, dtype=torch.bool)
            same[:, shift:] = docs[:, shift:] == docs[:, :-shift]
            earlier = torch.where(same[..., None], earlier, 0.0)
        z = z + earlier * w[:, width - 1 - shift]
    if bias is not None:
        z = z + bias.float()
    return _activate(z, activation).to(x.dtype)


def causal_conv1d_step_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token x [B, C]; conv_state [B, C, S] (S >= K-1) holds the last S inputs, oldest
    first, and is shifted left by one with x appended, in place (transformers' cache keeps S = K)."""
    width, state_len = weight.shape[1], conv_state.shape[-1]
    window = torch.cat([conv_state[:, :, state_len - (width - 1) :].float(), x.float()[:, :, None]], dim=-1)
    z = (window * weight.float()).sum(-1)
    if bias is not None:
        z = z + bias.float()
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], dim=-1))
    return _activate(z, activation).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _conv_preactivation(
        x_ptr,
        w_ptr,
        bias_ptr,
        docs_ptr,
        t,
        c,
        seq,
        channels,
        x_stride_t,
        docs_stride_t,
        WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """fp32 bias + sum_j w[:, K-1-j] x[t-j] for a [BLOCK_T, BLOCK_C] tile, zeros past t's document."""
        c_mask = c < channels
        t_mask = (t >= 0) & (t < seq)
        doc = tl.load(docs_ptr + t * docs_stride_t, mask=t_mask, other=-1)
        z = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            src = t - j
            src_ok = t_mask & (src >= 0)
            src_doc = tl.load(docs_ptr + src * docs_stride_t, mask=src_ok, other=-2)
            ok = src_ok & (src_doc == doc)
            x = tl.load(
                x_ptr + src[:, None] * x_stride_t + c[None, :], mask=ok[:, None] & c_mask[None, :], other=0.0
            )
            w = tl.load(w_ptr + c * WIDTH + (WIDTH - 1 - j), mask=c_mask, other=0.0)
            z += x.to(tl.float32) * w.to(tl.float32)[None, :]
        if HAS_BIAS:
            z += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        return z

    @triton.jit
    def _conv_fwd_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        docs_ptr,
        y_ptr,
        seq,
        channels,
        x_stride_b,
        x_stride_t,
        docs_stride_b,
        docs_stride_t,
        WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        batch = tl.program_id(2).to(tl.int64)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        z = _conv_preactivation(
            x_ptr + batch * x_stride_b,
            w_ptr,
            bias_ptr,
            docs_ptr + batch * docs_stride_b,
            t,
            c,
            seq,
            channels,
            x_stride_t,
            docs_stride_t,
            WIDTH,
            HAS_BIAS,
            BLOCK_T,
            BLOCK_C,
        )
        if SILU:
            z = z * tl.sigmoid(z)
        mask = (t < seq)[:, None] & (c < channels)[None, :]
        y_ptrs = y_ptr + (batch * seq + t[:, None]) * channels + c[None, :]
        tl.store(y_ptrs, z.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_bwd_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        docs_ptr,
        dy_ptr,
        dx_ptr,
        dw_partial_ptr,
        dbias_partial_ptr,
        seq,
        channels,
        chunk,
        x_stride_b,
        x_stride_t,
        docs_stride_b,
        docs_stride_t,
        dy_stride_b,
        dy_stride_t,
        WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Walks `chunk` tokens of BLOCK_C channels backwards in time, one token row at a time, with the
        last WIDTH inputs and the next WIDTH-1 pre-activation gradients dz in registers: each z is
        computed once and each x and dy row read once (a tile of tokens would recompute z for every
        tap, K times, and spilled at 255 registers on sm_90). The walk starts at least 2(WIDTH-1)
        rows past the chunk, rounded up to whole loads of ROWS rows: the first rows only fill the
        input window, the last WIDTH-1 of them give the dz that the chunk's last dx rows read. All
        ROWS rows of a load are issued before any is used, so their latencies overlap. dW and dbias
        add up in fp32 registers and are stored once, as this program's partial."""
        chunk_id = tl.program_id(1)
        batch = tl.program_id(2).to(tl.int64)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = c < channels
        x_ptr += batch * x_stride_b
        docs_ptr += batch * docs_stride_b
        dy_ptr += batch * dy_stride_b
        start = chunk_id * chunk
        end = tl.minimum(start + chunk, seq)
        steps = tl.cdiv(end - start + 2 * (WIDTH - 1), ROWS)
        top = start + steps * ROWS - 1
        # Tap j multiplies x[t - j]; xs[j] = x[r - j] and docs[i] = doc[r + WIDTH - 1 - i] at row r.
        w = ()
        xs = ()
        grad_w = ()
        for j in tl.static_range(WIDTH):
            w += (tl.load(w_ptr + c * WIDTH + (WIDTH - 1 - j), mask=c_mask, other=0.0).to(tl.float32),)
            xs += (tl.zeros([BLOCK_C], dtype=tl.float32),)
            grad_w += (tl.zeros([BLOCK_C], dtype=tl.float32),)
        dzs = ()
        for _ in tl.static_range(WIDTH - 1):
            dzs += (tl.zeros([BLOCK_C], dtype=tl.float32),)
        docs = ()
        for _ in tl.static_range(2 * WIDTH - 1):
            docs += (tl.full([], -1, tl.int32),)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        grad_bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        for step in tl.range(0, steps):
            high = top - step * ROWS
            new_x = ()
            new_doc = ()
            dys = ()
            for k in tl.static_range(ROWS):
                row = high - k
                src = row - (WIDTH - 1)
                # Rows outside [0, seq) are read clamped, under document -1, which no token has: the
                # document tests below drop them from every z and dx, and they are never owned.
                src_row = tl.minimum(tl.maximum(src, 0), seq - 1).to(tl.int64)
                new_x += (tl.load(x_ptr + src_row * x_stride_t + c, mask=c_mask, other=0.0),)
                new_doc += (
                    tl.where((src >= 0) & (src < seq), tl.load(docs_ptr + src_row * docs_stride_t), -1),
                )
                dy_row = tl.minimum(row, seq - 1).to(tl.int64)
                dys += (tl.load(dy_ptr + dy_row * dy_stride_t + c, mask=c_mask, other=0.0),)
            for k in tl.static_range(ROWS):
                row = high - k
                xs = xs[1:] + (new_x[k].to(tl.float32),)
                docs = docs[1:] + (new_doc[k],)
                doc = docs[WIDTH - 1]
                z = bias
                seen = ()
                for j in tl.static_range(WIDTH):
                    seen += (tl.where(docs[WIDTH - 1 + j] == doc, xs[j], 0.0),)
                    z += w[j] * seen[j]
                dz = dys[k].to(tl.float32)
                if SILU:
                    sig = tl.sigmoid(z)
                    dz = dz * sig * (1.0 + z * (1.0 - sig))
                # Rows past the chunk only feed its dx; their dW and dbias belong to the next chunk.
                owned = row < end
                dz_owned = tl.where(owned, dz, 0.0)
                for j in tl.static_range(WIDTH):
                    grad_w = grad_w[:j] + (grad_w[j] + dz_owned * seen[j],) + grad_w[j + 1 :]
                grad_bias += dz_owned
                dx = w[0] * dz
                for s in tl.static_range(1, WIDTH):
                    dx += w[s] * tl.where(docs[WIDTH - 1 - s] == doc, dzs[s - 1], 0.0)
                dx_ptrs = dx_ptr + (batch * seq + row) * channels + c
                # One bound on c for the row's mask: Triton's interpreter cannot AND a scalar into a vector.
                tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=c < tl.where(owned, channels, 0))
                dzs = (dz,) + dzs[:-1]
        partial = (tl.program_id(2) * tl.num_programs(1) + chunk_id).to(tl.int64)
        for j in tl.static_range(WIDTH):
            tl.store(
                dw_partial_ptr + (partial * WIDTH + (WIDTH - 1 - j)) * channels + c, grad_w[j], mask=c_mask
            )
        if HAS_BIAS:
            tl.store(dbias_partial_ptr + partial * channels + c, grad_bias, mask=c_mask)

    @triton.jit
    def _conv_step_kernel(
        x_ptr,
        state_ptr,
        w_ptr,
        bias_ptr,
        y_ptr,
        channels,
        state_len,
        x_stride_b,
        state_stride_b,
        state_stride_c,
        state_stride_s,
        WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """The old state is read whole before the shifted one is written, by the program that owns
        these channels, so the in-place update needs no second buffer."""
        batch = tl.program_id(1).to(tl.int64)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols = tl.arange(0, BLOCK_S)
        c_mask = c < channels
        state_ptrs = state_ptr + batch * state_stride_b + c[:, None] * state_stride_c
        x = tl.load(x_ptr + batch * x_stride_b + c, mask=c_mask, other=0.0)
        old = tl.load(
            state_ptrs + cols[None, :] * state_stride_s,
            mask=c_mask[:, None] & (cols < state_len)[None, :],
            other=0.0,
        )
        shifted = tl.load(
            state_ptrs + (cols[None, :] + 1) * state_stride_s,
            mask=c_mask[:, None] & (cols + 1 < state_len)[None, :],
            other=0.0,
        )
        # Column `col` of the old state multiplies weight[:, col - (S - (K - 1))] when that is >= 0.
        w_cols = cols - (state_len - (WIDTH - 1))
        w_map = tl.load(
            w_ptr + c[:, None] * WIDTH + w_cols[None, :],
            mask=c_mask[:, None] & ((w_cols >= 0) & (cols < state_len))[None, :],
            other=0.0,
        )
        w_last = tl.load(w_ptr + c * WIDTH + (WIDTH - 1), mask=c_mask, other=0.0).to(tl.float32)
        z = tl.sum(old.to(tl.float32) * w_map.to(tl.float32), axis=1) + w_last * x.to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        if SILU:
            z = z * tl.sigmoid(z)
        new = tl.where((cols == state_len - 1)[None, :], x.to(old.dtype)[:, None], shifted)
        tl.store(
            state_ptrs + cols[None, :] * state_stride_s,
            new,
            mask=c_mask[:, None] & (cols < state_len)[None, :],
        )
        tl.store(y_ptr + batch * channels + c, z.to(y_ptr.dtype.element_ty), mask=c_mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

_BLOCK_T, _BLOCK_C = 32, 128
# Backward: a program per 256 channels (2 warps, 4 channels a thread: 8-byte bf16 loads) and 128 tokens,
# loading 8 rows ahead (4 in fp32, which spills at 8: 255 registers on sm_90). Its dW partials are
# [B * T / 128, K, C] fp32, 1/16 of x's bytes at K = 4 in bf16.
_BWD_BLOCK_C, _BWD_CHUNK_T, _BWD_ROW_BYTES = 256, 128, 16


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [C={x.shape[-1]}, K], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [C={x.shape[-1]}], got shape {tuple(bias.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if not x.is_floating_point():
        raise TypeError(f"causal_conv1d needs a floating-point input, got {x.dtype}")


def _grid(x: torch.Tensor) -> tuple[int, int, int]:
    batch, seq, channels = x.shape
    return triton.cdiv(seq, _BLOCK_T), triton.cdiv(channels, _BLOCK_C), batch


def _conv_forward(x, weight, bias, docs, activation) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _conv_fwd_kernel[_grid(x)](
        x,
        weight,
        weight if bias is None else bias,
        docs,
        y,
        x.shape[1],
        x.shape[2],
        x.stride(0),
        x.stride(1),
        docs.stride(0),
        docs.stride(1),
        WIDTH=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_T=_BLOCK_T,
        BLOCK_C=_BLOCK_C,
    )
    return y


def _conv_backward(dy, x, weight, bias, docs, activation):
    dy = unit_last_stride(dy)
    batch, seq, channels = x.shape
    width = weight.shape[1]
    grid = (triton.cdiv(channels, _BWD_BLOCK_C), triton.cdiv(seq, _BWD_CHUNK_T), batch)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partials = batch * grid[1]
    dw_partial = torch.empty(partials, width, channels, dtype=torch.float32, device=x.device)
    dbias_partial = (
        None if bias is None else torch.empty(partials, channels, dtype=torch.float32, device=x.device)
    )
    _conv_bwd_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        docs,
        dy,
        dx,
        dw_partial,
        dw_partial if bias is None else dbias_partial,
        seq,
        channels,
        _BWD_CHUNK_T,
        x.stride(0),
        x.stride(1),
        docs.stride(0),
        docs.stride(1),
        dy.stride(0),
        dy.stride(1),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        ROWS=_BWD_ROW_BYTES // x.element_size(),
        BLOCK_C=_BWD_BLOCK_C,
        num_warps=_BWD_BLOCK_C // 128,
    )
    # Partials summed by torch in one fixed order: dW and dbias are the same bits run to run.
    dweight = dw_partial.sum(0).t().to(weight.dtype, memory_format=torch.contiguous_format)
    return dx, dweight, None if bias is None else dbias_partial.sum(0).to(bias.dtype)


def _conv_step(x, conv_state, weight, bias, activation) -> torch.Tensor:
    batch, channels = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    if conv_state.shape[:2] != (batch, channels) or state_len < width - 1:
        raise ValueError(
            f"conv_state must be [B={batch}, C={channels}, S >= K-1={width - 1}], got {tuple(conv_state.shape)}"
        )
    x = unit_last_stride(x)
    y = torch.empty_like(x)
    _conv_step_kernel[(triton.cdiv(channels, _BLOCK_C), batch)](
        x,
        conv_state,
        weight,
        weight if bias is None else bias,
        y,
        channels,
        state_len,
        x.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_C=_BLOCK_C,
        BLOCK_S=triton.next_power_of_2(state_len),
    )
    return y


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, docs, activation):
        x, weight = unit_last_stride(x), weight.contiguous()
        ctx.save_for_backward(x, weight, bias, docs)
        ctx.activation = activation
        return _conv_forward(x, weight, bias, docs, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, docs = ctx.saved_tensors
        dx, dweight, dbias = _conv_backward(dy, x, weight, bias, docs, ctx.activation)
        return dx, dweight, dbias, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x [B, T, C], weight [C, K] (nn.Conv1d's [C, 1, K] squeezed), bias [C] or None (Qwen3.5 has
    none), doc_ids int [B, T] or None; returns y [B, T, C] in x's dtype, computed in fp32."""
    _check(x, weight, bias, activation)
    if use_triton(x):
        return CausalConv1dFunction.apply(x, weight, bias, documents_per_token(doc_ids, x), activation)
    return causal_conv1d_reference(x, weight, bias, doc_ids, activation)


def causal_conv1d_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token x [B, C] -> y [B, C]; conv_state [B, C, S] is updated in place (see the
    reference). No host syncs and no value-dependent allocation, so a CUDA graph can capture it."""
    if use_triton(x):
        return _conv_step(x, conv_state, weight.contiguous(), bias, activation)
    return causal_conv1d_step_reference(x, conv_state, weight, bias, activation)
