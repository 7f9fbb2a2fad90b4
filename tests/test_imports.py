"""Our modules import one another in one direction only, counting imports inside functions.

The graph is read from the source with `ast`, so an import inside a function or under
TYPE_CHECKING counts as much as one at the top: none of them may close a cycle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qlora_cli": ROOT / "qlora_cli", "qlora_kernels": ROOT / "kernels"}
# The profiler's layers, bottom first: each may import only those before it.
PROFILER_LAYERS = ("ops", "hooks", "timing", "work", "lora", "recorder", "calibration", "report", "command")


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
    return {m for m in found if m in modules and m != name}


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


def test_the_graph_sees_every_kind_of_import():
    assert "qlora_cli.profiler.command" in GRAPH["qlora_cli.cli"]  # inside a function
    assert "qlora_cli.profiler.hooks" in GRAPH["qlora_cli.model"]  # from a submodule
    assert "qlora_kernels.linear" in GRAPH["qlora_cli.model"]
    assert "qlora_kernels._dispatch" in GRAPH["qlora_kernels.linear"]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "low.py").write_text("def f():\n    from pkg.high import g\n    return g\n")
    (tmp_path / "pkg" / "high.py").write_text("from . import low\n\ndef g():\n    return low\n")
    (tmp_path / "pkg" / "alone.py").write_text("import json\n")
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph["pkg.alone"] == set()
    assert find_cycle(graph) in (["pkg.high", "pkg.low", "pkg.high"], ["pkg.low", "pkg.high", "pkg.low"])


def test_no_import_cycles():
    assert find_cycle(GRAPH) is None


def test_kernels_import_nothing_of_qlora_cli():
    for name, imported in GRAPH.items():
        if name.startswith("qlora_kernels"):
            assert not {m for m in imported if m.startswith("qlora_cli")}, name


def test_the_profiler_is_in_layers():
    """Each layer imports only the layers below it; the instrumentation the model calls, the op
    identities and the timing helper import nothing of ours."""
    for index, layer in enumerate(PROFILER_LAYERS):
        name = f"qlora_cli.profiler.{layer}"
        below = {f"qlora_cli.profiler.{lower}" for lower in PROFILER_LAYERS[:index]}
        ours = {m for m in GRAPH[name] if m.startswith("qlora_cli.profiler.")}
        assert ours <= below, (name, ours - below)
    for bottom in ("ops", "hooks", "timing"):
        assert GRAPH[f"qlora_cli.profiler.{bottom}"] == set(), bottom
    assert GRAPH["qlora_cli.profiler"] == set()


def test_nothing_below_the_loop_imports_the_loop():
    loop = {
        "qlora_cli.train",
        "qlora_cli.run",
        "qlora_cli.step",
        "qlora_cli.cli",
        "qlora_cli.profiler.command",
    }
    for module in ("qlora_cli.model", "qlora_cli.export", "qlora_cli.profiler.recorder"):
        assert not reachable(GRAPH, module) & loop, module
