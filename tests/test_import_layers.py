"""Import directions that keep the owners apart, read from the source: every import, lazy and type-only ones included.

The layers, top to bottom; a module imports only from its own layer or below (DEVELOPERS.md, docs/development/layout.md):

    cli -> pipeline -> fleet, device, ops, preflight -> distill, calibration, quantize, evaluation, engines, pii, model,
    serving, tracking -> profile -> paths

Prefect is imported only by the pipeline and the cli, and no set of modules imports itself round in a circle. A
package's `__main__` is a program (`python -m edgeflow.fleet`), not a module anything imports: it sits on the cli layer
wherever it lives, so it may hand over to the command it names.
`from package import submodule` counts as importing the submodule (Python runs the package's __init__ either way;
a package that re-exports its own parts is not a circle).
"""
from __future__ import annotations

import ast
from pathlib import Path

from edgeflow.paths import REPO_ROOT

LAYERS = {"paths": 0, "profile": 1,
          "distill": 2, "calibration": 2, "quantize": 2, "evaluation": 2, "engines": 2, "pii": 2, "model": 2,
          "serving": 2, "tracking": 2, "estimate": 2,
          "fleet": 3, "device": 3, "ops": 3, "preflight": 3,
          "pipeline": 4, "cli": 5}
ORCHESTRATOR_OK = {"pipeline", "cli"}  # the packages that may import prefect

# What is left to untangle, each named with why it is still here. The test fails when one is gone too (remove it
# here), so the list only shrinks.
KNOWN: set[tuple[str, str, str]] = set()


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the package's modules it imports, module -> the third-party top-level names it imports)."""
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    third: dict[str, set[str]] = {}
    for name, path in modules.items():
        inside, outside = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules and t.split(".")[0] == root.name:
                    t = t.rpartition(".")[0]  # `import edgeflow.x.y.attr`-like names: the module that holds them
                if t in modules:
                    if t != name:
                        inside.add(t)
                elif t.split(".")[0] != root.name:
                    outside.add(t.split(".")[0])
        graph[name], third[name] = inside, outside
    return graph, third


def _package(root: Path, module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(root: Path, layers: dict[str, int], orchestrator_ok: set[str]) -> set[tuple[str, str, str]]:
    graph, third = import_graph(root)
    found: set[tuple[str, str, str]] = set()
    for module, targets in graph.items():
        if module == root.name:
            continue
        # a program (`python -m pkg.sub`) is an entry point: the top layer
        mine = max(layers.values()) if module.endswith(".__main__") else layers[_package(root, module)]
        for t in targets:
            if t != root.name and layers[_package(root, t)] > mine:
                found.add(("upward", module, t))
        if "prefect" in third[module] and _package(root, module) not in orchestrator_ok:
            found.add(("prefect", module, ""))
    found |= {("cycle", " ".join(c), "") for c in _cycles(graph)}
    return found


def test_every_package_has_a_layer():
    root = REPO_ROOT / "edgeflow"
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()} | {p.stem for p in root.glob("*.py")}
    assert packages - {"__init__"} == set(LAYERS), "place each package of edgeflow/ in LAYERS (and the layout docs)"


def test_imports_go_downward_only_prefect_stays_in_the_pipeline_and_nothing_is_circular():
    found = violations(REPO_ROOT / "edgeflow", LAYERS, ORCHESTRATOR_OK)
    assert found - KNOWN == set(), "new upward imports, Prefect importers or circles (see the module doc)"
    assert KNOWN - found == set(), "these are untangled now: remove them from KNOWN"


def test_the_check_catches_an_upward_import_a_stray_prefect_import_and_a_lazy_circle(tmp_path):
    """The same check on a made-up package with one of each: each is found, and nothing else is."""
    root = tmp_path / "pkg"
    for sub in ("low", "high"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("def f():\n    from pkg.high.b import g  # lazy, and upward\n    return g\n")
    (root / "low" / "c.py").write_text("import prefect\n")
    (root / "high" / "b.py").write_text("from pkg.low import a\n\ndef g():\n    return a\n")
    (root / "high" / "d.py").write_text("from pkg.low.c import prefect  # a name, not a module of the package\n")
    (root / "low" / "__main__.py").write_text("from pkg.high.d import prefect  # a program: the top layer, not upward\n")
    found = violations(root, {"low": 0, "high": 1}, orchestrator_ok={"high"})
    assert found == {("upward", "pkg.low.a", "pkg.high.b"), ("prefect", "pkg.low.c", ""),
                     ("cycle", "pkg.high.b pkg.low.a", "")}


def test_no_server_module_imports_the_app_that_imports_it():
    """The endpoints, the runtime and the state take ServerSettings from edgeflow/serving/settings.py; only the entry
    point (server.py) imports edgeflow.serving.app."""
    graph, _ = import_graph(REPO_ROOT / "edgeflow")
    serving = {m for m in graph if m.startswith("edgeflow.serving.")}
    assert len(serving) > 10
    offenders = {m for m in serving if m not in ("edgeflow.serving.app", "edgeflow.serving.server")
                 and "edgeflow.serving.app" in graph[m]}
    assert not offenders, offenders
    assert not {m for m in graph["edgeflow.serving.settings"] if m.startswith("edgeflow.serving")}


def test_the_artifact_store_does_not_import_the_runs_that_use_it():
    graph, _ = import_graph(REPO_ROOT / "edgeflow")
    assert graph["edgeflow.tracking.store"] and "edgeflow.tracking.runs" not in graph["edgeflow.tracking.store"]


def test_no_test_file_imports_another():
    """What tests share lives in tests/helpers/; a test file (or a helper, or code a test runs in a subprocess)
    never imports a test module."""
    import re

    pattern = re.compile(r"(?:from|import)\s+(tests\.(?:[\w]+\.)*test_\w+)")
    offenders = {f"{p.relative_to(REPO_ROOT)}: {m}" for p in (REPO_ROOT / "tests").rglob("*.py")
                 for m in pattern.findall(p.read_text())}
    assert not offenders, sorted(offenders)


def test_no_module_is_over_600_lines():
    """A module that grows past 600 lines holds more than one concern: split it (a package that exports what the
    module did, like edgeflow/engines/cpu_native/)."""
    long = {str(p.relative_to(REPO_ROOT)): n for p in (REPO_ROOT / "edgeflow").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long
