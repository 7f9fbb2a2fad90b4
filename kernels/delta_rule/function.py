"""The public calls: the autograd Function (it saves the inputs and each chunk's T, and recomputes
the other tables and the states in backward) and the decode step, each falling back to the
reference where triton cannot run."""

import torch

from qlora_kernels._dispatch import use_triton
from qlora_kernels._layout import documents_per_token, unit_last_stride

from .backward import _chunk_backward
from .common import CHUNK, _table_dtype
from .reference import gated_delta_rule_reference, gated_delta_rule_step_reference
from .scan import _scan_forward
from .step import _step
from .tables import _chunk_cumsum, _chunk_solve, _chunk_tables, _normalized, _normalized_backward

_MAX_HEAD_DIM = 256


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    batch, seq, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    if v_heads % k_heads:
        raise ValueError(f"the v-heads ({v_heads}) must be a multiple of the k-heads ({k_heads})")
    if g.shape != (batch, seq, v_heads) or beta.shape != (batch, seq, v_heads):
        raise ValueError(f"g and beta must be [B, T, Hv] = {(batch, seq, v_heads)}")
    if max(k_dim, v_dim) > _MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {_MAX_HEAD_DIM} are supported, got Dk={k_dim}, Dv={v_dim}")
    if initial_state is not None and initial_state.shape != (batch, v_heads, k_dim, v_dim):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(batch, v_heads, k_dim, v_dim)}")


def _prepare(q, k, v, g, docs, scale, normalize_qk):
    return (
        _normalized(q, scale, normalize_qk, _table_dtype(v)),
        _normalized(k, 1.0, normalize_qk, _table_dtype(v)),
        _chunk_cumsum(g, docs, False),
    )


def _chunk_forward(q, k, v, beta, b, docs, t, initial_state, output_final_state, store_states):
    """The chunked forward on normalised q, k (in the tables' dtype), the per-chunk cumulative
    log-decay b and the chunks' T; with store_states, backward's rerun: no output, and the tables
    and per-chunk states that backward reads."""
    w, u, aqk = _chunk_tables(q, k, v, beta, b, docs, t)
    o, final, states = _scan_forward(
        q, k, w, u, aqk, b, docs, v, initial_state, output_final_state, store_states
    )
    if store_states:
        return None, final, (t, w, u, aqk, *states)
    return o, final, None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _passes(batch: int, seq: int, tokens_per_pass: int | None) -> list[tuple[slice, list[slice]]]:
    """The rows each pass takes and, in order, the spans of the row it walks: whole rows, as many
    as tokens_per_pass holds (shared evenly), or a row longer than that one span of whole chunks
    at a time, the state carried from span to span. The tables a pass builds grow with its tokens."""
    whole = [slice(0, seq)]
    if tokens_per_pass is None or batch * seq <= tokens_per_pass:
        return [(slice(0, batch), whole)]
    if seq <= tokens_per_pass:
        groups = _cdiv(batch, max(1, tokens_per_pass // seq))
        rows = _cdiv(batch, groups)
        return [(slice(r, min(r + rows, batch)), whole) for r in range(0, batch, rows)]
    longest = max(CHUNK, tokens_per_pass // CHUNK * CHUNK)
    span = _cdiv(_cdiv(seq, _cdiv(seq, longest)), CHUNK) * CHUNK
    spans = [slice(t, min(t + span, seq)) for t in range(0, seq, span)]
    return [(slice(r, r + 1), spans) for r in range(batch)]


def _single(passes) -> bool:
    return len(passes) == 1 and len(passes[0][1]) == 1


def _continues(docs: torch.Tensor, start: int) -> torch.Tensor:
    """[rows, 1, 1, 1]: 1 where the token at `start` continues the document before it, so the state
    carries into the span starting there; 0 where a document starts on it."""
    return (docs[:, start] == docs[:, start - 1]).float().view(-1, 1, 1, 1)


class GatedDeltaRuleFunction(torch.autograd.Function):
    """Saves the inputs, each chunk's T and the state entering each span after a row's first:
    backward recomputes the other chunk tables and the per-chunk states, pass by pass (_passes),
    last span first. T is a quarter of the tables' bytes (Hv x CHUNK values a token), and keeping it
    spares backward the triangular solve.
    The forward takes whole rows at once: its other tables live only while it runs, beside no MLP slice,
    and a pass of fewer rows leaves SMs idle in the scan (1.38 against 0.80 ms at 4 x 2048 in two
    passes, H200)."""

    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, docs, initial_state, scale, normalize_qk, output_final_state, tokens_per_pass
    ):
        q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
        passes = _passes(v.shape[0], v.shape[1], tokens_per_pass)
        if all(len(spans) == 1 for _, spans in passes):
            q_hat, k_hat, b = _prepare(q, k, v, g, docs, scale, normalize_qk)
            t = _chunk_solve(k_hat, v, beta, b, docs)
            o, final, _ = _chunk_forward(
                q_hat, k_hat, v, beta, b, docs, t, initial_state, output_final_state, False
            )
            carried = []
        else:
            o, final, t, carried = _forward_in_passes(
                passes, q, k, v, g, beta, docs, initial_state, scale, normalize_qk, output_final_state
            )
        ctx.save_for_backward(q, k, v, g, beta, docs, t, initial_state, *carried)
        ctx.scale, ctx.normalize_qk, ctx.passes = scale, normalize_qk, passes
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, docs, t, initial_state, *carried = ctx.saved_tensors
        if _single(ctx.passes):
            grads = _span_backward(
                q, k, v, g, beta, docs, t, initial_state, do, dfinal, ctx.scale, ctx.normalize_qk
            )
            return *grads[:5], None, grads[5], None, None, None, None
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        dh0 = None if initial_state is None else torch.empty_like(initial_state)
        carried = iter(carried)
        for rows, spans in ctx.passes:
            entering = [None if initial_state is None else initial_state[rows]]
            entering += [next(carried) for _ in spans[1:]]
            dstate = None if dfinal is None else dfinal[rows]
            for i in reversed(range(len(spans))):
                part = (rows, spans[i])
                span_grads = _span_backward(
                    q[part],
                    k[part],
                    v[part],
                    g[part],
                    beta[part],
                    docs[part],
                    t[part].contiguous(),
                    entering[i],
                    do[part],
                    dstate,
                    ctx.scale,
                    ctx.normalize_qk,
                )
                for grad, span_grad in zip(grads, span_grads[:5], strict=True):
                    grad[part] = span_grad
                dstate = span_grads[5]
                if i:
                    dstate = dstate * _continues(docs[rows], spans[i].start)
            if dh0 is not None:
                dh0[rows] = dstate
        return *grads, None, dh0, None, None, None, None


def _forward_in_passes(
    passes, q, k, v, g, beta, docs, initial_state, scale, normalize_qk, output_final_state
):
    """o, the final state, every chunk's T and the states carried into each span after a row's first."""
    o = torch.empty_like(v)
    t = torch.empty(*v.shape[:3], CHUNK, dtype=_table_dtype(v), device=v.device)
    finals, carried = [], []
    for rows, spans in passes:
        state = None if initial_state is None else initial_state[rows]
        for i, span in enumerate(spans):
            if i:
                state = state * _continues(docs[rows], span.start)
                carried.append(state)
            part = (rows, span)
            q_hat, k_hat, b = _prepare(q[part], k[part], v[part], g[part], docs[part], scale, normalize_qk)
            span_t = _chunk_solve(k_hat, v[part], beta[part], b, docs[part])
            t[part] = span_t
            keep_final = output_final_state or i + 1 < len(spans)
            o[part], state, _ = _chunk_forward(
                q_hat, k_hat, v[part], beta[part], b, docs[part], span_t, state, keep_final, False
            )
        finals.append(state)
    return o, torch.cat(finals) if output_final_state else None, t, carried


def _span_backward(q, k, v, g, beta, docs, t, initial_state, do, dfinal, scale, normalize_qk):
    """dq, dk, dv, dg, dbeta and d initial_state of one pass's span: its tables but T (saved) and
    its per-chunk states rerun, then the chunk-parallel gradients."""
    q_hat, k_hat, b = _prepare(q, k, v, g, docs, scale, normalize_qk)
    _, _, saved = _chunk_forward(q_hat, k_hat, v, beta, b, docs, t, initial_state, False, True)
    dq_hat, dk_hat, dv, dbeta, db, dh0 = _chunk_backward(
        q_hat, k_hat, v, beta, b, docs, initial_state, saved, do, dfinal
    )
    dq = _normalized_backward(q, dq_hat, scale, normalize_qk)
    dk = _normalized_backward(k, dk_hat, 1.0, normalize_qk)
    dg = _chunk_cumsum(db, docs, True).to(g.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def gated_delta_rule(
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
    tokens_per_pass: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3.5's chunked gated delta rule; returns (o [B, T, Hv, Dv] in v's dtype, final state or None).

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv], Hv a multiple of Hk (v-head h reads k-head h // (Hv/Hk),
    as transformers' repeat_interleave); g (log-decay, <= 0) and beta [B, T, Hv]; doc_ids int [B, T]
    or None: the state restarts from zero where doc_ids changes, and initial_state (fp32
    [B, Hv, Dk, Dv]) seeds each row's first document only. The final state, fp32 [B, Hv, Dk, Dv],
    is the state after each row's last token. scale defaults to Dk**-0.5; normalize_qk L2-normalises
    q and k first (transformers' l2norm). Dk and Dv up to 256, any size (padded to powers of two).
    tokens_per_pass bounds the tokens whose chunk tables the Triton path's backward builds at once,
    and its forward's for a row longer than that (their bytes grow with the tokens; the result does
    not change); None: all at once.
    """
    _check(q, k, v, g, beta, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_triton(v):
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        return GatedDeltaRuleFunction.apply(
            q,
            k,
            v,
            g,
            beta,
            documents_per_token(doc_ids, v),
            initial_state,
            scale,
            normalize_qk,
            output_final_state,
            tokens_per_pass,
        )
    return gated_delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        doc_ids,
        scale=scale,
        normalize_qk=normalize_qk,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )


def gated_delta_rule_step(
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
    """One decode token: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv] -> o [B, Hv, Dv] in v's
    dtype; state (fp32 [B, Hv, Dk, Dv]) is updated in place. No host syncs and no value-dependent
    allocation, so a CUDA graph can capture it. Inference only (no autograd)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if use_triton(v):
        return _step(q, k, v, g, beta, state, scale, normalize_qk)
    return gated_delta_rule_step_reference(q, k, v, g, beta, state, scale=scale, normalize_qk=normalize_qk)
