"""Gated delta rule (Qwen3.5's Gated DeltaNet core): Triton (interpreter on CPU) against the
token-by-token reference, and the reference against transformers."""

import pytest
import torch
from checkpoints import captured_graph

from qlora_kernels.delta_rule import (
    CHUNK,
    GatedDeltaRuleFunction,
    gated_delta_rule,
    gated_delta_rule_reference,
    gated_delta_rule_step,
    gated_delta_rule_step_reference,
    scan,
)

# Tolerance, as a fraction of the expected tensor's largest magnitude. In fp32 every output, state
# and gradient entry is a sum of at most T (<= 200) products whose partial sums stay within a few
# times that magnitude, and the chunked form adds them in another order (in-chunk products, a
# triangular solve, a chunk-level scan) than the token loop. Each rounding is half an ulp (6e-8),
# and independent roundings grow like sqrt(terms): 6e-8 * sqrt(200) * a few ~ 3e-6. The decays
# exp(b_i - b_j) are differences of cumulative sums (|b| <= 64 * 0.5 here), which adds an
# ulp-sized relative error of |b| * 6e-8 ~ 2e-6. 1e-5 is three times that; every planted mistake
# (a missed reset, a lost decay, a dropped gradient term) is off by 1e-2 or more.
TOL = 1e-5

SEQ, K_HEADS, V_HEADS, K_DIM, V_DIM = 150, 1, 2, 24, 40


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL, name: str = ""):
    error = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= tol * scale, f"{name}: max error {error:.3e} > {tol} * {scale:.3e}"


def _doc_ids(lengths_per_row: list[list[int]], ids_per_row: list[list[int]] | None = None) -> torch.Tensor:
    rows = []
    for r, lengths in enumerate(lengths_per_row):
        ids = ids_per_row[r] if ids_per_row else range(len(lengths))
        rows.append(torch.cat([torch.full((n,), i) for i, n in zip(ids, lengths, strict=True)]))
    return torch.stack(rows)


# Row 0: a document ending exactly at the chunk boundary, then one of length 1 starting on it, then
# one starting mid-chunk. Row 1: a start mid-chunk (100), one on the second boundary (128) of
# length 1, and a document id that comes back (0) as a new document, since documents start where
# doc_ids changes.
PACKED = _doc_ids([[CHUNK, 1, 30, SEQ - CHUNK - 31], [100, 28, 1, SEQ - 129]], [[0, 1, 2, 3], [0, 1, 0, 2]])


def _inputs(
    batch=2, seq=SEQ, k_heads=K_HEADS, v_heads=V_HEADS, k_dim=K_DIM, v_dim=V_DIM, seed=0, device="cpu"
):
    """Leaves shaped as the model makes them: g = -exp(A_log) * softplus(.) <= 0, beta a sigmoid."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device)

    q = randn(batch, seq, k_heads, k_dim)
    k = randn(batch, seq, k_heads, k_dim)
    v = randn(batch, seq, v_heads, v_dim)
    g = -torch.nn.functional.softplus(randn(batch, seq, v_heads)) * 0.5
    beta = torch.sigmoid(randn(batch, seq, v_heads))
    state = randn(batch, v_heads, k_dim, v_dim) * 0.5
    return [t.requires_grad_(True) for t in (q, k, v, g, beta, state)]


def _run(fn, leaves, doc_ids, with_state, normalize_qk=True):
    q, k, v, g, beta, state = leaves
    return fn(
        q,
        k,
        v,
        g,
        beta,
        doc_ids,
        normalize_qk=normalize_qk,
        initial_state=state if with_state else None,
        output_final_state=with_state,
    )


def _grads(outputs, leaves, out_grads):
    pairs = [(o, d) for o, d in zip(outputs, out_grads, strict=True) if o is not None]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True)


@pytest.mark.parametrize(
    ("batch", "seq", "k_heads", "packed", "with_state", "normalize_qk"),
    [(1, SEQ, 2, False, False, True), (2, SEQ, 1, True, True, True), (1, 100, 2, False, True, False)],
    ids=["one-document", "packed-with-state", "unnormalized-with-state"],
)
@pytest.mark.parametrize("decays_on_tiles", [True, False], ids=["decays-on-tiles", "decays-on-products"])
def test_triton_matches_reference(
    batch, seq, k_heads, packed, with_state, normalize_qk, decays_on_tiles, monkeypatch
):
    """Two k-heads serving four v-heads check the head mapping; Dk = 24, Dv = 40 pad to 32 and
    split over two Dv blocks of the scans; T = 150 ends on a partial chunk. The scans' two forms
    (where the decays scale q and k, or the products' narrow side) each."""
    monkeypatch.setattr(scan, "_decays_on_tiles", lambda programs, device: decays_on_tiles)
    _check_against_reference(batch, seq, k_heads, packed, with_state, normalize_qk)


def test_state_crosses_chunks_under_weak_decay():
    """_inputs' decay sums to about -20 over a chunk, so what the state carries into the next chunk
    is e^-20 of what that chunk adds, below TOL. A decay 70 times weaker (about -0.3 a chunk) makes
    the scans' chunk-to-chunk state and its gradient as large as a chunk's own terms."""
    _check_against_reference(2, SEQ, 1, True, True, True, g_scale=0.015)


def test_state_gradients_add_up_over_value_blocks():
    """Dv = 72: the backward's state pass takes the [Dk, Dv] states in two blocks of 64 columns, the
    second mostly padding, and adds both blocks' shares of dq, dk, dW and db."""
    _check_against_reference(2, SEQ, 1, True, True, True, v_dim=72)


@pytest.mark.parametrize("with_state", [True, False], ids=["with-state", "no-state"])
@pytest.mark.parametrize(
    "tokens_per_pass", [150, 100, 64], ids=["row-by-row", "spans-of-one-chunk-and-a-tail", "chunk-by-chunk"]
)
def test_passes_carry_the_state_across_spans(tokens_per_pass, with_state):
    """A bound on the tokens a pass takes splits the batch into rows and a row into spans of whole
    chunks: the state must carry from span to span, forward and backward, and stop where a document
    starts on a span's first token (row 0 at 64, row 1 at 128). Under weak decay the carried state
    is as large as a chunk's own terms, so dropping it, or carrying it into a new document, fails."""
    leaves = _inputs(batch=2, seq=SEQ, k_heads=1, v_heads=2)
    with torch.no_grad():
        leaves[3].mul_(0.015)
    doc_ids = _doc_ids([[CHUNK, 1, 30, SEQ - CHUNK - 31], [2 * CHUNK, 1, SEQ - 2 * CHUNK - 1]])

    def in_passes(*args, **kwargs):
        return gated_delta_rule(*args, tokens_per_pass=tokens_per_pass, **kwargs)

    _assert_matches_reference(in_passes, leaves, doc_ids, with_state)


def _check_against_reference(batch, seq, k_heads, packed, with_state, normalize_qk, v_dim=V_DIM, g_scale=1.0):
    leaves = _inputs(batch=batch, seq=seq, k_heads=k_heads, v_heads=2 * k_heads, v_dim=v_dim)
    with torch.no_grad():
        leaves[3].mul_(g_scale)
    if not normalize_qk:
        # Unnormalised keys must keep the recurrence contractive (beta |k|^2 < 2) to be a fair test.
        with torch.no_grad():
            leaves[1].mul_(K_DIM**-0.5)
    _assert_matches_reference(gated_delta_rule, leaves, PACKED if packed else None, with_state, normalize_qk)


def _assert_matches_reference(fn, leaves, doc_ids, with_state, normalize_qk=True):
    """fn's outputs and every input's gradient against the reference's, under one random output
    gradient; fn must take the Triton path."""
    grad_leaves = leaves if with_state else leaves[:5]
    out = _run(fn, leaves, doc_ids, with_state, normalize_qk)
    ref = _run(gated_delta_rule_reference, leaves, doc_ids, with_state, normalize_qk)
    assert out[0].grad_fn.name().startswith(GatedDeltaRuleFunction.__name__)
    generator = torch.Generator().manual_seed(1)
    out_grads = [None if o is None else torch.randn(o.shape, generator=generator) for o in ref]
    for name, actual, expected in zip(["o", "final_state"], out, ref, strict=True):
        assert (actual is None) == (expected is None)
        if expected is not None:
            _assert_close(actual, expected, name=name)
    grads, ref_grads = _grads(out, grad_leaves, out_grads), _grads(ref, grad_leaves, out_grads)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dstate"][: len(grad_leaves)]
    for name, actual, expected in zip(names, grads, ref_grads, strict=True):
        _assert_close(actual, expected, name=name)


def test_packed_row_equals_documents_one_by_one():
    """Each document of a packed row, run alone from a zero state (the first from initial_state)."""
    q, k, v, g, beta, state = (t.detach() for t in _inputs(batch=1, seed=2))
    lengths = [CHUNK, 1, 30, SEQ - CHUNK - 31]
    doc_ids = _doc_ids([lengths])
    o, final = gated_delta_rule(q, k, v, g, beta, doc_ids, initial_state=state, output_final_state=True)
    start = 0
    for i, n in enumerate(lengths):
        part = [t[:, start : start + n] for t in (q, k, v, g, beta)]
        alone, alone_final = gated_delta_rule(
            *part, initial_state=state if i == 0 else None, output_final_state=True
        )
        _assert_close(o[:, start : start + n], alone, name=f"document {i}")
        start += n
    _assert_close(final, alone_final, name="final state")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_documents_reset_the_state(backend):
    """Packed rows equal their documents run alone, so the state of one never leaks into the next."""
    fn = gated_delta_rule if backend == "triton" else gated_delta_rule_reference
    q, k, v, g, beta, state = (t.detach() for t in _inputs(batch=1, seq=80, seed=3))
    doc_ids = _doc_ids([[50, 30]])
    o, _ = fn(q, k, v, g, beta, doc_ids, initial_state=state)
    second, _ = fn(*(t[:, 50:] for t in (q, k, v, g, beta)))
    _assert_close(o[:, 50:], second)
    first, _ = fn(*(t[:, :50] for t in (q, k, v, g, beta)), initial_state=state)
    _assert_close(o[:, :50], first)


def _step_inputs(seed):
    q, k, v, g, beta, state = (t.detach() for t in _inputs(seq=12, seed=seed))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("normalize_qk", [True, False])
def test_step_matches_reference_and_full_forward(normalize_qk):
    """T decode steps from initial_state give the full forward's outputs and final state."""
    q, k, v, g, beta, state = _step_inputs(4)
    if not normalize_qk:
        k = k * K_DIM**-0.5
    ours, ref_state = state.clone(), state.clone()
    outputs = []
    for t in range(q.shape[1]):
        args = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        o = gated_delta_rule_step(*args, ours, normalize_qk=normalize_qk)
        expected = gated_delta_rule_step_reference(*args, ref_state, normalize_qk=normalize_qk)
        _assert_close(o, expected, name=f"step {t}")
        _assert_close(ours, ref_state, name=f"state after step {t}")
        outputs.append(o)
    full, final = gated_delta_rule_reference(
        q, k, v, g, beta, normalize_qk=normalize_qk, initial_state=state, output_final_state=True
    )
    _assert_close(torch.stack(outputs, 1), full, name="outputs")
    _assert_close(ours, final, name="final state")


def test_reference_path_without_interpreter(reference_ops):
    leaves = _inputs(seq=20)
    o, final = _run(gated_delta_rule, leaves, None, True)
    ref, ref_final = _run(gated_delta_rule_reference, leaves, None, True)
    assert "GatedDeltaRule" not in o.grad_fn.name()
    torch.testing.assert_close(o, ref, atol=0, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=0, rtol=0)


def _transformers():
    return pytest.importorskip(
        "transformers.models.qwen3_5.modeling_qwen3_5", reason="transformers without Qwen3.5"
    )


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_reference_matches_transformers(form):
    modeling = _transformers()
    fn = (
        modeling.torch_recurrent_gated_delta_rule
        if form == "recurrent"
        else modeling.torch_chunk_gated_delta_rule
    )
    q, k, v, g, beta, state = (t.detach() for t in _inputs(seq=100, seed=5))
    hf, hf_final = fn(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ours, final = gated_delta_rule_reference(q, k, v, g, beta, initial_state=state, output_final_state=True)
    _assert_close(ours, hf, name="o")
    _assert_close(final, hf_final, name="final state")


# Qwen3.5-9B's Gated DeltaNet: 16 k-heads, 32 v-heads, head dims 128; two packed rows of 2048.
GPU_SHAPE = {"batch": 2, "seq": 2048, "k_heads": 16, "v_heads": 32, "k_dim": 128, "v_dim": 128}
GPU_PACKED = [[700, 1, 1283, 64], [1024, 1024]]

# bf16 q, k, v, beta and incoming gradients, compared with the fp32 reference run on the same
# (upcast) values. With bf16 inputs the kernels store q, k and the chunk tables in bf16 and multiply
# on tensor cores (bf16 operands, fp32 accumulation; see TENSOR_CORE_DTYPES), so with u = 2^-8 bf16's
# unit roundoff (round to nearest: relative error within [-u, u], rms about u/sqrt(3)):
# - one product sum_n a_n b_n rounds both operands of every term: an independent relative error of
#   rms sqrt(2/3) u = 0.82u per term, so the product's error is 0.82u times the rms of its terms,
#   whatever n (the sqrt(n) growth of the error is the sum's own for random-sign terms);
# - o is at the end of 5 such products (K K^T, T (beta V) and T (beta K), W S, Q S and Aqk delta)
#   and 5 bf16 stores (q, k, T, W, Aqk): sqrt(5 * 0.82^2 + 5 / 3) u = 2.2u = 0.86% rms. The fp32
#   state carries each chunk's error on, but the recurrence never expands it (|exp(g)| <= 1,
#   ||I - beta k k^T|| <= 1 for |k| = 1), so the state's error stays that fraction of the state;
# - a gradient is at the end of the recomputed forward and up to 7 products back (and delta and
#   d delta stored in bf16): sqrt(12 * 0.82^2 + 7 / 3) u = 3.2u = 1.25% rms;
# - dbeta and dg are sums whose terms cancel (dbeta: d(beta v) . v + the W term + the dA term; dg:
#   a reverse sum of db = row minus column sums of the same products), so their error is relative
#   to the terms, about twice the result here: 2.5% rms;
# - the test takes max error over max value: over 10^7 entries both are ~5 rms, but the error of an
#   entry is a sum of few dominant roundings with a heavier tail, allow 1.5x; the stored bf16 result
#   adds u = 0.4% of the largest entry.
# So o and the final state 1.5 * 0.86 + 0.4 = 1.7%, the gradients 1.5 * 1.25 + 0.4 = 2.3%, dbeta and
# dg 1.5 * 2.5 + 0.4 = 4.2% of the largest value. An emulation on the CPU (the interpreter, its bf16
# products and round-to-nearest casts patched to the GPU's, T = 192, Dk = Dv = 128) measured max/max
# errors of 0.5% (o), 0.3-0.5% (dq, dk, dv, dg) and 1.2% (dbeta, 0.8% rms), within these; the same
# emulation with dk's transposed decay planted wrong (decay for decay^T, 12% rms) measured 3.7% on dk.
BF16_TOL = {
    "o": 2e-2,
    "final state": 2e-2,
    "dq": 2.5e-2,
    "dk": 2.5e-2,
    "dv": 2.5e-2,
    "dstate": 2.5e-2,
    "dg": 4.5e-2,
    "dbeta": 4.5e-2,
}
# Two o's, each with its own rounding errors against the reference: sqrt(2) * 0.86% rms, so
# 1.5 * 1.2 + 0.4 = 2.2% of the largest value.
BF16_PAIR_TOL = 2.5e-2


def _gpu_case(seed=0):
    leaves = _inputs(**GPU_SHAPE, seed=seed, device="cuda")
    q, k, v, g, beta, state = (t.detach() for t in leaves)
    bf16 = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    return [*bf16, g.requires_grad_(True), beta.bfloat16().requires_grad_(True), state.requires_grad_(True)]


# The model's bound on a pass's tokens at this shape: all at once, row by row, and spans of 1024
# (row 1's second document starts on the second span's first token).
GPU_TOKENS_PER_PASS = [None, 2048, 1024]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens_per_pass", GPU_TOKENS_PER_PASS)
def test_gpu_bf16_against_fp32_reference(tokens_per_pass):
    leaves = _gpu_case()
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    doc_ids = _doc_ids(GPU_PACKED).cuda()

    def in_passes(*args, **kwargs):
        return gated_delta_rule(*args, tokens_per_pass=tokens_per_pass, **kwargs)

    out = _run(in_passes, leaves, doc_ids, True)
    ref = _run(gated_delta_rule_reference, ref_leaves, doc_ids, True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(ref[0].shape, generator=generator, device="cuda").bfloat16()
    dfinal = torch.randn(ref[1].shape, generator=generator, device="cuda")
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    _assert_close(out[0], ref[0], BF16_TOL["o"], "o")
    _assert_close(out[1], ref[1], BF16_TOL["final state"], "final state")
    grads = torch.autograd.grad(out, leaves, (do, dfinal))
    ref_grads = torch.autograd.grad(ref, ref_leaves, (do.float(), dfinal))
    for name, actual, expected, leaf in zip(
        ["dq", "dk", "dv", "dg", "dbeta", "dstate"], grads, ref_grads, leaves, strict=True
    ):
        assert actual.dtype == leaf.dtype
        _assert_close(actual, expected, BF16_TOL[name], name)


@pytest.mark.gpu
def test_gpu_packed_row_equals_documents_one_by_one():
    q, k, v, g, beta, _ = (t.detach() for t in _gpu_case(seed=2))
    doc_ids = _doc_ids(GPU_PACKED).cuda()
    o, _ = gated_delta_rule(q, k, v, g, beta, doc_ids)
    for row, lengths in enumerate(GPU_PACKED):
        start = 0
        for n in lengths:
            part = [t[row : row + 1, start : start + n] for t in (q, k, v, g, beta)]
            alone, _ = gated_delta_rule(*part)
            # Chunks fall elsewhere in the document alone, so the bf16 operand roundings differ.
            _assert_close(o[row : row + 1, start : start + n], alone, BF16_PAIR_TOL, f"row {row} at {start}")
            start += n


@pytest.mark.gpu
@pytest.mark.parametrize("tokens_per_pass", GPU_TOKENS_PER_PASS)
def test_gpu_cuda_graph_replay_equals_eager(tokens_per_pass):
    """Forward + backward captured in one graph, and the decode step in another, replay bit for bit
    as eager calls: no host syncs, no value-dependent shapes and no atomics in the Triton path."""
    leaves = _gpu_case(seed=3)
    doc_ids = _doc_ids(GPU_PACKED).cuda()
    do = torch.randn(leaves[2].shape, device="cuda").bfloat16()

    def in_passes(*args, **kwargs):
        return gated_delta_rule(*args, tokens_per_pass=tokens_per_pass, **kwargs)

    def step(inputs):
        o, final = _run(in_passes, inputs, doc_ids, True)
        return (o, final, *torch.autograd.grad((o, final), inputs, (do, torch.ones_like(final))))

    # The eager run takes copies: a leaf that autograd first met on the default (legacy) stream would
    # make the captured backward wait on that stream, which capture forbids (CUDA's
    # cudaErrorStreamCaptureImplicit on the H200); the graph's leaves first meet autograd in warm-up.
    expected = step([t.detach().clone().requires_grad_(t.requires_grad) for t in leaves])
    graph, captured = captured_graph(lambda: step(leaves))
    graph.replay()
    torch.cuda.synchronize()
    for actual, want in zip(captured, expected, strict=True):
        torch.testing.assert_close(actual, want, atol=0, rtol=0)

    q, k, v, g, beta, state = (t.detach() for t in leaves)
    eager_state, graph_state = state.clone(), state.clone()
    eager_o = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], eager_state)
    warm = state.clone()
    gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], warm)
    step_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step_graph):
        graph_o = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], graph_state)
    graph_state.copy_(state)
    step_graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_o, eager_o, atol=0, rtol=0)
    torch.testing.assert_close(graph_state, eager_state, atol=0, rtol=0)


def test_each_chunks_solve_inverts_i_plus_a():
    """The tables' T is (I + A)^-1 for every chunk, with A[i, j] = beta_i (k_i . k_j) exp(b_i - b_j) for
    the earlier tokens j of i's document: documents start mid-16-token block (7, 37, 100) and on block
    and chunk boundaries (16, 64, 128), so the four diagonal inversions and their merges all see resets.
    A's entries stay within 1 (unit keys, beta < 1, decays <= 1) and T's within a few units, so
    T (I + A) sums 64 products of that size: fp32 puts it within 64 ulp of I, 1e-5."""
    from qlora_kernels._layout import document_index
    from qlora_kernels.delta_rule.tables import _chunk_cumsum, _chunk_solve, _normalized

    seq = 150
    doc_ids = _doc_ids([[7, 9, 21, 27, 64, 22], [16, 84, 28, 22]])
    q, k, v, g, beta, _ = (t.detach() for t in _inputs(seq=seq, v_heads=2, k_heads=1))
    docs = document_index(doc_ids)
    k = _normalized(k, 1.0, True, torch.float32)
    b = _chunk_cumsum(g, docs, False)
    t = _chunk_solve(k, v, beta, b, docs)
    for row in range(2):
        for head in range(2):
            for start in range(0, seq, CHUNK):
                span = slice(start, min(start + CHUNK, seq))
                n = span.stop - span.start
                keys, decay = k[row, span, 0], b[row, span, head]
                same = docs[row, span, None] == docs[row, None, span]
                earlier = torch.arange(n)[:, None] > torch.arange(n)[None, :]
                a = beta[row, span, head, None] * (keys @ keys.T) * (decay[:, None] - decay[None, :]).exp()
                a = torch.where(same & earlier, a, 0.0)
                inverse = t[row, span, head, :n].tril()  # the kernel writes T's lower blocks alone
                _assert_close(inverse @ (torch.eye(n) + a), torch.eye(n), name=f"{row} {head} {start}")
