"""Seeded dropout: Triton (interpreter on CPU) against the reference, and masks that a seed fixes."""

import pytest
import torch

from qlora_kernels.dropout import SeededDropout, dropout_mask_reference, dropout_reference, seeded_dropout


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.parametrize("shape", [(3, 37, 53), (1, 1000), (5,)])
@pytest.mark.parametrize("seed", [0, 2**40 + 17, -5])
def test_kernel_matches_reference(shape, seed):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator).requires_grad_(True)
    dy = torch.randn(*shape, generator=generator)
    y = seeded_dropout(x, 0.3, _seed(seed), salt=5, offset=11)
    (dx,) = torch.autograd.grad(y, x, dy)
    ref = dropout_reference(x, 0.3, _seed(seed), salt=5, offset=11)
    (ref_dx,) = torch.autograd.grad(ref, x, dy)
    assert y.grad_fn.name().startswith(SeededDropout.__name__)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(dx, ref_dx)
    # The gradient flows exactly where the output kept its element.
    assert torch.equal(dx == 0, y == 0)


def test_same_seed_same_mask_other_seed_or_salt_another():
    x = torch.ones(4096)
    first = seeded_dropout(x, 0.5, _seed(1), salt=0)
    assert torch.equal(first, seeded_dropout(x, 0.5, _seed(1), salt=0))
    assert not torch.equal(first, seeded_dropout(x, 0.5, _seed(2), salt=0))
    assert not torch.equal(first, seeded_dropout(x, 0.5, _seed(1), salt=1))


def test_drop_rate_and_scale():
    mask = dropout_mask_reference(200_000, 0.1, _seed(7), salt=3)
    assert abs(mask.float().mean().item() - 0.9) < 0.005
    y = seeded_dropout(torch.ones(1000), 0.2, _seed(7), salt=3)
    assert set(y.unique().tolist()) == {0.0, 1.25}


def test_offset_places_a_slice_in_the_whole_mask():
    x = torch.randn(64, 8)
    whole = seeded_dropout(x, 0.4, _seed(9), salt=2)
    part = seeded_dropout(x[16:40], 0.4, _seed(9), salt=2, offset=16 * 8)
    torch.testing.assert_close(part, whole[16:40])


def test_masks_are_independent_of_neighbouring_elements():
    """Neighbouring elements and neighbouring seeds are uncorrelated: the hash mixes every bit."""
    a = dropout_mask_reference(100_000, 0.5, _seed(100), salt=0).float()
    b = dropout_mask_reference(100_000, 0.5, _seed(101), salt=0).float()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1].item()) < 0.02


def test_seed_is_read_when_the_op_runs():
    """A CUDA graph replays with the seed the tensor holds then: writing the tensor changes the mask."""
    seed = _seed(1)
    x = torch.ones(2048)
    first = seeded_dropout(x, 0.5, seed, salt=0)
    seed.fill_(2)
    assert not torch.equal(first, seeded_dropout(x, 0.5, seed, salt=0))


def test_backward_uses_the_forward_seed_after_the_tensor_changed():
    seed = _seed(1)
    x = torch.ones(2048, requires_grad=True)
    y = seeded_dropout(x, 0.5, seed, salt=0)
    seed.fill_(2)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(dx, y.detach())


def test_bad_arguments():
    with pytest.raises(ValueError, match="probability"):
        seeded_dropout(torch.ones(3), 1.0, _seed(0), salt=0)
    with pytest.raises(ValueError, match="salt"):
        seeded_dropout(torch.ones(3), 0.5, _seed(0), salt=-1)
    with pytest.raises(ValueError, match="seed must be one int64"):
        seeded_dropout(torch.ones(3), 0.5, torch.tensor([1, 2]), salt=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernel_draws_the_reference_mask(dtype):
    """The compiled kernel's 32-bit hash gives the mask the reference computes, bit for bit, on
    8192 x 3584 elements (past 2^24, with an offset past 2^32), and a CUDA graph replays it with the
    seed the tensor holds at replay."""
    x = torch.randn(8192, 3584, device="cuda", dtype=dtype).requires_grad_(True)
    seed = torch.tensor([2**40 + 3], dtype=torch.int64, device="cuda")
    offset = 2**32 + 5
    y = seeded_dropout(x, 0.05, seed, salt=77, offset=offset)
    keep = dropout_mask_reference(x.numel(), 0.05, seed.cpu(), salt=77, offset=offset).view(x.shape)
    assert torch.equal(y.cpu() != 0, keep & (x.cpu() != 0))
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(dx.cpu() != 0, keep)

    static = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        seeded_dropout(x, 0.05, seed, salt=77)  # compiled outside the capture
        with torch.cuda.graph(graph):
            static.copy_(seeded_dropout(x, 0.05, seed, salt=77))
    for value in (5, 6):
        seed.fill_(value)
        graph.replay()
        expected = dropout_mask_reference(x.numel(), 0.05, _seed(value), salt=77).view(x.shape)
        assert torch.equal(static.cpu() != 0, expected & (x.detach().cpu() != 0))
