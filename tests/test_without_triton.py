"""Without triton (macOS and Windows installs): the CLI imports, the demo trains and generates on the references, and
asking for Triton's interpreter is one clear error."""

import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
from checkpoints import REPO_ROOT, subprocess_env

from qlora_kernels import _dispatch


@pytest.fixture
def no_triton_env(tmp_path):
    """A child environment where `import triton` fails, as where the package is not installed."""
    blocker = tmp_path / "blocker" / "triton"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError(\"No module named 'triton'\")\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), env["PYTHONPATH"]])
    env.pop("TRITON_INTERPRET")
    return env


def _qlora(env, *args):
    return subprocess.run(
        [sys.executable, "-m", "qlora_cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=600,
    )


def test_every_module_imports_without_triton(no_triton_env):
    script = (
        "import importlib, pkgutil, sys, qlora_cli, qlora_kernels\n"
        "for package in (qlora_cli, qlora_kernels):\n"
        "    for module in pkgutil.iter_modules(package.__path__):\n"
        "        if module.name != '__main__':\n"
        "            importlib.import_module(f'{package.__name__}.{module.name}')\n"
        "assert 'triton' not in sys.modules and not qlora_kernels.TRITON_AVAILABLE\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, env=no_triton_env
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_version_without_triton(no_triton_env):
    proc = _qlora(no_triton_env, "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("qlora "), proc.stderr


def test_demo_trains_on_the_references_without_triton(no_triton_env, tmp_path):
    out = tmp_path / "out"
    proc = _qlora(
        no_triton_env, "train", "configs/demo.yaml", "--set", "max_steps=2", "--set", f"output_dir={out}"
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "adapter_model.safetensors").is_file()
    proc = _qlora(no_triton_env, "generate", out, "--prompt", "Hi", "--max-new-tokens", "4")
    assert proc.returncode == 0 and "first token after" in proc.stderr, proc.stderr


def test_interpreter_without_triton_is_one_line(no_triton_env, tmp_path):
    proc = _qlora(
        {**no_triton_env, "TRITON_INTERPRET": "1"},
        "train",
        "configs/demo.yaml",
        "--set",
        f"output_dir={tmp_path / 'out'}",
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: TRITON_INTERPRET=1") and "not installed" in lines[0]
    assert not (tmp_path / "out").exists()


def test_dispatch_without_triton(monkeypatch):
    """CUDA tensors fall back to the references with one warning; the interpreter raises."""
    monkeypatch.setattr(_dispatch, "TRITON_AVAILABLE", False)
    _dispatch._warn_cuda_runs_references.cache_clear()
    cuda_tensor, cpu_tensor = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert not _dispatch.use_triton(cuda_tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _dispatch.use_triton(cuda_tensor)
        assert not _dispatch.use_triton(cpu_tensor)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 asks for Triton's interpreter"):
        _dispatch.use_triton(cpu_tensor)
    monkeypatch.setenv("QLORA_KERNELS", "reference")
    assert not _dispatch.use_triton(cuda_tensor)
    _dispatch._warn_cuda_runs_references.cache_clear()
