"""The documentation (docs/, mkdocs.yml): the reference pages are what the code gives today, the profile reference
names every field, the site builds with `mkdocs build --strict` (no broken link, no page outside the nav), and
README's links lead to files that exist."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import docs_reference  # noqa: E402  (scripts/ is not a package)


def _field_paths(model, prefix: str = "") -> list[str]:
    """Every field of a pydantic model and its sub-models, dotted (lists of models as `name[]`)."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.append(path)
        for sub in docs_reference._models_in(field.annotation):
            listed = typing.get_origin(field.annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(field.annotation))
            paths += _field_paths(sub, f"{path}[]" if listed else path)
    return paths


def test_the_profile_reference_lists_every_field_of_the_profile_with_its_description() -> None:
    from edgeflow.profile import Profile

    page = (REPO / "docs" / "reference" / "profile.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \|.*\| ([^|]*) \|$", page, re.M)}
    paths = _field_paths(Profile)
    assert len(paths) > 100 and "distill.teacher_cache.top_k" in paths and "quantize.variants[].recipe" in paths
    missing = [p for p in paths if p not in rows]
    assert not missing, f"fields missing from docs/reference/profile.md: {missing}; run python scripts/docs_reference.py"
    assert not [p for p in paths if not rows[p].strip()], "every field has a description"


@pytest.mark.parametrize("page", ["profile.md", "server.md", "metrics-alerts.md", "cli.md"])
def test_a_generated_reference_page_is_what_the_code_gives_today(page: str) -> None:
    fresh = docs_reference.PAGES[page]()
    committed = (REPO / "docs" / "reference" / page).read_text()
    assert committed == fresh, f"docs/reference/{page} is out of date with the code: run python scripts/docs_reference.py"


def test_the_site_builds_strictly(tmp_path) -> None:
    """--strict turns every warning into a failure: a link to a missing page or anchor, a page left out of the nav,
    a snippet (README's tables, BENCHMARKS.md) whose file or section is gone."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    hardware = (tmp_path / "site" / "hardware" / "index.html").read_text()
    assert "Jetson AGX Orin" in hardware and "gemma3_text" in (tmp_path / "site" / "concepts" / "families" / "index.html").read_text()
    assert "edgeflow_requests_total" in (tmp_path / "site" / "reference" / "metrics-alerts" / "index.html").read_text()


def test_readme_links_lead_to_files_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 10
    assert [link for link in links if not link.startswith("http") and not (REPO / link).exists()] == []
    assert len(readme.splitlines()) <= 160, "README is the landing page: the rest belongs in docs/"


def test_the_layout_docs_name_every_package_and_developers_md_every_file() -> None:
    """docs/development/layout.md has a row for each package of edgeflow/, and DEVELOPERS.md names each of its files."""
    layout = (REPO / "docs" / "development" / "layout.md").read_text()
    developers = (REPO / "DEVELOPERS.md").read_text()
    root = REPO / "edgeflow"
    packages = [p for p in root.iterdir() if (p / "__init__.py").exists()] + list(root.glob("[!_]*.py"))
    assert len(packages) > 10
    unnamed = [p.name for p in packages if f"`edgeflow/{p.name}{'/' if p.is_dir() else ''}`" not in layout]
    assert not unnamed, f"docs/development/layout.md has no row for {unnamed}"
    files = [f for f in root.rglob("*") if f.suffix in (".py", ".c", ".html") and "__pycache__" not in f.parts
             and f.name not in ("__init__.py", "__main__.py")]
    missing = sorted(str(f.relative_to(REPO)) for f in files if f.name not in developers)
    assert not missing, f"DEVELOPERS.md's layout does not name {missing}"


def test_code_cites_benchmark_figures_by_anchors_that_exist() -> None:
    """The code, configs and docs cite a figure as BENCHMARKS.md#<anchor> (the current figure) or a dated file of
    docs/benchmarks/history/, never by a section title; every anchor and file cited exists."""
    import re

    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (REPO / "BENCHMARKS.md").read_text()))
    assert len(anchors) > 20
    places = [*(REPO / "edgeflow").rglob("*.py"), *(REPO / "edgeflow").rglob("*.c"), *(REPO / "configs").glob("*.yaml"),
              *(REPO / "scripts").glob("*.py"), *(REPO / "tests").rglob("*.py"), REPO / "Makefile",
              *(p for p in (REPO / "docs").rglob("*.md") if "history" not in p.parts)]
    unknown, titled, missing = [], [], []
    for path in places:
        text = path.read_text()
        where = str(path.relative_to(REPO))
        unknown += [f"{where}: #{a}" for a in re.findall(r"BENCHMARKS\.md,? ?\(?#([a-z0-9-]+)", text) if a not in anchors]
        titled += [f"{where}: {m}" for m in re.findall(r'BENCHMARKS\.md,? \(?"[^"]+"', text)]
        missing += [f"{where}: {f}" for f in re.findall(r"docs/benchmarks/history/([0-9-]+\.md)", text)
                    if not (REPO / "docs" / "benchmarks" / "history" / f).exists()]
    assert not unknown, f"anchors BENCHMARKS.md does not have: {unknown}"
    assert not titled, f"cite BENCHMARKS.md#<anchor>, not a section title: {titled}"
    assert not missing, f"history files that do not exist: {missing}"
