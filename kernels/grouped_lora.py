"""LoRA on a mixture-of-experts layer's routed experts: expert e's rows of x [N, in] (sorted by expert,
`expert_offsets` as in grouped_linear) get y = scaling · (x A_e^T) B_e^T, A [E, r, in], B [E, out, r].

Both products and the input gradient are grouped_linear's grouped GEMM on plain [E, ·, ·] tensors. The
weight gradients are grouped outer products, dA_e = dt_e^T x_e and dB_e = dy_e^T t_e: each expert sums
its own rows' outer products, so `grouped_outer` is a kernel of its own. Every program finds its
expert's rows on the device from `expert_offsets`, so nothing reads the routing on the host and a CUDA
graph captures the step. A and B are fp32 masters; the products run in x's dtype and the weight
gradients accumulate and return in fp32.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels.grouped_linear import _grouped_matmul, grouped_linear_reference

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _expert_rows(expert_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """[E, rows] bool: which rows each expert owns, compared on the device."""
    index = torch.arange(rows, device=expert_offsets.device)
    return (index >= expert_offsets[:-1, None]) & (index < expert_offsets[1:, None])


def grouped_outer_reference(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """[E, P, Q] fp32: for each expert, the sum over its rows of a [N, P]'s row times b [N, Q]'s,
    outer; rows no expert covers count nowhere. Masks, no host reads."""
    mine = _expert_rows(expert_offsets, a.shape[0]).to(torch.float32)
    return torch.einsum("en,np,nq->epq", mine, a.float(), b.float())


def grouped_lora_reference(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, expert_offsets: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The products through grouped_linear's reference, differentiable by torch in x, A and B."""
    t = grouped_linear_reference(x, lora_a.to(x.dtype), expert_offsets)
    return grouped_linear_reference(t * scaling, lora_b.to(x.dtype), expert_offsets)


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _grouped_outer_kernel(
        a_ptr,
        b_ptr,
        expert_offsets_ptr,
        out_ptr,
        p_size,
        q_size,
        a_row_stride,
        b_row_stride,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        """One program: expert program_id(0)'s [BLOCK_P, BLOCK_Q] tile of the output, summed over that
        expert's rows BLOCK_R at a time in fp32 (an empty expert's tile is zeros)."""
        expert = tl.program_id(0)
        first_row = tl.load(expert_offsets_ptr + expert)
        end_row = tl.load(expert_offsets_ptr + expert + 1)
        ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        qs = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
        for start in range(first_row, end_row, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            row_mask = (rows < end_row)[:, None]
            a = tl.load(
                a_ptr + rows[:, None].to(tl.int64) * a_row_stride + ps[None, :],
                mask=row_mask & (ps < p_size)[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + rows[:, None].to(tl.int64) * b_row_stride + qs[None, :],
                mask=row_mask & (qs < q_size)[None, :],
                other=0.0,
            )
            acc += tl.dot(tl.trans(a), b)
        out_at = out_ptr + expert.to(tl.int64) * p_size * q_size + ps[:, None] * q_size + qs[None, :]
        tl.store(out_at, acc, mask=(ps < p_size)[:, None] & (qs < q_size)[None, :])


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

# Rows summed per step, and the output tile (tl.dot takes no side under 16). A program owns one
# expert's tile, so an expert's rows are summed in order by one program: no atomics, the same bits
# every run.
_BLOCK_R = 32
_MAX_TILE = 64


def _tile(size: int) -> int:
    return min(_MAX_TILE, max(16, triton.next_power_of_2(size)))


def _grouped_outer(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    experts, p_size, q_size = expert_offsets.shape[0] - 1, a.shape[1], b.shape[1]
    out = torch.empty(experts, p_size, q_size, dtype=torch.float32, device=a.device)
    block_p, block_q = _tile(p_size), _tile(q_size)
    grid = (experts, triton.cdiv(p_size, block_p), triton.cdiv(q_size, block_q))
    _grouped_outer_kernel[grid](
        a,
        b,
        expert_offsets,
        out,
        p_size,
        q_size,
        a.stride(0),
        b.stride(0),
        BLOCK_R=_BLOCK_R,
        BLOCK_P=block_p,
        BLOCK_Q=block_q,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class GroupedLoRAFunction(torch.autograd.Function):
    """Saves x, A and B in x's dtype, and the scaled t = scaling · x A_e^T ([N, r]); scaling multiplies
    only rank-wide tensors. Backward: dt = scaling · dy B_e, dx = dt A_e, dA_e = dt_e^T x_e and
    dB_e = dy_e^T t_e, the last two on grouped_outer."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, expert_offsets, scaling: float):
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)
        t = _grouped_matmul(x, a, expert_offsets, transposed=False) * scaling
        ctx.scaling = scaling
        ctx.master_dtypes = (lora_a.dtype, lora_b.dtype)
        ctx.save_for_backward(x, a, b, t, expert_offsets)
        return _grouped_matmul(t, b, expert_offsets, transposed=False)

    @staticmethod
    def backward(ctx, dy):
        x, a, b, t, expert_offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dt = _grouped_matmul(dy, b, expert_offsets, transposed=True) * ctx.scaling
        dx = _grouped_matmul(dt, a, expert_offsets, transposed=True) if ctx.needs_input_grad[0] else None
        a_dtype, b_dtype = ctx.master_dtypes
        da = _grouped_outer(dt, x, expert_offsets).to(a_dtype)
        db = _grouped_outer(dy, t, expert_offsets).to(b_dtype)
        return dx, da, db, None, None


# ---------------------------------------------------------------------------------------------
# Public
# ---------------------------------------------------------------------------------------------


def _check(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor) -> None:
    if a.shape[0] != b.shape[0] or a.shape[0] != expert_offsets.shape[0] - 1:
        raise ValueError(
            f"lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} must hold one factor per expert, "
            f"{expert_offsets.shape[0] - 1} of them"
        )
    if a.dim() != 3 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(
            f"lora_a must be [E, r, in] and lora_b [E, out, r], got {tuple(a.shape)} and {tuple(b.shape)}"
        )


def grouped_outer(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """[E, P, Q] fp32: expert e's sum over rows expert_offsets[e] to expert_offsets[e + 1] of
    a [N, P]'s row, outer, b [N, Q]'s: a grouped weight gradient (dW_e = dy_e^T x_e)."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must have the same rows, got {tuple(a.shape)} and {tuple(b.shape)}")
    if use_triton(a):
        return _grouped_outer(a, b, expert_offsets)
    return grouped_outer_reference(a, b, expert_offsets)


def grouped_lora(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, expert_offsets: torch.Tensor, scaling: float
) -> torch.Tensor:
    """y [N, out]: rows of expert e in x [N, in] times scaling · (B_e A_e)^T, as two rank-r products;
    lora_a [E, r, in], lora_b [E, out, r]; rows no expert covers are zero. Differentiable in x, A, B."""
    _check(lora_a, lora_b, expert_offsets)
    if use_triton(x):
        return GroupedLoRAFunction.apply(x, lora_a, lora_b, expert_offsets, scaling)
    return grouped_lora_reference(x, lora_a, lora_b, expert_offsets, scaling)
