"""One micro-batch's forward and backward, captured once as a CUDA graph and replayed.

A QLoRA step launches thousands of kernels, many of them small (LoRA's rank-r products, norms,
casts, the recompute's bookkeeping). Python and autograd issue them more slowly than the GPU runs
the small ones, so the GPU waits between the large GEMMs. Replaying a captured graph issues the
whole forward and backward at once: on an H200 that took 18 % off a Qwen2.5-1.5B step and 1.5 % off
a 7B one, whose time is in its GEMMs (benchmarks/RESULTS.md).

What a graph needs, and what callers keep:
  - the same input shapes on every call (packed rows; the trainer pads a short last batch);
  - no host synchronisation inside the loss, the run's objective (train/objectives.py) on the model
    (kernels.cross_entropy skips its label check while a graph is captured, so the labels are
    checked here, on the host, instead);
  - gradients that stay where the graph writes them: zero them in place, never set them to None;
  - random numbers drawn from a seed the graph reads on the device: LoRA dropout's masks come from
    the model's dropout seed (kernels.dropout), which the step writes before each micro-batch, so a
    replay draws that micro-batch's masks, and its recompute in backward repeats them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_kernels.cross_entropy import check_labels_in_vocab

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def cuda_graph_blocker(config: TrainConfig, device: torch.device, world_size: int) -> str | None:
    """Why this run cannot replay its micro-batches as CUDA graphs, or None."""
    if device.type != "cuda":
        return f"they need a CUDA device and this run trains on {device.type}"
    if world_size > 1:
        return "several processes exchange gradients through DDP's hooks, which a graph does not replay"
    if not config.sample_packing:
        return "without sample_packing a micro-batch's width changes from batch to batch"
    return None


def graphed_loss_for(
    config: TrainConfig, loss_fn: LossFn, device: torch.device, vocab_size: int, world_size: int
) -> GraphedLoss | None:
    """What `cuda_graphs` asks for: `auto` replays graphs where the run allows them (and launches op
    by op if capturing runs out of memory), `true` insists (an error names what stands in the way),
    `false` launches op by op."""
    if config.cuda_graphs is False:
        return None
    blocker = cuda_graph_blocker(config, device, world_size)
    if blocker is None:
        return GraphedLoss(loss_fn, device, vocab_size, eager_when_out_of_memory=config.cuda_graphs == "auto")
    if config.cuda_graphs is True:
        raise QLoraError(f"config key 'cuda_graphs' is true, but {blocker}; set it to auto or false")
    return None


class GraphedLoss:
    """Calls `loss_fn(*inputs)` and back-propagates `loss_sum * scale` into the parameters' gradients.

    The first call runs eagerly: it trains like any other micro-batch and compiles every Triton
    kernel the step uses, which a capture cannot do. The second call captures the graph; it and
    every later call copy their inputs into the graph's own tensors and replay it.
    With `eager_when_out_of_memory`, a capture that runs out of memory is dropped with its memory,
    and that call and every later one run eagerly, as the first did at the same shape, so a run at
    the edge of the GPU's memory goes on, slower; `fallback_note` says so once.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        device: torch.device,
        vocab_size: int,
        ignore_index: int = -100,
        *,
        eager_when_out_of_memory: bool = False,
    ):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.loss_fn = loss_fn
        self.device = device
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor | None] = []
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_sum: torch.Tensor | None = None
        self.calls = 0
        self.eager_when_out_of_memory = eager_when_out_of_memory
        self.eager_only = False
        self._note: str | None = None

    @property
    def shape(self) -> torch.Size | None:
        """The input shape the graph was captured for (None before the capture)."""
        return self.inputs[0].shape if self.graph is not None else None

    def __call__(
        self, inputs: Sequence[torch.Tensor | None], labels_index: int, scale: float
    ) -> torch.Tensor:
        """This micro-batch's summed loss, after its backward; `inputs[labels_index]` are the labels."""
        check_labels_in_vocab(inputs[labels_index], self.vocab_size, self.ignore_index)
        self.calls += 1
        if self.calls == 1 or self.eager_only:
            return self._eager(inputs, scale)
        if self.graph is None:
            try:
                self._capture(inputs)
            except torch.OutOfMemoryError:
                if not self.eager_when_out_of_memory:
                    raise
                self._drop_capture()
                return self._eager(inputs, scale)
        elif inputs[0].shape != self.shape:
            raise ValueError(f"a CUDA graph replays shape {tuple(self.shape)}, got {tuple(inputs[0].shape)}")
        for static, tensor in zip(self.inputs, inputs, strict=True):
            if static is not None:
                static.copy_(tensor, non_blocking=True)
        self.scale.fill_(scale)
        self.graph.replay()
        return self.loss_sum.clone()

    def fallback_note(self) -> str | None:
        """Once, after a capture ran out of memory: that the run goes on without graphs."""
        note, self._note = self._note, None
        return note

    def _drop_capture(self) -> None:
        self.graph, self.inputs, self.loss_sum, self.eager_only = None, [], None, True
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._note = (
            "cuda_graphs: capturing the step's graph ran out of GPU memory, so the run goes on launching "
            "op by op, as its first step did (slower); cuda_graphs: false skips the capture"
        )

    def _eager(self, inputs, scale: float) -> torch.Tensor:
        """On a side stream, as the capture's warm-up must run (torch.cuda.graphs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            loss_sum, _ = self.loss_fn(*[None if t is None else t.to(self.device) for t in inputs])
            (loss_sum * scale).backward()
            loss_sum = loss_sum.detach()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return loss_sum

    def _capture(self, inputs) -> None:
        self.inputs = [None if t is None else torch.empty_like(t, device=self.device) for t in inputs]
        for static, tensor in zip(self.inputs, inputs, strict=True):
            if static is not None:
                static.copy_(tensor)
        # The eager call's cached blocks go back to the GPU before the graph takes its own pool.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream(self.device)
        # The outer context puts the caller's stream back even where ending a failed capture raises,
        # which torch.cuda.graph's own exit then skips.
        try:
            with (
                torch.cuda.stream(capture_stream),
                torch.cuda.graph(self.graph, stream=capture_stream, capture_error_mode="thread_local"),
            ):
                loss_sum, _ = self.loss_fn(*self.inputs)
                (loss_sum * self.scale).backward()
                self.loss_sum = loss_sum.detach()
        except RuntimeError as err:
            release_generator(self.device)
            # Running out of memory mid-capture leaves side-stream work unjoined, and ending the capture
            # then fails with "capturing stream has unjoined work": the error that says what happened
            # is the one it interrupted.
            if isinstance(err.__context__, torch.OutOfMemoryError):
                raise err.__context__ from None
            raise


def release_generator(device: torch.device) -> None:
    """A capture whose end raised never hands the device's random generator back (torch does that
    after ending the capture), and every later draw on the device fails ("Offset increment outside
    graph capture"): a copy of its state, seed and offset, takes its place."""
    index = torch.device(device).index
    generator = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    generator.graphsafe_set_state(generator.clone_state())
