"""Dropout whose mask is a pure function of a seed held in a device tensor, a salt and the element index.

torch's dropout draws from the generator's running state: a recompute in backward must save and
restore that state to repeat a mask, and reading it synchronises with the host, which a CUDA graph
capture forbids. Here the mask of element i is `hash(seed, salt, offset + i) >= p`, so
  - a recompute that calls again with the same (seed, salt, offset) repeats the mask: nothing to save;
  - the seed is read on the device, so a captured graph replays with whatever seed the tensor holds:
    write a new one before each micro-batch (`seed.fill_(n)`) and the masks change;
  - backward recomputes the mask instead of keeping it.
The hash is lowbias32 (Chris Wellons' hash-prospector constants) over 32-bit words, chained over
the seed's halves, the salt and the index's halves. Keep test: the top 24 bits against p * 2^24.
"""

import torch

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

_MIX_1 = 0x7FEB352D
_MIX_2 = 0x846CA68B
_WORD = 0xFFFFFFFF
_KEEP_BITS = 24

# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x in [0, 2^32), in halves so no product overflows int64."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _WORD


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_2)
    return x ^ (x >> 16)


def _threshold(p: float) -> int:
    return round(p * (1 << _KEEP_BITS))


def dropout_mask_reference(
    numel: int, p: float, seed: torch.Tensor, salt: int, offset: int = 0
) -> torch.Tensor:
    """Boolean keep-mask of `numel` elements, the first being element `offset` of the sequence."""
    seed = seed.reshape(()).to(torch.int64)
    key = _mix32(torch.tensor(salt, device=seed.device))
    key = _mix32(((seed >> 32) & _WORD) ^ key)
    key = _mix32((seed & _WORD) ^ key)
    index = torch.arange(offset, offset + numel, device=seed.device, dtype=torch.int64)
    bits = _mix32(_mix32(key ^ (index >> 32)) ^ (index & _WORD))
    return (bits >> (32 - _KEEP_BITS)) >= _threshold(p)


def dropout_reference(x: torch.Tensor, p: float, seed: torch.Tensor, salt: int, offset: int = 0):
    """Elements dropped where the mask says, the kept ones scaled by 1 / (1 - p); differentiable."""
    keep = dropout_mask_reference(x.numel(), p, seed, salt, offset).view(x.shape)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype))


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    @triton.jit
    def _mix32_tl(x):
        """lowbias32 on uint32 words: the GPU's 32-bit multiply wraps as the reference's halves do."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit(do_not_specialize=["salt", "offset", "threshold"])
    def _dropout_kernel(X, Y, SEED, salt, offset, numel, threshold, scale, BLOCK: tl.constexpr):
        """Y = X * keep * scale over a flat block, the hash in 32-bit words as the reference has it."""
        seed = tl.load(SEED).to(tl.int64)
        key = _mix32_tl(tl.full([], 0, tl.uint32) + salt.to(tl.uint32))
        key = _mix32_tl((seed >> 32).to(tl.uint32) ^ key)
        key = _mix32_tl(seed.to(tl.uint32) ^ key)
        local = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = local < numel
        index = local + offset
        bits = _mix32_tl(_mix32_tl(key ^ (index >> 32).to(tl.uint32)) ^ index.to(tl.uint32))
        keep = (bits >> 8).to(tl.int32) >= threshold
        x = tl.load(X + local, mask=valid, other=0.0)
        y = tl.where(keep, x.to(tl.float32) * scale, 0.0)
        tl.store(Y + local, y.to(Y.dtype.element_ty), mask=valid)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _launch(x: torch.Tensor, p: float, seed: torch.Tensor, salt: int, offset: int) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    numel = x.numel()
    block = 1024 if x.is_cuda else 256
    _dropout_kernel[(triton.cdiv(numel, block),)](
        x, y, seed, salt, offset, numel, _threshold(p), 1.0 / (1.0 - p), BLOCK=block
    )
    return y


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class SeededDropout(torch.autograd.Function):
    """Backward applies the same mask to the gradient, recomputed from the saved seed."""

    @staticmethod
    def forward(ctx, x, p, seed, salt, offset):
        # The seed is copied: a caller may write the next micro-batch's seed before this backward runs.
        ctx.save_for_backward(seed.clone())
        ctx.p, ctx.salt, ctx.offset = p, salt, offset
        return _launch(x, p, seed, salt, offset)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        return _launch(dy, ctx.p, seed, ctx.salt, ctx.offset), None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


def seeded_dropout(x: torch.Tensor, p: float, seed: torch.Tensor, salt: int, offset: int = 0) -> torch.Tensor:
    """Dropout of x (kept elements scaled by 1 / (1 - p)) with the mask hash(seed, salt, offset + i).

    seed: one int64 on x's device, read when the op runs. salt tells apart the call sites that share
    a seed; offset places x inside a longer sequence (slices of one tensor get that tensor's mask).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not 0 <= salt < 2**31 or offset < 0:
        raise ValueError(f"salt must be in [0, 2^31) and offset not negative, got {salt} and {offset}")
    if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != x.device:
        raise ValueError(
            f"seed must be one int64 on {x.device}, got {seed.dtype} {tuple(seed.shape)} on {seed.device}"
        )
    if p == 0.0:
        return x
    if not use_triton(x):
        return dropout_reference(x, p, seed, salt, offset)
    return SeededDropout.apply(x, p, seed, salt, offset)
