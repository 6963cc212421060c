"""What `make demo` installs covers what `make demo` runs.

`make test` installs the `test` extra on top of the demo's install, so a module the demo imports but only the test
extra brings in would pass every other test and fail `make demo` from a fresh clone at its last step. This reads the
demo's entry points and checks each third-party import against the requirement closure of the core dependencies
plus the `demo` extra (pyproject.toml, walked through the installed distributions' metadata).
"""
from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# What `make demo` runs itself (Makefile: `services`, `demo`); the stages run in workers it starts from the same venv.
DEMO_ENTRY_POINTS = ("scripts/demo.py", "scripts/services.py")
LOCAL = {p.name for p in REPO.iterdir() if p.is_dir()} | {p.stem for p in REPO.glob("*.py")}


def _requirement_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of these requirements and everything their installed metadata requires, extras followed."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r.name, frozenset(r.extras)) for r in requirements if not r.marker or r.marker.evaluate({"extra": ""})]
    names: set[str] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            reqs = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # required only under a marker this interpreter does not meet
        for line in reqs:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return names


def _demo_install() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["demo"]]
    return _requirement_closure(reqs)


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file, function-local ones included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in LOCAL and n != "__future__"}


def test_the_demo_imports_only_what_make_demo_installs() -> None:
    installed = _demo_install()
    dists = packages_distributions()
    missing = []
    for entry in DEMO_ENTRY_POINTS:
        for module in sorted(_third_party_imports(REPO / entry)):
            provided_by = {canonicalize_name(d) for d in dists.get(module, [])}
            assert provided_by, f"{entry} imports {module!r}, which no installed distribution provides"
            if not provided_by & installed:
                missing.append(f"{entry} imports {module!r} (from {', '.join(sorted(provided_by))})")
    assert not missing, (
        "make demo does not install what it runs: " + "; ".join(missing)
        + ". Add the distribution to [project.dependencies] or the `demo` extra in pyproject.toml."
    )


def test_the_closure_follows_extras_and_sees_a_test_only_package() -> None:
    """The check can fail: pytest comes only with the `test` extra, so it is outside the demo's install."""
    installed = _demo_install()
    assert "openai" in installed and "mlflow" in installed and "prefect" in installed
    assert "pytest" not in installed and "playwright" not in installed


def test_the_wheel_installs_only_the_edgeflow_package_and_its_command(tmp_path) -> None:
    """`pip install .` adds one top-level package, `edgeflow`, with the files it reads at run time, and the
    `edgeflow` console script: nothing named `tasks`, `flows` or `serving` to shadow another project's."""
    import shutil
    import subprocess
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "edgeflow", src / "edgeflow", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "out").glob("edgeflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"edgeflow", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                + ".dist-info"}
    assert {"edgeflow/serving/chat.html", "edgeflow/engines/cpu_native/native/q4.c", "edgeflow/cli/main.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "edgeflow = edgeflow.cli.main:main" in entry_points
