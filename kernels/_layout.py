"""Tensor layouts the kernels take, shared by every launcher: a unit stride along the last dimension,
[rows, features] views, and packed rows' documents as per-token indices."""

import torch


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is dense (kernels index rows by stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] as [rows, n] with a unit stride along n."""
    return unit_last_stride(t.reshape(-1, t.shape[-1]))


def as_head_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., heads, n] as [tokens, heads, n] with a unit stride along n: a view wherever the leading
    dims merge, as for a gate sliced out of a wider projection's output (no copy of it is kept)."""
    return unit_last_stride(t.reshape(-1, *t.shape[-2:]))


def document_index(doc_ids: torch.Tensor) -> torch.Tensor:
    """int32 [B, T], counting documents from 0 along each row: a new one starts where doc_ids changes.

    Kernels compare these instead of doc_ids, so a document id that comes back later in a row is
    still a new document.
    """
    changes = torch.zeros(doc_ids.shape, dtype=torch.int32, device=doc_ids.device)
    changes[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return changes.cumsum(1, dtype=torch.int32)


def documents_per_token(doc_ids: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Document index per token of x [B, T, ...]; one document is a zero-stride view (nothing
    allocated per token)."""
    if doc_ids is None:
        return torch.zeros(1, 1, dtype=torch.int32, device=x.device).expand(x.shape[0], x.shape[1])
    if doc_ids.shape != x.shape[:2]:
        raise ValueError(f"doc_ids must be [B, T] = {tuple(x.shape[:2])}, got {tuple(doc_ids.shape)}")
    return document_index(doc_ids)
