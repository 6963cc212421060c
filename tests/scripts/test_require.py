"""The one rule for missing tools (tests/helpers/require.py), run through a real pytest session: on a developer's
machine a test that needs a missing tool skips; under EDGEFLOW_REQUIRE_ALL (.ci/run) it fails, however the skip was
raised, while a skip for the kind of machine (no GPU) stays a skip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CASES = '''
import pytest
from tests.helpers.require import lacking, require_binary, skip_for_hardware

pytest.importorskip("json")  # present: the module is collected


def test_helper():
    lacking("frobnicator is not installed", "apt-get install frobnicator")


def test_binary():
    require_binary("edgeflow-no-such-binary", "apt-get install it")


def test_plain_skip():
    pytest.skip("someone's own reason")


@pytest.mark.skipif(True, reason="marker")
def test_marker():
    pass


def test_hardware():
    skip_for_hardware("no CUDA GPU")


@pytest.mark.gpu
def test_gpu_marked():
    pytest.skip("needs a CUDA GPU")


def test_runs():
    assert True
'''


def outcomes(tmp_path: Path, strict: bool) -> dict[str, tuple[str, str]]:
    """Each case's (outcome, message) from a pytest run with tests.helpers.require as its plugin."""
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    report = tmp_path / "report.xml"
    env = {k: v for k, v in os.environ.items() if k != "EDGEFLOW_REQUIRE_ALL"} | {"PYTHONPATH": str(REPO)}
    if strict:
        env["EDGEFLOW_REQUIRE_ALL"] = "1"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.require", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "test_cases.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                   timeout=120)
    import xml.etree.ElementTree as ET

    got = {}
    for case in ET.parse(report).iter("testcase"):
        kids = [k for k in case if k.tag in ("failure", "error", "skipped")]
        got[case.get("name")] = (kids[0].tag, kids[0].get("message", "")) if kids else ("passed", "")
    return got


def test_missing_tools_skip_on_a_developers_machine(tmp_path):
    got = outcomes(tmp_path, strict=False)
    assert {name: o for name, (o, _) in got.items()} == {
        "test_helper": "skipped", "test_binary": "skipped", "test_plain_skip": "skipped", "test_marker": "skipped",
        "test_hardware": "skipped", "test_gpu_marked": "skipped", "test_runs": "passed"}, json.dumps(got, indent=1)
    assert "frobnicator is not installed (apt-get install frobnicator)" in got["test_helper"][1]


def test_under_require_all_a_skip_for_a_missing_tool_fails_naming_it(tmp_path):
    got = outcomes(tmp_path, strict=True)
    for name in ("test_helper", "test_binary", "test_plain_skip", "test_marker"):
        outcome, message = got[name]
        assert outcome in ("failure", "error") and "EDGEFLOW_REQUIRE_ALL is set" in message, (name, got)
    assert "frobnicator is not installed (apt-get install frobnicator)" in got["test_helper"][1]
    assert "edgeflow-no-such-binary is not installed" in got["test_binary"][1]
    # the kind of machine is not a missing tool: those still skip, and the rest still runs
    assert got["test_hardware"][0] == "skipped" and got["test_gpu_marked"][0] == "skipped", got
    assert got["test_runs"][0] == "passed", got
