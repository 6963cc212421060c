"""Import directions that keep the owners apart: what imports what, read from the source (type-only imports too)."""
from __future__ import annotations

import ast
from pathlib import Path

from tasks.config import REPO_ROOT


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_server_module_imports_the_app_that_imports_it():
    """The endpoints, the runtime and the state take ServerSettings from serving/settings.py; only the entry point
    (server.py) imports serving.app."""
    offenders = {p.name for p in (REPO_ROOT / "serving").glob("*.py")
                 if p.name not in ("app.py", "server.py") and "serving.app" in _imports(p)}
    assert not offenders, offenders
    assert not {m for m in _imports(REPO_ROOT / "serving" / "settings.py") if m.startswith("serving")}


def test_the_artifact_store_does_not_import_the_runs_that_use_it():
    assert not {m for m in _imports(REPO_ROOT / "tasks" / "store.py") if m.startswith("tasks.runs")}
