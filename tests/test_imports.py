"""Our packages import one another in one direction only, counting imports inside functions.

The graph is read from the source with `ast`, so an import inside a function or under
TYPE_CHECKING counts as much as one at the top. LAYERS lists qlora_cli's packages lowest first, with
what each may import; loading a module's own package on the way (its __init__) is no edge.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qlora_cli": ROOT / "qlora_cli", "qlora_kernels": ROOT / "kernels"}
# qlora_cli's packages, lowest first, each with the packages it may import; every one of those is
# listed before it. The root package (`qlora_cli/__init__.py`: the version) sits below them all.
LAYERS = {
    "qlora_kernels": set(),
    "qlora_cli.core": set(),
    "qlora_cli.config": {"qlora_cli.core"},
    "qlora_cli.sources": {"qlora_cli.core", "qlora_cli.config"},
    "qlora_cli.data": {"qlora_cli.core", "qlora_cli.config", "qlora_cli.sources"},
    "qlora_cli.model": {"qlora_kernels", "qlora_cli.core", "qlora_cli.config", "qlora_cli.sources"},
    "qlora_cli.rundir": {"qlora_cli.core", "qlora_cli.config", "qlora_cli.sources", "qlora_cli.model"},
    "qlora_cli.train": {
        "qlora_kernels",
        "qlora_cli.core",
        "qlora_cli.config",
        "qlora_cli.sources",
        "qlora_cli.data",
        "qlora_cli.model",
        "qlora_cli.rundir",
    },
    "qlora_cli.export": {
        "qlora_kernels",
        "qlora_cli.core",
        "qlora_cli.config",
        "qlora_cli.sources",
        "qlora_cli.model",
        "qlora_cli.rundir",
    },
    "qlora_cli.generate": {
        "qlora_kernels",
        "qlora_cli.core",
        "qlora_cli.config",
        "qlora_cli.sources",
        "qlora_cli.model",
        "qlora_cli.rundir",
    },
    "qlora_cli.profiler": {
        "qlora_kernels",
        "qlora_cli.core",
        "qlora_cli.config",
        "qlora_cli.sources",
        "qlora_cli.data",
        "qlora_cli.model",
        "qlora_cli.rundir",
        "qlora_cli.train",
    },
    "qlora_cli.cli": {
        "qlora_cli.core",
        "qlora_cli.config",
        "qlora_cli.data",
        "qlora_cli.train",
        "qlora_cli.export",
        "qlora_cli.generate",
        "qlora_cli.profiler",
    },
}
# The profiler's layers, bottom first: each may import only those before it.
PROFILER_LAYERS = ("timing", "work", "lora", "recorder", "calibration", "report", "command")
# The model's seams, bottom first: each module or subpackage may import, of the model, only those
# before it. The mixers (one per layer kind) and the MLPs sit below the layer that runs them; LoRA's
# shape sits below the MLPs, since a MoE MLP holds its routed experts' LoRA itself.
MODEL_LAYERS = ("sizes", "modes", "sliced_mlp", "mixers", "lora", "mlps", "layers")


def module_files(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the packages (as installed)."""
    modules = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module `name` imports anywhere in its file, with the packages an
    import of a submodule loads on the way."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    found = set()
    for target in targets:
        parts = target.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in modules and m != name and m not in own_packages}


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    modules = module_files(packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


GRAPH = import_graph(PACKAGES)


def layer_of(module: str) -> str | None:
    """The LAYERS entry a module belongs to; None for the root package and __main__."""
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) for every import of a layer its own layer may not import."""
    found = []
    for name, imported in graph.items():
        layer = layer_of(name)
        if layer is None:
            continue
        for target in imported:
            target_layer = layer_of(target)
            if target_layer not in (None, layer) and target_layer not in LAYERS[layer]:
                found.append((name, target))
    return sorted(found)


def test_the_graph_sees_every_kind_of_import():
    assert "qlora_cli.profiler.command" in GRAPH["qlora_cli.cli"]  # inside a function
    assert "qlora_cli.core.profiling" in GRAPH["qlora_cli.model.layers"]  # from a submodule
    assert "qlora_kernels.linear" in GRAPH["qlora_cli.model.lora"]
    assert "qlora_kernels._dispatch" in GRAPH["qlora_kernels.linear"]
    assert "qlora_cli.model" not in GRAPH["qlora_cli.model.decoder"]  # its own package: no edge


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("def f():\n    from pkg.high import g\n    return g\n")
    (tmp_path / "pkg" / "high.py").write_text("from . import low\n\ndef g():\n    return low\n")
    (tmp_path / "pkg" / "alone.py").write_text("import json\n")
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph["pkg.alone"] == set()
    assert find_cycle(graph) in (["pkg.high", "pkg.low", "pkg.high"], ["pkg.low", "pkg.high", "pkg.low"])


def test_an_upward_import_inside_a_function_is_a_violation(tmp_path):
    """The rule sees what the five inversions were: a function-level import of a higher package."""
    root = tmp_path / "qlora_cli"
    for package in ("config", "data"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "data" / "prompts.py").write_text("def type_problem(name):\n    return None\n")
    (root / "config" / "schema.py").write_text(
        "def check(name):\n    from qlora_cli.data.prompts import type_problem\n    return type_problem(name)\n"
    )
    graph = import_graph({"qlora_cli": root})
    assert layer_violations(graph) == [
        ("qlora_cli.config.schema", "qlora_cli.data"),
        ("qlora_cli.config.schema", "qlora_cli.data.prompts"),
    ]


def test_layers_only_import_layers_listed_before_them():
    order = list(LAYERS)
    for index, (layer, allowed) in enumerate(LAYERS.items()):
        assert allowed <= set(order[:index]), layer


def test_every_package_is_in_a_layer():
    packages = {name for name, path in module_files(PACKAGES).items() if path.name == "__init__.py"}
    top_level = {p for p in packages if p.startswith("qlora_cli.") and p.count(".") == 1} | {"qlora_kernels"}
    assert top_level <= set(LAYERS), top_level - set(LAYERS)
    assert {m for m in GRAPH if layer_of(m) is None} == {"qlora_cli", "qlora_cli.__main__"}


def test_no_package_imports_a_package_above_it():
    assert layer_violations(GRAPH) == []


def test_no_import_cycles():
    assert find_cycle(GRAPH) is None


def test_the_profiler_is_in_layers():
    """Each layer imports only the layers below it; the timing helper imports nothing of ours, and the
    instrumentation the model calls lives at the bottom (qlora_cli/core)."""
    for index, layer in enumerate(PROFILER_LAYERS):
        name = f"qlora_cli.profiler.{layer}"
        below = {f"qlora_cli.profiler.{lower}" for lower in PROFILER_LAYERS[:index]}
        ours = {m for m in GRAPH[name] if m.startswith("qlora_cli.profiler.")}
        assert ours <= below, (name, ours - below)
    assert GRAPH["qlora_cli.profiler.timing"] == set()
    for bottom in ("qlora_cli.core.profiling", "qlora_cli.core.ops"):
        assert GRAPH[bottom] == set(), bottom


def test_the_mixers_and_mlps_sit_below_the_layer():
    """A mixer or an MLP knows the modes it runs in, never the layer, the decoder or another mixer's
    users; the layer asks them, through the registry, what each kind is."""
    for index, seam in enumerate(MODEL_LAYERS):
        below = tuple(f"qlora_cli.model.{lower}" for lower in MODEL_LAYERS[:index])
        name = f"qlora_cli.model.{seam}"
        for module in (m for m in GRAPH if m == name or m.startswith(name + ".")):
            ours = {m for m in GRAPH[module] if m.startswith("qlora_cli.model.") and not m.startswith(name)}
            assert all(m.startswith(below) for m in ours), (module, ours)
