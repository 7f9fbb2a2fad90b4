"""Offloaded recompute: what a recomputed layer keeps waits in host memory, not on the GPU.

A recomputed layer keeps only its input, the residual stream: tokens × hidden in bf16, for every
layer. At 7B and 128K tokens that is 26 GiB of a step's memory. Here each layer's input is copied
to pinned host memory on a side stream while the layer's forward runs, and copied back on the same
side stream while the layer above runs its backward, so the GPU holds two layers' inputs at most.

Both directions are ordered with stream waits only (no host synchronisation, no allocation after
the first step), so a CUDA graph captures and replays them like any other work. On the CPU the
same bookkeeping copies into a second host tensor: the logic is tested where CI runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


class HostOffloader:
    """Layer inputs of one forward, kept off the GPU until that layer's backward asks for them."""

    def __init__(self, device: torch.device, num_layers: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.host: list[torch.Tensor | None] = [None] * num_layers
        self.shapes: list[torch.Size | None] = [None] * num_layers
        self.landing: list[torch.Tensor | None] = [None, None]
        self.in_flight: torch.Tensor | None = None
        self.prefetched: int | None = None

    def _host_buffer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Reused from step to step: a pinned allocation synchronises, and a graph capture forbids it."""
        buffer = self.host[index]
        if buffer is None or buffer.numel() < x.numel() or buffer.dtype != x.dtype:
            buffer = torch.empty(x.numel(), dtype=x.dtype, pin_memory=self.cuda)
            self.host[index] = buffer
        self.shapes[index] = x.shape
        return buffer[: x.numel()]

    def _landing_buffer(self, index: int) -> torch.Tensor:
        slot = index % 2
        numel = self.shapes[index].numel()
        buffer = self.landing[slot]
        if buffer is None or buffer.numel() < numel or buffer.dtype != self.host[index].dtype:
            buffer = torch.empty(numel, dtype=self.host[index].dtype, device=self.device)
            self.landing[slot] = buffer
        return buffer[:numel].view(self.shapes[index])

    def save(self, index: int, x: torch.Tensor) -> None:
        """Start copying layer `index`'s input to the host; the layer may run at once."""
        self.prefetched = None
        host = self._host_buffer(index, x)
        if not self.cuda:
            host.copy_(x.reshape(-1))
            return
        compute = torch.cuda.current_stream(self.device)
        if self.in_flight is not None:
            # The previous layer's copy has had a whole layer's forward to finish. Waiting for it
            # before letting go of its source keeps the allocator from handing that memory out
            # mid-copy. The first layer waits for nothing: the last backward joined every copy, and
            # a graph capture may not wait on work it did not capture.
            compute.wait_stream(self.copies)
        self.copies.wait_stream(compute)
        with torch.cuda.stream(self.copies):
            host.copy_(x.reshape(-1), non_blocking=True)
        self.in_flight = x

    def load(self, index: int) -> torch.Tensor:
        """Layer `index`'s input back on the device, and the next layer down already on its way."""
        if not self.cuda:
            return self.host[index][: self.shapes[index].numel()].view(self.shapes[index]).clone()
        compute = torch.cuda.current_stream(self.device)
        if self.prefetched != index:
            self._fetch(index, compute)
        compute.wait_stream(self.copies)
        self.in_flight = None
        x = self._landing_buffer(index)
        if index > 0:
            self._fetch(index - 1, compute)
        return x

    def _fetch(self, index: int, compute: torch.cuda.Stream) -> None:
        # Everything queued on the compute stream so far, the backward of the layer that used this
        # landing buffer last included, runs before the copy overwrites it.
        target = self._landing_buffer(index)
        self.copies.wait_stream(compute)
        with torch.cuda.stream(self.copies):
            target.view(-1).copy_(self.host[index][: target.numel()], non_blocking=True)
        self.prefetched = index


class OffloadedLayer(torch.autograd.Function):
    """A recomputed layer whose input waits in host memory between its forward and its backward.

    Forward runs the layer without building a graph; backward brings the input back, reruns the
    layer inside `recompute()` and back-propagates through it, so the LoRA gradients accumulate
    as in any backward. The trainable tensors are inputs only so that backward is called at all:
    the first layer's input, the embedding, needs no gradient.
    """

    @staticmethod
    def forward(
        ctx,
        run_layer: Callable,
        offloader: HostOffloader,
        index: int,
        recompute: Callable[[], contextlib.AbstractContextManager],
        x: torch.Tensor,
        *trainables: torch.Tensor,
    ):
        offloader.save(index, x)
        ctx.run_layer, ctx.offloader, ctx.index, ctx.recompute = run_layer, offloader, index, recompute
        ctx.trainables = len(trainables)
        return run_layer(x)

    @staticmethod
    def backward(ctx, *grads):
        x = ctx.offloader.load(ctx.index).detach().requires_grad_(True)
        with torch.enable_grad(), ctx.recompute():
            outputs = ctx.run_layer(x)
        pairs = [
            (out, g) for out, g in zip(outputs, grads, strict=True) if g is not None and out.requires_grad
        ]
        torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, x.grad) + (None,) * ctx.trainables
