"""RoPE with optional QK-norm: Triton path (interpreter on CPU) against the reference."""

import pytest
import torch

from qlora_kernels.rope import RopeFunction, apply_rope, rope_reference

EPS = 1e-6


def _inv_freq(head_dim: int, theta: float = 10000.0, device="cpu") -> torch.Tensor:
    """As HF computes it for the default rope type."""
    return 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )


def _packed_positions(lengths_per_row: list[list[int]], device="cpu") -> torch.Tensor:
    """Positions restarting at 0 at each packed document."""
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    return torch.stack(rows).to(device)


def _fused_qk(batch, seq_len, n_q_heads, n_kv_heads, head_dim, generator, dtype=torch.float32, device="cpu"):
    """(fused, q, k): q and k as strided views into one QKV projection output."""
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    fused = torch.randn(batch, seq_len, width, generator=generator, dtype=dtype, device=device)
    fused.requires_grad_(True)
    return fused, *_split_qk(fused, n_q_heads, n_kv_heads, head_dim)


def _split_qk(fused, n_q_heads, n_kv_heads, head_dim):
    q_end, k_end = n_q_heads * head_dim, (n_q_heads + n_kv_heads) * head_dim
    q = fused[..., :q_end].unflatten(-1, (n_q_heads, head_dim))
    k = fused[..., q_end:k_end].unflatten(-1, (n_kv_heads, head_dim))
    return q, k


def _norm_weights(mode: str, head_dim: int, generator, dtype=torch.float32, device="cpu"):
    if mode == "none":
        return None, None
    weights = 1.0 + 0.2 * torch.randn(2, head_dim, generator=generator, dtype=dtype, device=device)
    q_weight, k_weight = (w.clone().requires_grad_(mode == "trained") for w in weights)
    return q_weight, k_weight


def _outputs_and_grads(fn, leaves, out_grads):
    outputs = fn()
    return outputs, torch.autograd.grad(outputs, leaves, out_grads)


def _assert_all_close(actual, expected, atol, rtol):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


POSITIONS = [[3, 5, 1], [9]]  # document lengths per row: restarts mid-row in the first


@pytest.mark.parametrize(
    ("n_q_heads", "n_kv_heads", "head_dim"),
    [(2, 2, 16), (6, 2, 32), (3, 1, 16)],
)
@pytest.mark.parametrize("norm", ["none", "trained", "frozen"])
def test_apply_rope_matches_reference(n_q_heads, n_kv_heads, head_dim, norm):
    generator = torch.Generator().manual_seed(0)
    positions = _packed_positions(POSITIONS)
    batch, seq_len = positions.shape
    fused, q, k = _fused_qk(batch, seq_len, n_q_heads, n_kv_heads, head_dim, generator)
    assert not q.is_contiguous()
    q_weight, k_weight = _norm_weights(norm, head_dim, generator)
    inv_freq = _inv_freq(head_dim)
    dq = torch.randn(batch, seq_len, n_q_heads, head_dim, generator=generator)
    dk = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=generator)
    leaves = [fused, q_weight, k_weight] if norm == "trained" else [fused]
    args = (q, k, positions, inv_freq, q_weight, k_weight, EPS)

    out, grads = _outputs_and_grads(lambda: apply_rope(*args), leaves, (dq, dk))
    ref_out, ref_grads = _outputs_and_grads(lambda: rope_reference(*args), leaves, (dq, dk))

    assert out[0].grad_fn.name().startswith(RopeFunction.__name__)
    assert all(t.is_contiguous() for t in out)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_strided_upstream_gradients_and_contiguous_inputs():
    """Gradients arriving in a [B, H, S, D] layout, as attention hands them back."""
    generator = torch.Generator().manual_seed(1)
    positions = _packed_positions([[4, 3], [2, 5]])
    q = torch.randn(2, 7, 4, 16, generator=generator).requires_grad_(True)
    k = torch.randn(2, 7, 2, 16, generator=generator).requires_grad_(True)
    q_weight, k_weight = _norm_weights("trained", 16, generator)
    inv_freq = _inv_freq(16, theta=1e6)
    dq = torch.randn(2, 4, 7, 16, generator=generator)
    dk = torch.randn(2, 2, 7, 16, generator=generator)
    leaves = [q, k, q_weight, k_weight]

    def run(fn):
        q_out, k_out = fn(q, k, positions, inv_freq, q_weight, k_weight, EPS)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    out, grads = _outputs_and_grads(lambda: run(apply_rope), leaves, (dq, dk))
    ref_out, ref_grads = _outputs_and_grads(lambda: run(rope_reference), leaves, (dq, dk))

    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_without_norm_backward_saves_no_activations():
    generator = torch.Generator().manual_seed(2)
    positions = _packed_positions([[5]])
    _, q, k = _fused_qk(1, 5, 2, 1, 16, generator)
    inv_freq = _inv_freq(16)
    q_out, _ = apply_rope(q, k, positions, inv_freq)
    saved = [t for t in q_out.grad_fn.saved_tensors if t is not None]
    assert sorted(t.numel() for t in saved) == sorted([positions.numel(), inv_freq.numel()])


def test_reference_path_without_interpreter(reference_ops):
    generator = torch.Generator().manual_seed(3)
    positions = _packed_positions([[2, 3]])
    _, q, k = _fused_qk(1, 5, 2, 1, 16, generator)
    out = apply_rope(q, k, positions, _inv_freq(16))
    assert "Rope" not in out[0].grad_fn.name()
    _assert_all_close(out, rope_reference(q, k, positions, _inv_freq(16)), atol=0, rtol=0)


def test_reference_matches_transformers():
    modeling_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    generator = torch.Generator().manual_seed(4)
    positions = _packed_positions([[3, 4], [7]])
    _, q, k = _fused_qk(2, 7, 4, 2, 16, generator)
    q_weight, k_weight = _norm_weights("frozen", 16, generator)
    inv_freq = _inv_freq(16)

    angle = positions[..., None].float() * inv_freq
    emb = torch.cat((angle, angle), dim=-1)
    q_norm, k_norm = modeling_qwen3.Qwen3RMSNorm(16, eps=EPS), modeling_qwen3.Qwen3RMSNorm(16, eps=EPS)
    with torch.no_grad():
        q_norm.weight.copy_(q_weight)
        k_norm.weight.copy_(k_weight)
        hf_q, hf_k = modeling_qwen3.apply_rotary_pos_emb(
            q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), emb.cos(), emb.sin()
        )
        ours = rope_reference(q, k, positions, inv_freq, q_weight, k_weight, EPS)
    _assert_all_close(ours, (hf_q.transpose(1, 2), hf_k.transpose(1, 2)), atol=0, rtol=0)


def _zero_centred_norm_weights(mode: str, head_dim: int, generator, dtype=torch.float32, device="cpu"):
    """Near 0, as Qwen3.5 stores q_norm/k_norm: scaling by w instead of (1 + w) would show at once."""
    weights = 0.2 * torch.randn(2, head_dim, generator=generator, dtype=dtype, device=device)
    return tuple(w.clone().requires_grad_(mode == "trained") for w in weights)


# (q heads, kv heads, head_dim, rotary_dim): Qwen3.5's quarter, and a rotary half and head that
# are not powers of two.
PARTIAL_SHAPES = [(3, 1, 16, 4), (2, 2, 24, 12)]


@pytest.mark.parametrize(("n_q_heads", "n_kv_heads", "head_dim", "rotary_dim"), PARTIAL_SHAPES)
@pytest.mark.parametrize("norm", ["none", "trained", "frozen"])
def test_partial_rotary_zero_centred_matches_reference(n_q_heads, n_kv_heads, head_dim, rotary_dim, norm):
    generator = torch.Generator().manual_seed(5)
    positions = _packed_positions(POSITIONS)
    batch, seq_len = positions.shape
    fused, q, k = _fused_qk(batch, seq_len, n_q_heads, n_kv_heads, head_dim, generator)
    if norm == "none":
        q_weight, k_weight = None, None
    else:
        q_weight, k_weight = _zero_centred_norm_weights(norm, head_dim, generator)
    inv_freq = _inv_freq(rotary_dim, theta=1e7)
    dq = torch.randn(batch, seq_len, n_q_heads, head_dim, generator=generator)
    dk = torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=generator)
    leaves = [fused, q_weight, k_weight] if norm == "trained" else [fused]
    args = (q, k, positions, inv_freq, q_weight, k_weight, EPS)

    out, grads = _outputs_and_grads(lambda: apply_rope(*args, zero_centred_norm=True), leaves, (dq, dk))
    ref_out, ref_grads = _outputs_and_grads(
        lambda: rope_reference(*args, zero_centred_norm=True), leaves, (dq, dk)
    )

    assert out[0].grad_fn.name().startswith(RopeFunction.__name__)
    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)
    if norm == "none":
        torch.testing.assert_close(out[0][..., rotary_dim:], q[..., rotary_dim:], atol=0, rtol=0)


@pytest.mark.parametrize("rotary_dim", [16, 4])
def test_attention_scaling_matches_reference(rotary_dim):
    """Full and partial rotary, with a trained zero-centred QK-norm underneath."""
    generator = torch.Generator().manual_seed(6)
    positions = _packed_positions([[4, 3], [7]])
    fused, q, k = _fused_qk(2, 7, 2, 1, 16, generator)
    q_weight, k_weight = _zero_centred_norm_weights("trained", 16, generator)
    inv_freq = _inv_freq(rotary_dim)
    dq = torch.randn(q.shape, generator=generator)
    dk = torch.randn(k.shape, generator=generator)
    leaves = [fused, q_weight, k_weight]
    args = (q, k, positions, inv_freq, q_weight, k_weight, EPS)
    options = {"zero_centred_norm": True, "attention_scaling": 1.25}

    out, grads = _outputs_and_grads(lambda: apply_rope(*args, **options), leaves, (dq, dk))
    ref_out, ref_grads = _outputs_and_grads(lambda: rope_reference(*args, **options), leaves, (dq, dk))

    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_partial_rotary_reference_matches_transformers():
    """Qwen3.5's zero-centred q/k norm, its rotary embedding (M-RoPE with text positions) and
    partial apply_rotary_pos_emb, in bf16 so the order of the casts shows."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    configuration = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    config = configuration.Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    )
    generator = torch.Generator().manual_seed(7)
    positions = _packed_positions([[3, 4], [7]])
    _, q, k = _fused_qk(2, 7, 4, 2, 16, generator, dtype=torch.bfloat16)
    q_weight, k_weight = _zero_centred_norm_weights("frozen", 16, generator)
    rotary = modeling.Qwen3_5TextRotaryEmbedding(config)
    inv_freq = _inv_freq(4, theta=1e7)
    torch.testing.assert_close(rotary.inv_freq, inv_freq, atol=0, rtol=0)

    q_norm, k_norm = modeling.Qwen3_5RMSNorm(16, eps=EPS), modeling.Qwen3_5RMSNorm(16, eps=EPS)
    with torch.no_grad():
        q_norm.weight.copy_(q_weight)
        k_norm.weight.copy_(k_weight)
        cos, sin = rotary(q, positions)
        hf_q, hf_k = modeling.apply_rotary_pos_emb(
            q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin
        )
        ours = rope_reference(q, k, positions, inv_freq, q_weight, k_weight, EPS, zero_centred_norm=True)
    _assert_all_close(ours, (hf_q.transpose(1, 2), hf_k.transpose(1, 2)), atol=0, rtol=0)


def test_attention_scaling_reference_matches_transformers_yarn():
    modeling_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    configuration = pytest.importorskip("transformers.models.qwen3.configuration_qwen3")
    config = configuration.Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
    )
    rotary = modeling_qwen3.Qwen3RotaryEmbedding(config)
    assert rotary.attention_scaling > 1.0
    generator = torch.Generator().manual_seed(8)
    positions = _packed_positions([[3, 4], [7]])
    _, q, k = _fused_qk(2, 7, 4, 2, 16, generator, dtype=torch.bfloat16)
    with torch.no_grad():
        cos, sin = rotary(q, positions)
        hf_q, hf_k = modeling_qwen3.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ours = rope_reference(q, k, positions, rotary.inv_freq, attention_scaling=rotary.attention_scaling)
    _assert_all_close(ours, (hf_q.transpose(1, 2), hf_k.transpose(1, 2)), atol=0, rtol=0)


# Qwen2.5-7B attention: 28 query heads, 4 kv heads, head_dim 128, theta 1e6, 2 x 2048 tokens packed
# with documents of uneven lengths. bf16: within 1% of the largest fp32 reference value (inputs are
# rounded once, outputs once). fp32: 1e-5 absolute, which also checks the in-kernel cos/sin stay
# accurate at positions in the thousands.
GPU_SHAPE = {"batch": 2, "seq_len": 2048, "n_q_heads": 28, "n_kv_heads": 4, "head_dim": 128}
BF16_TOL = 1e-2


def _gpu_case(dtype, norm):
    generator = torch.Generator(device="cuda").manual_seed(0)
    batch, seq_len, head_dim = GPU_SHAPE["batch"], GPU_SHAPE["seq_len"], GPU_SHAPE["head_dim"]
    positions = _packed_positions([[1500, 300, 248], [2048]], device="cuda")
    fused, q, k = _fused_qk(
        batch, seq_len, GPU_SHAPE["n_q_heads"], GPU_SHAPE["n_kv_heads"], head_dim, generator, dtype, "cuda"
    )
    q_weight, k_weight = _norm_weights(norm, head_dim, generator, dtype, "cuda")
    dq = torch.randn(q.shape, generator=generator, device="cuda", dtype=dtype)
    dk = torch.randn(k.shape, generator=generator, device="cuda", dtype=dtype)
    return fused, q, k, positions, _inv_freq(head_dim, 1e6, "cuda"), q_weight, k_weight, dq, dk


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["none", "trained"])
def test_gpu_bf16_against_fp32_reference(norm):
    fused, q, k, positions, inv_freq, q_weight, k_weight, dq, dk = _gpu_case(torch.bfloat16, norm)
    leaves = [fused, q_weight, k_weight] if norm == "trained" else [fused]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_q, ref_k = _split_qk(ref_leaves[0], q.shape[2], k.shape[2], q.shape[3])
    ref_weights = ref_leaves[1:] if norm == "trained" else [None, None]

    out, grads = _outputs_and_grads(
        lambda: apply_rope(q, k, positions, inv_freq, q_weight, k_weight, EPS), leaves, (dq, dk)
    )
    ref_out, ref_grads = _outputs_and_grads(
        lambda: rope_reference(ref_q, ref_k, positions, inv_freq, *ref_weights, EPS),
        ref_leaves,
        (dq.float(), dk.float()),
    )

    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        error = (actual.float() - expected).abs().max().item()
        assert error <= BF16_TOL * expected.abs().max().item()


@pytest.mark.gpu
def test_gpu_fp32_long_positions():
    fused, q, k, positions, inv_freq, q_weight, k_weight, dq, dk = _gpu_case(torch.float32, "trained")
    positions = positions + 2048  # positions up to 4095
    leaves = [fused, q_weight, k_weight]
    args = (q, k, positions, inv_freq, q_weight, k_weight, EPS)

    out, grads = _outputs_and_grads(lambda: apply_rope(*args), leaves, (dq, dk))
    ref_out, ref_grads = _outputs_and_grads(lambda: rope_reference(*args), leaves, (dq, dk))

    _assert_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    _assert_all_close(grads[:1], ref_grads[:1], atol=1e-5, rtol=1e-5)
    # The norm-weight gradients sum 4096 tokens x heads: compare relative to their size.
    _assert_all_close(grads[1:], ref_grads[1:], atol=1e-3, rtol=1e-4)


# Qwen3.5-9B full attention: 16 query heads, 4 kv heads, head_dim 256 of which 64 rotate, theta 1e7,
# zero-centred QK-norm; same 1% bound as the bf16 test above.
@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["none", "trained"])
def test_gpu_qwen3_5_partial_rotary_bf16_against_fp32_reference(norm):
    generator = torch.Generator(device="cuda").manual_seed(0)
    n_q_heads, n_kv_heads, head_dim, rotary_dim = 16, 4, 256, 64
    positions = _packed_positions([[1500, 300, 248], [2048]], device="cuda")
    fused, q, k = _fused_qk(2, 2048, n_q_heads, n_kv_heads, head_dim, generator, torch.bfloat16, "cuda")
    if norm == "none":
        q_weight, k_weight = None, None
    else:
        q_weight, k_weight = _zero_centred_norm_weights(norm, head_dim, generator, torch.bfloat16, "cuda")
    inv_freq = _inv_freq(rotary_dim, 1e7, "cuda")
    dq = torch.randn(q.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    dk = torch.randn(k.shape, generator=generator, device="cuda", dtype=torch.bfloat16)
    leaves = [fused, q_weight, k_weight] if norm == "trained" else [fused]
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref_q, ref_k = _split_qk(ref_leaves[0], n_q_heads, n_kv_heads, head_dim)
    ref_weights = ref_leaves[1:] if norm == "trained" else [None, None]

    out, grads = _outputs_and_grads(
        lambda: apply_rope(q, k, positions, inv_freq, q_weight, k_weight, EPS, zero_centred_norm=True),
        leaves,
        (dq, dk),
    )
    ref_out, ref_grads = _outputs_and_grads(
        lambda: rope_reference(ref_q, ref_k, positions, inv_freq, *ref_weights, EPS, zero_centred_norm=True),
        ref_leaves,
        (dq.float(), dk.float()),
    )

    for actual, expected in zip([*out, *grads], [*ref_out, *ref_grads], strict=True):
        assert actual.dtype == torch.bfloat16
        error = (actual.float() - expected).abs().max().item()
        assert error <= BF16_TOL * expected.abs().max().item()
