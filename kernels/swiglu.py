"""SwiGLU on the gate/up projection's output, with the MLP's LoRA work that touches it fused in.

    gate = gate_base + s * t_gate @ B_gate^T        up = up_base + s * t_up @ B_up^T
    h = silu(gate) * up                              down_t = h @ A_down^T

The gate/up projection hands over its frozen output and t = x @ A^T; the down projection takes
h and down_t. Done here, LoRA's products ride on the passes SwiGLU makes over the wide
[tokens, 2 * intermediate] tensors anyway, and the projections' GEMMs keep their natural shape:
B as extra K columns made the gate/up GEMM's K 3,584 + 32 at Qwen2.5-7B, about 240 us slower,
plus 115 us for the copy [x | t]. Backward works the same way: one pass over dh, gate and up
gives dgate_up, and, as sums over tokens, B_gate's and B_up's gradients and A_down's (from
down_t's gradient and the recomputed h). So the down projection keeps only down_t for its
backward, not h. The same pass adds t's gradient, dgate @ B, across its programs with atomics:
two skinny GEMMs over dgate_up did that before, a second read of 620 MB at 7B.

Neither h nor silu(gate) is kept: backward recomputes them from the saved gate/up. A checkpoint
recompute needs only down_t (need_output=False skips writing h).
"""

import torch
import torch.nn.functional as F

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import as_rows

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def lora_swiglu_reference(
    gate_up: torch.Tensor,
    lora_t: torch.Tensor | None = None,
    gate_b: torch.Tensor | None = None,
    up_b: torch.Tensor | None = None,
    scaling: float = 0.0,
    down_a: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF Qwen2MLP with PEFT's LoRA: act_fn(gate) * up, then down_proj's lora_A product.

    lora_t's columns are the ranks of the B's given, gate's first.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    dtype = gate_up.dtype
    t_gate, t_up = _split_ranks(lora_t, gate_b, up_b)
    if gate_b is not None:
        gate = gate + scaling * (t_gate @ gate_b.to(dtype).T)
    if up_b is not None:
        up = up + scaling * (t_up @ up_b.to(dtype).T)
    h = F.silu(gate) * up
    down_t = None if down_a is None else h @ down_a.to(dtype).T
    return h, down_t


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    return lora_swiglu_reference(gate_up)[0]


def _split_ranks(lora_t, gate_b, up_b):
    """(t columns of gate's B, of up's B): gate's ranks come first in lora_t."""
    gate_rank = 0 if gate_b is None else gate_b.shape[1]
    t_gate = None if gate_b is None else lora_t[..., :gate_rank]
    t_up = None if up_b is None else lora_t[..., gate_rank : gate_rank + up_b.shape[1]]
    return t_gate, t_up


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _load_b(b_ptr, cols, col_mask, ranks, rank):
        """B[cols] [BLOCK_N, RANK_BLOCK] of a row-major B [n_cols, rank], zero past the edges."""
        return tl.load(
            b_ptr + cols[:, None] * rank + ranks[None, :],
            mask=col_mask[:, None] & (ranks[None, :] < rank),
            other=0.0,
        )

    @triton.jit
    def _lora_add(base, t, b, scaling, PRECISION: tl.constexpr):
        """base + scaling * t @ b^T; the product accumulates in fp32."""
        return base + scaling * tl.dot(t, tl.trans(b), input_precision=PRECISION)

    @triton.jit
    def _lora_swiglu_fwd_kernel(
        gate_up_ptr,
        t_gate_ptr,
        t_up_ptr,
        gate_b_ptr,
        up_b_ptr,
        down_a_ptr,
        h_ptr,
        down_t_ptr,
        n_rows,
        n_cols,
        cols_per_split,
        gate_up_stride,
        t_stride,
        rank,
        down_rank,
        scaling,
        GATE_LORA: tl.constexpr,
        UP_LORA: tl.constexpr,
        DOWN_LORA: tl.constexpr,
        STORE_H: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        RANK_BLOCK: tl.constexpr,
        DOWN_RANK_BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program: BLOCK_T tokens across one split of the columns; it writes its split's part of
        down_t's sum over columns in fp32, and the launcher adds the splits."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        first_col = split * cols_per_split
        row_mask = rows < n_rows
        ranks = tl.arange(0, RANK_BLOCK)
        t_mask = row_mask[:, None] & (ranks[None, :] < rank)
        if GATE_LORA:
            t_gate = tl.load(t_gate_ptr + rows[:, None] * t_stride + ranks[None, :], mask=t_mask, other=0.0)
        if UP_LORA:
            t_up = tl.load(t_up_ptr + rows[:, None] * t_stride + ranks[None, :], mask=t_mask, other=0.0)
        down_ranks = tl.arange(0, DOWN_RANK_BLOCK)
        down_t = tl.zeros([BLOCK_T, DOWN_RANK_BLOCK], dtype=tl.float32)
        for start in range(first_col, first_col + cols_per_split, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            gate_ptrs = gate_up_ptr + rows[:, None] * gate_up_stride + cols[None, :]
            gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
            if GATE_LORA:
                gate = _lora_add(
                    gate, t_gate, _load_b(gate_b_ptr, cols, col_mask, ranks, rank), scaling, PRECISION
                )
            if UP_LORA:
                up = _lora_add(up, t_up, _load_b(up_b_ptr, cols, col_mask, ranks, rank), scaling, PRECISION)
            h = (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty)
            if STORE_H:
                tl.store(h_ptr + rows[:, None] * n_cols + cols[None, :], h, mask=mask)
            if DOWN_LORA:
                a_t = tl.load(
                    down_a_ptr + down_ranks[None, :] * n_cols + cols[:, None],
                    mask=col_mask[:, None] & (down_ranks[None, :] < down_rank),
                    other=0.0,
                )
                down_t += tl.dot(h, a_t, input_precision=PRECISION)
        if DOWN_LORA:
            tl.store(
                down_t_ptr + (split * n_rows + rows[:, None]) * down_rank + down_ranks[None, :],
                down_t,
                mask=row_mask[:, None] & (down_ranks[None, :] < down_rank),
            )

    @triton.jit
    def _lora_swiglu_bwd_kernel(
        dh_ptr,
        down_dt_ptr,
        gate_up_ptr,
        t_gate_ptr,
        t_up_ptr,
        gate_b_ptr,
        up_b_ptr,
        down_a_ptr,
        dgate_up_ptr,
        dgate_b_ptr,
        dup_b_ptr,
        ddown_a_ptr,
        dt_gate_ptr,
        dt_up_ptr,
        n_rows,
        n_cols,
        rows_per_split,
        dh_stride,
        gate_up_stride,
        t_stride,
        rank,
        down_rank,
        scaling,
        GATE_LORA: tl.constexpr,
        UP_LORA: tl.constexpr,
        DOWN_LORA: tl.constexpr,
        LORA_T_GRAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        RANK_BLOCK: tl.constexpr,
        DOWN_RANK_BLOCK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program: BLOCK_N columns down one split of the tokens; it writes its split's part of
        the weight gradients' sums over tokens in fp32, without atomics, and the launcher adds the
        splits. lora_t's gradient, a sum over columns, is added across programs with fp32 atomics
        (LORA_T_GRAD), so its summation order varies from run to run."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        first_row = split * rows_per_split
        col_mask = cols < n_cols
        ranks = tl.arange(0, RANK_BLOCK)
        down_ranks = tl.arange(0, DOWN_RANK_BLOCK)
        down_rank_mask = down_ranks < down_rank
        if DOWN_LORA:
            down_a = tl.load(
                down_a_ptr + down_ranks[:, None] * n_cols + cols[None, :],
                mask=down_rank_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
        if GATE_LORA:
            gate_b = _load_b(gate_b_ptr, cols, col_mask, ranks, rank)
        if UP_LORA:
            up_b = _load_b(up_b_ptr, cols, col_mask, ranks, rank)
        dgate_b = tl.zeros([BLOCK_N, RANK_BLOCK], dtype=tl.float32)
        dup_b = tl.zeros([BLOCK_N, RANK_BLOCK], dtype=tl.float32)
        ddown_a = tl.zeros([DOWN_RANK_BLOCK, BLOCK_N], dtype=tl.float32)
        for start in range(first_row, first_row + rows_per_split, BLOCK_T):
            rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            t_mask = row_mask[:, None] & (ranks[None, :] < rank)
            gate_ptrs = gate_up_ptr + rows[:, None] * gate_up_stride + cols[None, :]
            gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
            t_offsets = rows[:, None] * t_stride + ranks[None, :]
            if GATE_LORA:
                t_gate = tl.load(t_gate_ptr + t_offsets, mask=t_mask, other=0.0)
                gate = _lora_add(gate, t_gate, gate_b, scaling, PRECISION)
            if UP_LORA:
                t_up = tl.load(t_up_ptr + t_offsets, mask=t_mask, other=0.0)
                up = _lora_add(up, t_up, up_b, scaling, PRECISION)
            dh_ptrs = dh_ptr + rows[:, None] * dh_stride + cols[None, :]
            dh = tl.load(dh_ptrs, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            if DOWN_LORA:
                down_dt = tl.load(
                    down_dt_ptr + rows[:, None] * down_rank + down_ranks[None, :],
                    mask=row_mask[:, None] & down_rank_mask[None, :],
                    other=0.0,
                )
                dh += tl.dot(down_dt, down_a, input_precision=PRECISION)
                h = (silu * up).to(down_dt.dtype)
                ddown_a += tl.dot(tl.trans(down_dt), h, input_precision=PRECISION)
            dgate = (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(dgate_up_ptr.dtype.element_ty)
            dup = (dh * silu).to(dgate_up_ptr.dtype.element_ty)
            dgate_ptrs = dgate_up_ptr + rows[:, None] * (2 * n_cols) + cols[None, :]
            tl.store(dgate_ptrs, dgate, mask=mask)
            tl.store(dgate_ptrs + n_cols, dup, mask=mask)
            if GATE_LORA:
                dgate_b += tl.dot(tl.trans(dgate), t_gate, input_precision=PRECISION)
                if LORA_T_GRAD:
                    dt_gate = scaling * tl.dot(dgate, gate_b, input_precision=PRECISION)
                    tl.atomic_add(dt_gate_ptr + t_offsets, dt_gate, mask=t_mask, sem="relaxed")
            if UP_LORA:
                dup_b += tl.dot(tl.trans(dup), t_up, input_precision=PRECISION)
                if LORA_T_GRAD:
                    dt_up = scaling * tl.dot(dup, up_b, input_precision=PRECISION)
                    tl.atomic_add(dt_up_ptr + t_offsets, dt_up, mask=t_mask, sem="relaxed")
        b_ptrs = (split * n_cols + cols[:, None]) * rank + ranks[None, :]
        b_mask = col_mask[:, None] & (ranks[None, :] < rank)
        if GATE_LORA:
            tl.store(dgate_b_ptr + b_ptrs, dgate_b * scaling, mask=b_mask)
        if UP_LORA:
            tl.store(dup_b_ptr + b_ptrs, dup_b * scaling, mask=b_mask)
        if DOWN_LORA:
            tl.store(
                ddown_a_ptr + (split * down_rank + down_ranks[:, None]) * n_cols + cols[None, :],
                ddown_a,
                mask=down_rank_mask[:, None] & col_mask[None, :],
            )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

_FWD_BLOCK_T, _FWD_BLOCK_N = 64, 64
_BWD_BLOCK_T, _BWD_BLOCK_N = 64, 64
# Both passes are bound by memory, and one program a row (or column) of tiles is too few to keep
# HBM busy: 128 programs at 8,192 tokens. With LoRA, each pass is split along the dimension it
# sums over until about this many programs run, and the fp32 partial sums (a few MB at most)
# are added afterwards. Timed at Qwen2.5-7B on an H200 (benchmarks/RESULTS.md).
_FWD_PROGRAMS = 1024
_BWD_PROGRAMS = 2048


def _splits(blocks: int, programs: int, reduced: bool, target: int) -> tuple[int, int]:
    """(splits, blocks per split) of `blocks` so `programs` x splits reaches `target`; with
    nothing summed along them (no LoRA), every block is its own program."""
    if not reduced:
        return blocks, 1
    splits = min(blocks, max(1, triton.cdiv(target, programs)))
    per_split = triton.cdiv(blocks, splits)
    return triton.cdiv(blocks, per_split), per_split


def _rank_block(rank: int) -> int:
    """tl.dot takes no dimension under 16."""
    return max(16, triton.next_power_of_2(max(rank, 1)))


def _check(gate_up, lora_t, gate_b, up_b, down_a) -> None:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {gate_up.shape[-1]}")
    if not gate_up.is_floating_point():
        raise TypeError(f"swiglu needs a floating-point input, got {gate_up.dtype}")
    intermediate = gate_up.shape[-1] // 2
    ranks = [b.shape[1] for b in (gate_b, up_b) if b is not None]
    for name, b in (("gate_b", gate_b), ("up_b", up_b)):
        if b is not None and (b.dim() != 2 or b.shape[0] != intermediate):
            raise ValueError(f"{name} must be [{intermediate}, rank], got {tuple(b.shape)}")
    if len(set(ranks)) > 1:
        raise ValueError(f"gate_b and up_b must share one rank, got {ranks}")
    if ranks and (
        lora_t is None or lora_t.shape[:-1] != gate_up.shape[:-1] or lora_t.shape[-1] != sum(ranks)
    ):
        raise ValueError(f"lora_t must be [..., {sum(ranks)}] beside gate_up {tuple(gate_up.shape)}")
    if down_a is not None and (down_a.dim() != 2 or down_a.shape[1] != intermediate):
        raise ValueError(f"down_a must be [rank, {intermediate}], got {tuple(down_a.shape)}")


def _in_dtype(dtype: torch.dtype, *matrices):
    """The LoRA matrices contiguous in the compute dtype (a no-op for those that already are)."""
    return [None if m is None else m.to(dtype).contiguous() for m in matrices]


class _Operands:
    """What both passes hand their kernel: gate_up and t as rows, the B's and A in the compute
    dtype (gate_up itself stands in for an absent one: the kernel never reads it), ranks, flags."""

    def __init__(self, gate_up, lora_t, gate_b, up_b, down_a):
        self.gate_up = as_rows(gate_up)
        self.n_rows, self.n_cols = self.gate_up.shape[0], self.gate_up.shape[1] // 2
        self.dtype, self.device = gate_up.dtype, gate_up.device
        self.t = self.gate_up if lora_t is None else as_rows(lora_t)
        self.rank = next((b.shape[1] for b in (gate_b, up_b) if b is not None), 0)
        self.down_rank = 0 if down_a is None else down_a.shape[0]
        self.present = (gate_b is not None, up_b is not None, down_a is not None)
        self.matrices = [
            self.gate_up if m is None else m for m in _in_dtype(self.dtype, gate_b, up_b, down_a)
        ]

    @property
    def up_start(self) -> int:
        """The first of up's ranks in t: they follow gate's."""
        return self.rank if self.present[0] else 0

    def inputs(self) -> list:
        """gate_up, t_gate, t_up, B_gate, B_up, A_down."""
        return [self.gate_up, self.t, self.t[:, self.up_start :], *self.matrices]

    def flags(self) -> dict:
        gate, up, down = self.present
        return dict(
            GATE_LORA=gate,
            UP_LORA=up,
            DOWN_LORA=down,
            RANK_BLOCK=_rank_block(self.rank),
            DOWN_RANK_BLOCK=_rank_block(self.down_rank),
            # fp32 keeps full precision in LoRA's products (tf32 would cost about three digits).
            PRECISION="ieee" if self.dtype == torch.float32 else "tf32",
        )


def _swiglu_forward(gate_up, lora_t, gate_b, up_b, scaling, down_a, need_output):
    ops = _Operands(gate_up, lora_t, gate_b, up_b, down_a)
    n_rows, n_cols, down = ops.n_rows, ops.n_cols, ops.present[2]
    if need_output:
        h = torch.empty((n_rows, n_cols), dtype=ops.dtype, device=ops.device)
    else:
        # h's shape without its memory: 310 MB at Qwen2.5-7B's 8,192 tokens, during a recompute.
        h = ops.gate_up.new_empty(1).expand(n_rows, n_cols)
    row_blocks = triton.cdiv(n_rows, _FWD_BLOCK_T)
    splits, blocks_per_split = _splits(triton.cdiv(n_cols, _FWD_BLOCK_N), row_blocks, down, _FWD_PROGRAMS)
    partial = (
        torch.empty((splits, n_rows, ops.down_rank), dtype=torch.float32, device=ops.device) if down else None
    )
    _lora_swiglu_fwd_kernel[(row_blocks, splits)](
        *ops.inputs(),
        h,
        h if partial is None else partial,
        n_rows,
        n_cols,
        blocks_per_split * _FWD_BLOCK_N,
        ops.gate_up.stride(0),
        ops.t.stride(0),
        ops.rank,
        ops.down_rank,
        float(scaling),
        STORE_H=need_output,
        BLOCK_T=_FWD_BLOCK_T,
        BLOCK_N=_FWD_BLOCK_N,
        **ops.flags(),
    )
    return h, None if partial is None else partial.sum(0).to(ops.dtype)


def _swiglu_backward(dh, down_dt, gate_up, lora_t, gate_b, up_b, scaling, down_a, lora_t_grad=False):
    """(dgate_up, dB_gate, dB_up, dA_down, dlora_t): the weight gradients in fp32, None where
    absent; dlora_t [rows, ranks] in fp32 only with lora_t_grad."""
    ops = _Operands(gate_up, lora_t, gate_b, up_b, down_a)
    n_rows, n_cols = ops.n_rows, ops.n_cols
    dh2d = as_rows(dh)
    down_dt2d = dh2d if down_dt is None else as_rows(down_dt.to(ops.dtype))
    dgate_up = torch.empty((n_rows, 2 * n_cols), dtype=ops.dtype, device=ops.device)
    col_blocks = triton.cdiv(n_cols, _BWD_BLOCK_N)
    row_blocks = triton.cdiv(n_rows, _BWD_BLOCK_T)
    splits, blocks_per_split = _splits(row_blocks, col_blocks, any(ops.present), _BWD_PROGRAMS)
    shapes = ((n_cols, ops.rank), (n_cols, ops.rank), (ops.down_rank, n_cols))
    grads = [
        torch.empty((splits, *shape), dtype=torch.float32, device=ops.device) if present else None
        for shape, present in zip(shapes, ops.present, strict=True)
    ]
    # lora_t's gradient takes t's row stride, so both are addressed alike in the kernel.
    dt = (
        torch.zeros((n_rows, ops.t.stride(0)), dtype=torch.float32, device=ops.device)
        if lora_t_grad
        else None
    )
    _lora_swiglu_bwd_kernel[(col_blocks, splits)](
        dh2d,
        down_dt2d,
        *ops.inputs(),
        dgate_up,
        *(dgate_up if grad is None else grad for grad in grads),
        *((dgate_up, dgate_up) if dt is None else (dt, dt[:, ops.up_start :])),
        n_rows,
        n_cols,
        blocks_per_split * _BWD_BLOCK_T,
        dh2d.stride(0),
        ops.gate_up.stride(0),
        ops.t.stride(0),
        ops.rank,
        ops.down_rank,
        float(scaling),
        LORA_T_GRAD=lora_t_grad,
        BLOCK_T=_BWD_BLOCK_T,
        BLOCK_N=_BWD_BLOCK_N,
        **ops.flags(),
    )
    dlora_t = None if dt is None else dt[:, : lora_t.shape[-1]]
    return dgate_up, *(None if grad is None else grad.sum(0) for grad in grads), dlora_t


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class LoRASwiGLUFunction(torch.autograd.Function):
    """Inputs: gate_up, lora_t, gate_b, up_b, down_a (each B/A may be None), scaling, need_output.

    Outputs h and down_t (None without down_a). The B's and A are cast to the compute dtype once
    and kept for backward. lora_t's gradient, scaling * dgate @ B, is a sum over columns: the
    backward kernel adds it up with atomics, or, under torch.use_deterministic_algorithms, one
    skinny GEMM per B over dgate_up forms it in a fixed order.
    """

    @staticmethod
    def forward(ctx, gate_up, lora_t, gate_b, up_b, down_a, scaling, need_output):
        matrices = _in_dtype(gate_up.dtype, gate_b, up_b, down_a)
        h, down_t = _swiglu_forward(gate_up, lora_t, *matrices[:2], scaling, matrices[2], need_output)
        ctx.save_for_backward(gate_up, lora_t, *matrices)
        ctx.scaling = scaling
        ctx.grad_dtypes = [None if m is None else m.dtype for m in (gate_b, up_b, down_a)]
        lead = gate_up.shape[:-1]
        return h.view(*lead, h.shape[-1]), None if down_t is None else down_t.view(*lead, down_t.shape[-1])

    @staticmethod
    def backward(ctx, dh, down_dt):
        gate_up, lora_t, gate_b, up_b, down_a = ctx.saved_tensors
        scaling = ctx.scaling
        want_dlora_t = lora_t is not None and ctx.needs_input_grad[1]
        atomics = want_dlora_t and not torch.are_deterministic_algorithms_enabled()
        dgate_up, *weight_grads, dlora_t = _swiglu_backward(
            dh, down_dt, gate_up, lora_t, gate_b, up_b, scaling, down_a, lora_t_grad=atomics
        )
        if want_dlora_t and not atomics:
            gate, up = dgate_up.chunk(2, dim=1)
            parts = [half @ b for half, b in ((gate, gate_b), (up, up_b)) if b is not None]
            dlora_t = torch.cat(parts, dim=1).mul_(scaling)
        if dlora_t is not None:
            dlora_t = dlora_t.to(lora_t.dtype).reshape(lora_t.shape)
        weight_grads = [
            None if grad is None else grad.to(dtype)
            for grad, dtype in zip(weight_grads, ctx.grad_dtypes, strict=True)
        ]
        return dgate_up.view(gate_up.shape), dlora_t, *weight_grads, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def lora_swiglu(
    gate_up: torch.Tensor,
    lora_t: torch.Tensor | None = None,
    gate_b: torch.Tensor | None = None,
    up_b: torch.Tensor | None = None,
    scaling: float = 0.0,
    down_a: torch.Tensor | None = None,
    need_output: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [..., I], down_t [..., r] or None) for gate_up = [..., gate | up] without LoRA's B term.

    lora_t = x @ A^T of the gate/up projection, gate's ranks first; gate_b / up_b [I, r] are
    their B's, added with `scaling`; down_a [r, I] is the down projection's A. need_output=False
    (a checkpoint recompute, where the down projection's GEMM is skipped) leaves h unwritten.
    """
    _check(gate_up, lora_t, gate_b, up_b, down_a)
    if not use_triton(gate_up):
        return lora_swiglu_reference(gate_up, lora_t, gate_b, up_b, scaling, down_a)
    return LoRASwiGLUFunction.apply(gate_up, lora_t, gate_b, up_b, down_a, scaling, need_output)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., gate | up]; returns [..., I] in gate_up's dtype."""
    return lora_swiglu(gate_up)[0]
