"""Shared test set-up: the Triton interpreter on CPU machines, and the gpu marker."""

import os
import sys

import pytest
import torch

# Decorated Triton functions become interpreted ones only if this is set before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_capture_left_behind(request):
    """A GPU test that leaves its stream capturing, or the device's random generator in a capture that
    ended by an error, fails every later random draw of its worker; this names that test instead."""
    yield
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        return
    if torch.cuda.is_current_stream_capturing():
        pytest.fail("the test returned with the current CUDA stream still capturing a graph")
    try:
        torch.rand(1, device="cuda")
    except RuntimeError as err:
        from qlora_cli.train.graphs import release_generator  # after TRITON_INTERPRET is settled

        release_generator(torch.device("cuda"))
        pytest.fail(f"the test left the CUDA random generator unusable: {err}")


@pytest.fixture
def reference_ops(monkeypatch):
    """Run the public kernel functions on their torch references (the CPU path users get)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms for one test: kernels that sum with atomics take their
    fixed-order path (kernels.swiglu). torch's SDPA takes its math backend: cuDNN's and flash's
    backward sum in no fixed order even here (torch only warns), which moves an FP8 step's
    gradients by a few parts in a thousand from one run to the next."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def one_thread(monkeypatch):
    """This process and the ones it starts compute on one thread, for tests that compare runs of
    different processes bit for bit: a CPU GEMM or reduction sums in an order that depends on the
    threads it gets, and on a loaded machine that is what made such tests fail now and then (the 6th
    digit of a loss), not what they test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run `qlora ARGS` in this process; returns (exit code, stdout, stderr)."""
    from qlora_cli.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["qlora", *map(str, args)])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main()
        out, err = capsys.readouterr()
        return exit_info.value.code, out, err

    return run
