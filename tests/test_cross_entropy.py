"""Fused lm_head + cross-entropy against the fp32 torch reference."""

import weakref

import pytest
import torch
from checkpoints import captured_graph

from qlora_kernels.cross_entropy import (
    default_chunk_size,
    linear_cross_entropy,
    linear_cross_entropy_forward,
    linear_cross_entropy_reference,
    linear_document_logprobs,
    linear_document_logprobs_reference,
)

UPSTREAM_GRAD = 0.37


def make_inputs(n_rows, hidden_size, n_vocab, ignored_every=None, device="cpu", dtype=torch.float32, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n_rows, hidden_size, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(n_vocab, hidden_size, generator=generator, device=device, dtype=dtype)
    weight *= hidden_size**-0.5
    labels = torch.randint(0, n_vocab, (n_rows,), generator=generator, device=device)
    if ignored_every is not None:
        labels[::ignored_every] = -100
    return hidden, weight, labels


def reference_loss_and_grad(hidden, weight, labels):
    hidden = hidden.detach().requires_grad_()
    loss_sum, n_tokens = linear_cross_entropy_reference(hidden, weight, labels)
    (grad,) = torch.autograd.grad(loss_sum * UPSTREAM_GRAD, hidden)
    return loss_sum.detach(), n_tokens, grad


def fused_loss_and_grad(hidden, weight, labels, chunk_size, trained_rows_only=False):
    hidden = hidden.detach().requires_grad_()
    loss_sum, n_tokens = linear_cross_entropy(
        hidden, weight, labels, chunk_size=chunk_size, trained_rows_only=trained_rows_only
    )
    (grad,) = torch.autograd.grad(loss_sum * UPSTREAM_GRAD, hidden)
    return loss_sum.detach(), n_tokens, grad


@pytest.mark.parametrize(
    ("n_vocab", "chunk_size", "ignored_every"),
    [(300, 5, 3), (300, 16, 4), (300, 37, None), (300, None, 2), (300, 100, 1), (5000, 16, 3)],
)
@pytest.mark.parametrize("trained_rows_only", [False, True], ids=["all-rows", "trained-rows-only"])
def test_matches_reference(n_vocab, chunk_size, ignored_every, trained_rows_only):
    """Trained rows only: the rows put trained-first leave whole chunks past the trained ones (chunk 5,
    every 3rd row ignored) and chunks cut inside them; the GEMMs leave those rows unwritten."""
    hidden, weight, labels = make_inputs(37, 48, n_vocab, ignored_every)
    ref_loss, ref_count, ref_grad = reference_loss_and_grad(hidden, weight, labels)
    loss, count, grad = fused_loss_and_grad(hidden, weight, labels, chunk_size, trained_rows_only)

    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert count.dtype == torch.int64 and count.dim() == 0
    assert count.item() == ref_count.item() == int((labels != -100).sum())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(grad[labels == -100]) == 0


@pytest.mark.parametrize("trained_rows_only", [False, True], ids=["all-rows", "trained-rows-only"])
def test_all_ignored_gives_zero_loss_count_and_grad(trained_rows_only):
    hidden, weight, labels = make_inputs(37, 48, 300, ignored_every=1)
    loss, count, grad = fused_loss_and_grad(
        hidden, weight, labels, chunk_size=16, trained_rows_only=trained_rows_only
    )
    assert loss.item() == 0.0 and count.item() == 0
    assert torch.count_nonzero(grad) == 0


def test_trained_rows_only_holds_one_chunk_of_logits_at_a_time(monkeypatch):
    """The grouped GEMM allocates each chunk's logits (it takes no out=): the chunk before must be
    gone by then, or two chunks of logits (256 MiB each at a 150K vocabulary) are held at once."""
    hidden, weight, labels = make_inputs(37, 48, 300, ignored_every=3)
    logits, held = [], []
    grouped_mm = torch._grouped_mm

    def tracking(a, b, **kwargs):
        earlier = sum(ref() is not None for ref in logits)
        out = grouped_mm(a, b, **kwargs)
        if out.shape[-1] == weight.shape[0]:
            held.append(earlier)
            logits.append(weakref.ref(out))
        return out

    monkeypatch.setattr(torch, "_grouped_mm", tracking)
    fused_loss_and_grad(hidden, weight, labels, chunk_size=8, trained_rows_only=True)
    assert held == [0] * 5


def test_without_grad_returns_loss_only():
    hidden, weight, labels = make_inputs(37, 48, 300, ignored_every=5)
    ref_loss, _ = linear_cross_entropy_reference(hidden, weight, labels)
    loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=10)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_reference_path_matches(reference_ops):
    hidden, weight, labels = make_inputs(37, 48, 300, ignored_every=3)
    ref_loss, ref_count, ref_grad = reference_loss_and_grad(hidden, weight, labels)
    loss, count, grad = fused_loss_and_grad(hidden, weight, labels, chunk_size=8)
    assert torch.equal(loss, ref_loss) and torch.equal(count, ref_count) and torch.equal(grad, ref_grad)


def test_refuses_trainable_weight():
    hidden, weight, labels = make_inputs(4, 48, 300)
    with pytest.raises(ValueError, match="no gradient for weight"):
        linear_cross_entropy(hidden, weight.requires_grad_(), labels)


@pytest.mark.parametrize("on_reference_ops", [False, True])
def test_refuses_labels_outside_vocab(on_reference_ops, request):
    if on_reference_ops:
        request.getfixturevalue("reference_ops")
    hidden, weight, labels = make_inputs(4, 48, 300)
    labels[2] = 300
    with pytest.raises(ValueError, match="outside the vocabulary"):
        linear_cross_entropy(hidden, weight, labels)


def test_default_chunk_size_bounds_logits_bytes():
    rows = default_chunk_size(8192, 152064, 2)
    assert rows % 128 == 0 and rows * 152064 * 2 <= 256 * 1024 * 1024
    assert default_chunk_size(37, 300, 4) == 37
    assert default_chunk_size(8192, 10**9, 4) == 1


def chunked_reference(hidden, weight, labels, rows_per_chunk=1024):
    """fp32 reference one chunk at a time, so its logits never take N x V fp32 memory."""
    weight = weight.float()
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], rows_per_chunk):
        chunk = hidden[start : start + rows_per_chunk].float().requires_grad_()
        chunk_loss, _ = linear_cross_entropy_reference(chunk, weight, labels[start : start + rows_per_chunk])
        (grad[start : start + rows_per_chunk],) = torch.autograd.grad(chunk_loss * UPSTREAM_GRAD, chunk)
        loss_sum += chunk_loss.detach()
    return loss_sum, grad


def qwen_lm_head_inputs():
    """Qwen2.5-7B lm_head at 4 x 2048 tokens, bf16, with a tenth of the labels ignored."""
    hidden, weight, labels = make_inputs(
        4 * 2048, 3584, 152064, ignored_every=10, device="cuda", dtype=torch.bfloat16
    )
    return hidden, weight, labels


@pytest.mark.gpu
@pytest.mark.parametrize("trained_rows_only", [False, True], ids=["all-rows", "trained-rows-only"])
def test_gpu_qwen_shape_matches_fp32_reference(trained_rows_only):
    hidden, weight, labels = qwen_lm_head_inputs()
    ref_loss, ref_grad = chunked_reference(hidden, weight, labels)
    loss, count, grad = fused_loss_and_grad(hidden, weight, labels, None, trained_rows_only)

    assert count.item() == int((labels != -100).sum())
    # bf16 logits (fp32-accumulated GEMM) shift each token's loss a little, without bias: the sum
    # agreed to 3e-7 relative on an H200.
    torch.testing.assert_close(loss, ref_loss, rtol=2e-5, atol=0.0)
    # d hidden comes out of a bf16 GEMM on bf16 softmax - onehot: bf16-level agreement (measured
    # 2.3e-3 relative in norm, 4.4e-3 of the largest entry at most).
    grad = grad.float()
    assert (grad - ref_grad).norm() <= 5e-3 * ref_grad.norm()
    assert (grad - ref_grad).abs().max() <= 1e-2 * ref_grad.abs().max()
    assert torch.count_nonzero(grad[labels == -100]) == 0


@pytest.mark.gpu
def test_gpu_trained_rows_only_replays_in_a_cuda_graph_for_any_mask():
    """The trained rows' count is a device value, so one captured graph serves micro-batches whose masks
    differ: none, a masked prompt of 3,000 tokens, all but the last 192 (a whole chunk with no trained
    row). Each replay matches the fp32 reference within the bounds of the test above (one bf16 GEMM
    pair either way), and the ignored rows' gradient is exactly 0."""
    hidden, weight, labels = qwen_lm_head_inputs()
    masked = labels.clone()

    def forward():
        return linear_cross_entropy_forward(hidden, weight, masked, None, -100, True, trained_rows_only=True)

    graph, (row_loss, grad) = captured_graph(forward)
    for prompt in (0, 3000, hidden.shape[0] - 192):
        masked.copy_(labels)
        masked[:prompt] = -100
        graph.replay()
        ref_loss, ref_grad = chunked_reference(hidden, weight, masked)
        torch.testing.assert_close(row_loss.sum(), ref_loss, rtol=2e-5, atol=0.0)
        ours = grad.float() * UPSTREAM_GRAD
        assert (ours - ref_grad).norm() <= 5e-3 * ref_grad.norm()
        assert torch.count_nonzero(grad[masked == -100]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("trained_rows_only", [False, True], ids=["all-rows", "trained-rows-only"])
def test_gpu_peak_memory_holds_one_logits_chunk(trained_rows_only):
    """What the loss holds beyond its inputs: one chunk of logits (256 MiB of the 2376 MiB full
    logits), d hidden (56 MiB), and small change: a chunk's gathered rows and their gradient (6 MiB
    each), the row order, labels and losses (under 0.3 MiB), cuBLAS's workspace (32 MiB at most on
    Hopper). A second chunk of logits held at once would add 256 MiB."""
    hidden, weight, labels = qwen_lm_head_inputs()
    hidden.requires_grad_()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    loss, count = linear_cross_entropy(hidden, weight, labels, trained_rows_only=trained_rows_only)
    (loss / count).backward()
    torch.cuda.synchronize()

    extra = torch.cuda.max_memory_allocated() - baseline
    rows, vocab = hidden.shape[0], weight.shape[0]
    logits_chunk = default_chunk_size(rows, vocab, 2) * vocab * 2
    bound = logits_chunk + hidden.numel() * 2 + 64 * 2**20
    assert extra <= bound, f"peak extra {extra / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"


# Three packed rows of 13: documents of 4, 5 and 4 tokens (the last all ignored, as padding is); one
# document whose id comes back after another (a new document); one document filling the row.
PACKED_DOC_IDS = torch.tensor(
    [[0] * 4 + [1] * 5 + [2] * 4, [0] * 3 + [1] * 6 + [0] * 4, [5] * 13], dtype=torch.int32
)


def packed_inputs(n_vocab=301, hidden_size=24, seed=1):
    hidden, weight, labels = make_inputs(39, hidden_size, n_vocab, ignored_every=4, seed=seed)
    labels = labels.view(3, 13)
    labels[0, 9:] = -100
    return hidden.view(3, 13, hidden_size), weight, labels


def document_logprobs_by_hand(hidden, weight, labels, doc_ids):
    """Each document's label log-probs summed from F.log_softmax gathers, its span read off doc_ids
    one row at a time: [b, d] for row b's d-th document."""
    sums = torch.zeros(labels.shape, dtype=torch.float32)
    logprobs = torch.nn.functional.log_softmax(hidden.float() @ weight.float().T, dim=-1)
    for b in range(labels.shape[0]):
        row_ids = doc_ids[b].tolist() if doc_ids is not None else [0] * labels.shape[1]
        starts = [t for t in range(len(row_ids)) if t == 0 or row_ids[t] != row_ids[t - 1]]
        for d, (start, end) in enumerate(zip(starts, [*starts[1:], len(row_ids)], strict=True)):
            for t in range(start, end):
                if labels[b, t] != -100:
                    sums[b, d] = sums[b, d] + logprobs[b, t, labels[b, t]]
    return sums


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize(("doc_ids", "chunk_size"), [(PACKED_DOC_IDS, 5), (PACKED_DOC_IDS, None), (None, 7)])
def test_document_logprobs_forward_and_backward_match_log_softmax_gathers(path, doc_ids, chunk_size, request):
    """Per-document sums and the gradient they send to hidden, for upstream weights that differ per
    document, on odd packed shapes: the kernel in the interpreter and the torch reference alike."""
    if path == "reference":
        request.getfixturevalue("reference_ops")
    hidden, weight, labels = packed_inputs()
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    expected_hidden = hidden.clone().requires_grad_()
    expected = document_logprobs_by_hand(expected_hidden, weight, labels, doc_ids)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), expected_hidden)
    got_hidden = hidden.clone().requires_grad_()
    got = linear_document_logprobs(got_hidden, weight, labels, doc_ids, chunk_size=chunk_size)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), got_hidden)

    assert got.dtype == torch.float32 and got.shape == labels.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)
    if doc_ids is not None:
        assert (got[0, 2], got[1, 3:].abs().sum(), got[2, 1:].abs().sum()) == (0, 0, 0)
        assert torch.count_nonzero(got_grad[labels == -100]) == 0


def test_document_logprobs_sum_to_minus_the_loss():
    """Every document's log-prob, summed, is minus linear_cross_entropy's summed loss."""
    hidden, weight, labels = packed_inputs(n_vocab=5000)
    sums = linear_document_logprobs(hidden, weight, labels, PACKED_DOC_IDS, chunk_size=16)
    loss_sum, _ = linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), chunk_size=16)
    torch.testing.assert_close(-sums.sum(), loss_sum, rtol=1e-5, atol=1e-4)
    reference = linear_document_logprobs_reference(hidden, weight, labels, PACKED_DOC_IDS)
    torch.testing.assert_close(sums, reference, rtol=1e-5, atol=1e-5)


def test_document_logprobs_refuse_mismatched_shapes():
    hidden, weight, labels = packed_inputs()
    with pytest.raises(ValueError, match=r"hidden \[B, T, H\] and labels \[B, T\]"):
        linear_document_logprobs(hidden, weight, labels.flatten(), PACKED_DOC_IDS)
    with pytest.raises(ValueError, match="doc_ids must be"):
        linear_document_logprobs(hidden, weight, labels, PACKED_DOC_IDS[:, :5])
