"""scripts/test_durations.py (`make test-durations`) over a real pytest run's JUnit XML and machine.json."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_runs_files_tests_and_machine_are_printed_from_its_junit_xml(tmp_path):
    xml = tmp_path / "results" / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", f"--junitxml={xml}",
                          "tests/tracking/test_artifacts.py", "tests/distill/test_losses.py"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
    machine = json.loads((xml.parent / "machine.json").read_text())  # written by tests/conftest.py, in the controller
    assert machine["cpu_model"] and machine["cores"] >= 1 and isinstance(machine["isa"], list)

    out = subprocess.run([sys.executable, "scripts/test_durations.py", "--xml", str(xml), "--tests", "2"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    n_artifacts, n_losses = 3, 9  # the two files' tests, as pytest collected them
    assert lines[0].startswith("run of ") and f"{n_artifacts + n_losses} passed" in lines[0]
    assert lines[1].startswith(f"machine: {machine['cpu_model']}, {machine['cores']} cores")
    files = {line.split()[0]: int(line.split()[1]) for line in lines if line.startswith("tests/")}
    assert files == {"tests/tracking/test_artifacts.py": n_artifacts, "tests/distill/test_losses.py": n_losses}
    slowest = [line for line in lines if "::test_" in line]
    assert len(slowest) == 2 and all(line.split()[1] == "passed" for line in slowest)


def test_no_run_yet_says_which_command_writes_the_file(tmp_path):
    r = subprocess.run([sys.executable, "scripts/test_durations.py", "--xml", str(tmp_path / "none.xml")], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "run `make test` (or `make test-all`) first" in r.stderr
