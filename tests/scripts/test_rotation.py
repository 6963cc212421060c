"""The `extended` tests' rotation in CI (tests/rotation.py): every extended test in exactly one share, the share's
tests kept by `make test`'s marker expression, the run counter cycling through the shares."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.rotation import ENV, ROTATION, SHARES, ci_share

REPO = Path(__file__).resolve().parents[2]
MAKE_TEST_MARKERS = "not extended or rotated"  # the Makefile's `test` target


def _extended_tests() -> set[str]:
    """file::name of every test function decorated with pytest.mark.extended, read from the sources."""
    found = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and any(
                    "mark.extended" in ast.unparse(d) for d in node.decorator_list):
                found.add(f"{path.relative_to(REPO)}::{node.name}")
    return found


def test_every_extended_test_is_in_exactly_one_share():
    shares = [set(ROTATION[k]) for k in range(SHARES)]
    assert sorted(ROTATION) == list(range(SHARES))
    assert all(shares) and sum(map(len, shares)) == len(set().union(*shares))  # disjoint, none empty
    assert set().union(*shares) == _extended_tests()
    assert f'-m "{MAKE_TEST_MARKERS}"' in (REPO / "Makefile").read_text()


def _collect(share: str | None, *args: str) -> subprocess.CompletedProcess:
    """pytest --collect-only in its own process, with EDGEFLOW_EXTENDED_SHARE set to `share` (unset for None)."""
    env = {k: v for k, v in os.environ.items() if k != ENV} | ({ENV: share} if share is not None else {})
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *args],
                          cwd=REPO, env=env, capture_output=True, text=True)


def _collected(share: str | None, *files: str) -> set[str]:
    run = _collect(share, "-m", MAKE_TEST_MARKERS, *files)
    assert run.returncode in (0, 5), run.stdout[-2000:] + run.stderr[-2000:]
    return {line.split("[", 1)[0] for line in run.stdout.splitlines() if "::test_" in line}


def test_make_test_keeps_its_share_of_the_extended_tests_and_leaves_the_others_out():
    files = ("tests/pipeline/test_release_e2e.py",)
    in_file = {t for t in _extended_tests() if t.startswith(files[0])}
    plain = _collected(None, *files)
    assert plain and not plain & in_file  # no share: every extended test left out, the others kept
    for k in range(SHARES):
        got = _collected(str(k), *files)
        assert got - plain == set(ROTATION[k]) & in_file, k


def test_a_share_out_of_range_is_refused_naming_the_variable():
    run = _collect("3", "tests/scripts/test_rotation.py")
    assert run.returncode != 0 and f"{ENV}='3'" in run.stdout + run.stderr and "0 to 2" in run.stdout + run.stderr


def test_successive_ci_runs_take_each_share_in_turn(tmp_path):
    counter = tmp_path / "ci" / "rotation"
    assert [ci_share(counter) for _ in range(2 * SHARES + 1)] == [0, 1, 2, 0, 1, 2, 0]
    counter.write_text("not a number\n")  # a damaged counter starts over rather than failing CI
    assert ci_share(counter) == 0 and counter.read_text() == "1\n"
