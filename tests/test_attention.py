"""Attention: Triton kernel (interpreter on CPU), sdpa and flex backends against the fp32 reference."""

import pytest
import torch

from qlora_kernels.attention import (
    _allowed_mask,
    attention,
    attention_flex,
    attention_reference,
    document_block_mask,
)


def _packed_doc_ids(batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of several documents of random lengths, the last one standing in for padding."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=generator)[:3].add(1).sort().values.tolist()
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq_len], strict=True)]
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows)


def _qkv_views(batch, seq_len, n_q_heads, n_kv_heads, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v as strided slices of one fused projection output, as the model produces them."""
    generator = torch.Generator(device=device).manual_seed(seed)
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    fused = torch.randn(batch, seq_len, width, generator=generator, device=device, dtype=dtype)
    fused.requires_grad_(True)
    return (fused, *_split_fused(fused, n_q_heads, n_kv_heads, head_dim))


def _split_fused(fused, n_q_heads, n_kv_heads, head_dim):
    q_end, k_end = n_q_heads * head_dim, (n_q_heads + n_kv_heads) * head_dim
    q = fused[..., :q_end].unflatten(-1, (n_q_heads, head_dim))
    k = fused[..., q_end:k_end].unflatten(-1, (n_kv_heads, head_dim))
    v = fused[..., k_end:].unflatten(-1, (n_kv_heads, head_dim))
    return q, k, v


def _output_and_grads(fn, fused, q, k, v, doc_ids, dout):
    out = fn(q, k, v, doc_ids)
    (grad,) = torch.autograd.grad(out, fused, dout)
    return out, grad


CASES = [
    # seq_len, head_dim, n_q_heads, n_kv_heads, with_docs
    (17, 16, 2, 2, False),
    (17, 32, 6, 2, True),
    (40, 16, 6, 2, False),
    (40, 32, 3, 1, True),
    (40, 16, 2, 2, True),
    # The head sizes of the shipped families: Qwen2.5-0.5B, the 7-9B models, Qwen3.5's attention.
    (23, 64, 2, 1, True),
    (23, 128, 4, 2, True),
    (23, 256, 4, 1, True),
]


@pytest.mark.parametrize(("seq_len", "head_dim", "n_q_heads", "n_kv_heads", "with_docs"), CASES)
def test_triton_matches_reference(seq_len, head_dim, n_q_heads, n_kv_heads, with_docs):
    fused, q, k, v = _qkv_views(2, seq_len, n_q_heads, n_kv_heads, head_dim)
    assert not q.is_contiguous()
    generator = torch.Generator().manual_seed(1)
    doc_ids = _packed_doc_ids(2, seq_len, generator) if with_docs else None
    dout = torch.randn(2, seq_len, n_q_heads, head_dim, generator=generator)

    out, grad = _output_and_grads(attention, fused, q, k, v, doc_ids, dout)
    ref_out, ref_grad = _output_and_grads(attention_reference, fused, q, k, v, doc_ids, dout)

    assert out.shape == (2, seq_len, n_q_heads, head_dim) and out.is_contiguous()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    # The fused gradient holds dq, dk and dv side by side.
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_docs", [False, True])
def test_sdpa_backend_matches_reference(with_docs):
    fused, q, k, v = _qkv_views(2, 40, 6, 2, 16)
    generator = torch.Generator().manual_seed(2)
    doc_ids = _packed_doc_ids(2, 40, generator) if with_docs else None
    dout = torch.randn(2, 40, 6, 16, generator=generator)

    def sdpa(q, k, v, doc_ids):
        return attention(q, k, v, doc_ids, backend="sdpa")

    out, grad = _output_and_grads(sdpa, fused, q, k, v, doc_ids, dout)
    ref_out, ref_grad = _output_and_grads(attention_reference, fused, q, k, v, doc_ids, dout)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("with_docs", [False, True])
def test_sdpa_backward_is_handed_a_contiguous_gradient(with_docs, monkeypatch):
    """Whatever layout the gradient arrives in, torch's attention backward receives it contiguous
    in the layout of its own output: cuDNN attention reads a later call's gradient with the first
    one's strides (kernels.attention._ContiguousGradient; the GPU test below measures the harm)."""
    fused, q, k, v = _qkv_views(1, 40, 6, 2, 16)
    doc_ids = _packed_doc_ids(1, 40, torch.Generator().manual_seed(2)) if with_docs else None
    layouts = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        out.register_hook(lambda grad: layouts.append(grad.transpose(1, 2).is_contiguous()))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    joined = torch.randn(1, 40, 6 * 16 + 4)
    strided = joined[..., : 6 * 16].view(q.shape)
    _output_and_grads(lambda *a: attention(*a, backend="sdpa"), fused, q, k, v, doc_ids, strided)
    assert layouts == [True]


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("with_docs", [False, True])
def test_a_window_shorter_than_the_row_matches_the_reference_windowed(with_docs, window):
    """Each query sees the `window` latest keys of its document, itself included: on every backend, in
    blocks of `window` queries that do not divide the row, forward and backward."""
    fused, q, k, v = _qkv_views(2, 37, 6, 2, 16)
    generator = torch.Generator().manual_seed(4)
    doc_ids = _packed_doc_ids(2, 37, generator) if with_docs else None
    dout = torch.randn(2, 37, 6, 16, generator=generator)

    def reference(q, k, v, doc_ids):
        return attention_reference(q, k, v, doc_ids, window=window)

    ref_out, ref_grad = _output_and_grads(reference, fused, q, k, v, doc_ids, dout)
    unwindowed = attention_reference(q, k, v, doc_ids)
    assert not torch.allclose(ref_out, unwindowed)
    for backend in ("triton", "sdpa", "flex"):

        def windowed(q, k, v, doc_ids, backend=backend):
            return attention(q, k, v, doc_ids, backend=backend, window=window)

        out, grad = _output_and_grads(windowed, fused, q, k, v, doc_ids, dout)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)
    # A window as long as the row cuts nothing.
    torch.testing.assert_close(attention(q, k, v, doc_ids, window=37), unwindowed, atol=1e-5, rtol=1e-5)


def test_the_reference_window_keeps_the_latest_keys_itself_included():
    mask = _allowed_mask(5, None, torch.device("cpu"), window=2)[0, 0]
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_documents_are_isolated():
    """Changing one document's keys and values leaves every other document's output unchanged."""
    _, q, k, v = _qkv_views(1, 24, 2, 1, 16)
    q, k, v = q.detach(), k.detach().clone(), v.detach().clone()
    doc_ids = torch.tensor([[0] * 7 + [1] * 11 + [2] * 6])
    out = attention(q, k, v, doc_ids)
    k[:, 7:18] += 1.0
    v[:, 7:18] -= 2.0
    changed = attention(q, k, v, doc_ids)
    torch.testing.assert_close(changed[:, :7], out[:, :7])
    torch.testing.assert_close(changed[:, 18:], out[:, 18:])
    assert not torch.allclose(changed[:, 7:18], out[:, 7:18])


def test_reference_path_outside_interpreter(reference_ops):
    _, q, k, v = _qkv_views(1, 9, 4, 2, 16)
    torch.testing.assert_close(attention(q, k, v, scale=0.3), attention_reference(q, k, v, scale=0.3))


# Unfused on the CPU, as torch warns once: what is checked here is the mask.
UNFUSED_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@UNFUSED_FLEX
@pytest.mark.parametrize(("seq_len", "head_dim", "n_q_heads", "n_kv_heads", "with_docs"), CASES)
def test_flex_forward_matches_reference(seq_len, head_dim, n_q_heads, n_kv_heads, with_docs):
    """FlexAttention's document mask, on the CPU where it runs forward only (unfused)."""
    generator = torch.Generator().manual_seed(2)
    _, q, k, v = (t.detach() for t in _qkv_views(2, seq_len, n_q_heads, n_kv_heads, head_dim, seed=2))
    doc_ids = _packed_doc_ids(2, seq_len, generator) if with_docs else None
    out = attention_flex(q, k, v, doc_ids, scale=0.2)
    torch.testing.assert_close(out, attention_reference(q, k, v, doc_ids, scale=0.2), atol=1e-5, rtol=1e-5)


@UNFUSED_FLEX
def test_flex_block_mask_follows_the_doc_ids_it_is_given():
    """The mask is built once per doc_ids tensor and rebuilt when the tensor or its contents change."""
    _, q, k, v = (t.detach() for t in _qkv_views(1, 24, 2, 1, 16, seed=3))
    first = torch.zeros(1, 24, dtype=torch.int32)
    first[:, 10:] = 1
    second = torch.zeros(1, 24, dtype=torch.int32)
    second[:, 5:] = 1
    for doc_ids in (first, second, first):
        out = attention_flex(q, k, v, doc_ids)
        torch.testing.assert_close(out, attention_reference(q, k, v, doc_ids), atol=1e-5, rtol=1e-5)
    first[:, 18:] = 2  # written in place, as a CUDA graph's static input is
    torch.testing.assert_close(
        attention_flex(q, k, v, first), attention_reference(q, k, v, first), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("seq_len", [64, 70])
def test_flex_block_mask_lists_exactly_the_blocks_with_allowed_pairs(with_docs, seq_len):
    """The key blocks each query block reads are those holding at least one pair the document mask
    allows: none missing (a wrong output), none extra (work a skip should save)."""
    doc_ids = _packed_doc_ids(2, seq_len, torch.Generator().manual_seed(6)) if with_docs else None
    block = 8
    mask = document_block_mask(doc_ids, 2, seq_len, torch.device("cpu"), block=block)
    allowed = _allowed_mask(seq_len, doc_ids, torch.device("cpu"))[:, 0].expand(2, seq_len, seq_len)
    padded = -(-seq_len // block) * block
    grid = torch.zeros(2, padded, padded, dtype=torch.bool)
    grid[:, :seq_len, :seq_len] = allowed
    needed = grid.unflatten(1, (-1, block)).unflatten(3, (-1, block)).any(dim=4).any(dim=2)
    assert torch.equal(mask.to_dense()[:, 0].bool(), needed)
    # Full (the mask function skipped): below the diagonal with every real pair allowed; the rest partial.
    grid[:, seq_len:, :] = True
    grid[:, :, seq_len:] = True
    every = grid.unflatten(1, (-1, block)).unflatten(3, (-1, block)).all(dim=4).all(dim=2)
    full = every & torch.ones_like(every).tril(-1)
    assert full.any() and (needed & ~full).any()
    assert _block_lists(mask.full_kv_num_blocks, mask.full_kv_indices) == _block_sets(full)
    assert _block_lists(mask.kv_num_blocks, mask.kv_indices) == _block_sets(needed & ~full)


def _block_lists(counts, indices):
    """Per (row of the batch, query block), the key blocks a BlockMask lists (one head)."""
    return [
        [indices[b, 0, m, : counts[b, 0, m]].tolist() for m in range(counts.shape[2])]
        for b in range(counts.shape[0])
    ]


def _block_sets(dense):
    return [[torch.nonzero(row).flatten().tolist() for row in rows] for rows in dense]


def test_flex_backend_takes_the_reference_on_the_cpu():
    fused, q, k, v = _qkv_views(1, 17, 4, 2, 16)
    doc_ids = _packed_doc_ids(1, 17, torch.Generator().manual_seed(5))
    dout = torch.randn(1, 17, 4, 16)
    out, grad = _output_and_grads(lambda *a: attention(*a, backend="flex"), fused, q, k, v, doc_ids, dout)
    ref_out, ref_grad = _output_and_grads(attention_reference, fused, q, k, v, doc_ids, dout)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)


def test_rejects_mismatched_heads():
    q = torch.randn(1, 8, 5, 16)
    k = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="backend"):
        attention(q, q, q, backend="flash")


QWEN_7B_HEADS = {"n_q_heads": 28, "n_kv_heads": 4, "head_dim": 128}
# (query heads, kv heads, head_dim) of the attention layers the shipped recipes train.
FAMILY_HEADS = {
    "qwen2.5-0.5b": {"n_q_heads": 14, "n_kv_heads": 2, "head_dim": 64},
    "qwen2.5-7b": QWEN_7B_HEADS,
    "qwen3.5-9b": {"n_q_heads": 16, "n_kv_heads": 4, "head_dim": 256},
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILY_HEADS))
@pytest.mark.parametrize("with_docs", [False, True])
def test_triton_bf16_family_shapes(family, with_docs):
    """bf16 kernel against fp32 sdpa on two 2048-token rows. Tolerance: output within 2e-2 absolute,
    gradients within 1% of their largest entry, and never more than twice the error bf16 sdpa itself
    makes (sdpa's flash kernel on plain rows, its masked one on packed rows)."""
    heads = FAMILY_HEADS[family]
    batch, seq_len = 2, 2048
    fused, q, k, v = _qkv_views(batch, seq_len, **heads, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    doc_ids = _packed_doc_ids(batch, seq_len, torch.Generator().manual_seed(3)).cuda() if with_docs else None
    dout = torch.randn(q.shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    def sdpa(q, k, v, doc_ids):
        return attention(q, k, v, doc_ids, backend="sdpa")

    out, grad = _output_and_grads(lambda *a: attention(*a, backend="triton"), fused, q, k, v, doc_ids, dout)
    bf16_out, bf16_grad = _output_and_grads(sdpa, fused, q, k, v, doc_ids, dout)
    fused32 = fused.detach().float().requires_grad_(True)
    q32, k32, v32 = _split_fused(fused32, **heads)
    ref_out, ref_grad = _output_and_grads(sdpa, fused32, q32, k32, v32, doc_ids, dout.float())

    out_err = (out.float() - ref_out).abs().max().item()
    sdpa_out_err = (bf16_out.float() - ref_out).abs().max().item()
    assert out_err < 2e-2 and out_err <= 2 * sdpa_out_err + 1e-3, (out_err, sdpa_out_err)
    grad_err = (grad.float() - ref_grad).abs().max().item()
    sdpa_grad_err = (bf16_grad.float() - ref_grad).abs().max().item()
    grad_scale = ref_grad.abs().max().item()
    assert grad_err < 1e-2 * grad_scale and grad_err <= 2 * sdpa_grad_err + 1e-3, (
        grad_err,
        sdpa_grad_err,
        grad_scale,
    )


# torch's and our attention at every family's heads; flex, an option no shape takes by itself, at one
# (compiled once for each gradient layout, 15 s a case).
STRIDED_GRADIENT_CASES = [(b, f) for b in ("sdpa", "triton") for f in sorted(FAMILY_HEADS)] + [
    ("flex", "qwen2.5-7b")
]


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "family"), STRIDED_GRADIENT_CASES)
@pytest.mark.parametrize("with_docs", [False, True])
def test_backward_takes_a_row_strided_gradient(backend, family, with_docs):
    """The o projection hands attention its input gradient as a row-strided view (kernels.linear forms
    LoRA's rank columns in the same GEMM), or contiguous (FP8, or no LoRA on o). In one process, each
    backend's gradients from the view equal those from the same values contiguous, up to the order of
    bf16 sums (2^-8 of each value, where a kernel sums with atomics). A backend that reuses the first
    call's layout for the second (cuDNN attention keeps its plan) is off by about sqrt(2)."""
    heads = FAMILY_HEADS[family]
    batch, seq_len, width = 1, 2048, heads["n_q_heads"] * heads["head_dim"]
    fused, q, k, v = _qkv_views(batch, seq_len, **heads, dtype=torch.bfloat16, device="cuda")
    doc_ids = _packed_doc_ids(batch, seq_len, torch.Generator().manual_seed(3)).cuda() if with_docs else None
    generator = torch.Generator(device="cuda").manual_seed(4)
    joined = torch.randn(batch, seq_len, width + 16, generator=generator, device="cuda", dtype=torch.bfloat16)
    strided = joined[..., :width].view(q.shape)
    assert not strided.is_contiguous()

    def run(*inputs):
        return attention(*inputs, backend=backend)

    _, from_strided = _output_and_grads(run, fused, q, k, v, doc_ids, strided)
    _, from_contiguous = _output_and_grads(run, fused, q, k, v, doc_ids, strided.contiguous())
    error = float((from_strided.float() - from_contiguous.float()).norm() / from_contiguous.float().norm())
    assert error < 2.0**-7, f"{backend}: gradients from a row-strided view are {error:.3g} off"


@pytest.mark.gpu
@pytest.mark.parametrize("with_docs", [False, True])
def test_flex_bf16_qwen_7b_shapes(with_docs):
    """FlexAttention compiled, bf16, forward and backward, against the fp32 reference."""
    fused, q, k, v = _qkv_views(2, 2048, **QWEN_7B_HEADS, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    doc_ids = _packed_doc_ids(2, 2048, torch.Generator().manual_seed(3)).cuda() if with_docs else None
    dout = torch.randn(q.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    out, grad = _output_and_grads(lambda *a: attention(*a, backend="flex"), fused, q, k, v, doc_ids, dout)
    fused32 = fused.detach().float().requires_grad_(True)
    q32, k32, v32 = _split_fused(fused32, **QWEN_7B_HEADS)
    ref_out, ref_grad = _output_and_grads(attention_reference, fused32, q32, k32, v32, doc_ids, dout.float())
    assert (out.float() - ref_out).abs().max().item() < 2e-2
    assert (grad.float() - ref_grad).abs().max().item() < 1e-2 * ref_grad.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("with_docs", [False, True])
def test_triton_fp32_gpu_tiles(head_dim, with_docs):
    """The GPU tile sizes of each head size on rows that end mid-tile; fp32 keeps the tolerance tight.
    Few heads: the tiles, not the head count, are what this checks."""
    heads = {"n_q_heads": 4, "n_kv_heads": 2, "head_dim": head_dim}
    fused, q, k, v = _qkv_views(2, 300, **heads, device="cuda")
    generator = torch.Generator().manual_seed(4)
    doc_ids = _packed_doc_ids(2, 300, generator).cuda() if with_docs else None
    dout = torch.randn(q.shape, generator=generator).cuda()

    out, grad = _output_and_grads(attention, fused, q, k, v, doc_ids, dout)
    ref_out, ref_grad = _output_and_grads(attention_reference, fused, q, k, v, doc_ids, dout)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)
