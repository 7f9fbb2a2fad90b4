"""The delta rule token by token in fp32: the numerical truth every kernel is tested against, and
the path taken where triton is not installed."""

import torch

L2NORM_EPS = 1e-6


def l2norm_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3.5 l2norm (the FLA convention), eps inside the square root."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool, True where a new document begins after the first (where doc_ids changes)."""
    starts = torch.zeros(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float, normalize_qk: bool):
    q, k = q.float(), k.float()
    if normalize_qk:
        q, k = l2norm_reference(q), l2norm_reference(k)
    return q * scale, k


def _recurrent_step(state, q, k, v, g, beta):
    """One token for every (batch, v-head): state [B, Hv, Dk, Dv]; q, k [B, Hv, Dk]; v [B, Hv, Dv]."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(-2)


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token in fp32, the state zeroed at every document start: the numerical truth."""
    batch, seq, k_heads, k_dim = k.shape
    v_heads, v_dim = v.shape[2:]
    group = v_heads // k_heads
    q, k = _prepare_qk(q, k, k_dim**-0.5 if scale is None else scale, normalize_qk)
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    values, g, beta = v.float(), g.float(), beta.float()
    if initial_state is None:
        state = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()
    starts = None if doc_ids is None else document_starts(doc_ids)
    outputs = []
    for t in range(seq):
        if starts is not None:
            state = torch.where(starts[:, t, None, None, None], 0.0, state)
        state, out = _recurrent_step(state, q[:, t], k[:, t], values[:, t], g[:, t], beta[:, t])
        outputs.append(out)
    o = torch.stack(outputs, dim=1).to(v.dtype)
    return o, state if output_final_state else None


def gated_delta_rule_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    normalize_qk: bool = True,
) -> torch.Tensor:
    """One decode token: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv]; state updated in place."""
    group = v.shape[1] // k.shape[1]
    q, k = _prepare_qk(q, k, k.shape[-1] ** -0.5 if scale is None else scale, normalize_qk)
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    new_state, out = _recurrent_step(state.float(), q, k, v.float(), g.float(), beta.float())
    state.copy_(new_state)
    return out.to(v.dtype)
