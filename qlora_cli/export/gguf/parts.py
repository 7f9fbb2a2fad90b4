"""Tensors llama.cpp keeps whole that a checkpoint streams in parts: a layer's routed experts, one 3-D
tensor per projection in the GGUF, streamed one expert's matrix at a time. A whole takes its place in
the file where its last part streams past, and is written then: only the parts of wholes not yet
complete are held, a layer's experts at most, as checkpoints keep a layer's tensors together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Part `index` of the `count` that the tensor `whole` stacks along a new first dim."""

    whole: str
    index: int
    count: int


# What part of a whole a streamed tensor is, or None for a tensor written as it streams.
PartOf = Callable[[str], Part | None]


def whole_shapes(
    names: Iterable[str], shapes: dict[str, tuple[int, ...]], part_of: PartOf
) -> dict[str, tuple[int, ...]]:
    """Each tensor the file holds, in the order `assemble` yields them for tensors streamed in the order
    of `names`, with its shape: a whole's is (count, *its parts')."""
    wholes: dict[str, tuple[int, ...]] = {}
    seen: dict[str, int] = {}
    for name in names:
        part = part_of(name)
        if part is None:
            wholes[name] = shapes[name]
            continue
        seen[part.whole] = seen.get(part.whole, 0) + 1
        if seen[part.whole] == part.count:
            wholes[part.whole] = (part.count, *shapes[name])
    return wholes


def assemble(
    tensors: Iterable[tuple[str, torch.Tensor]], part_of: PartOf
) -> Iterator[tuple[str, torch.Tensor]]:
    """The streamed tensors whole: one that is no part as it comes, a whole once its last part has."""
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in tensors:
        part = part_of(name)
        if part is None:
            yield name, tensor
            continue
        parts = pending.setdefault(part.whole, [None] * part.count)
        parts[part.index] = tensor
        if all(piece is not None for piece in parts):
            del pending[part.whole]
            yield part.whole, torch.stack(parts)
