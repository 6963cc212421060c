"""`edgeflow plan` (edgeflow/pipeline/plan.py) without servers: what changed, named; a profile that does not load is exit 2; and
servers that do not answer are named (exit 1). The plan against a real release is in tests/pipeline/test_release_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from edgeflow.pipeline.plan import differences

REPO = Path(__file__).resolve().parents[2]


def test_differences_name_a_changed_profile_file_by_its_path_and_a_changed_setting_by_its_values() -> None:
    before = {"cfg": {"steps": 60, "lr": 0.0005}, "held_out": {"chat": {"kind": "input", "sha256": "a" * 64}},
              "teacher": {"kind": "teacher", "sha256": "t" * 64}}
    now = {"cfg": {"steps": 80, "lr": 0.0005}, "held_out": {"chat": {"kind": "input", "sha256": "b" * 64}},
           "teacher": {"kind": "teacher", "sha256": "t" * 64}}
    lines = differences(before, now, {"b" * 64: "data/eval/chat.jsonl"})
    assert lines == ["cfg.steps: 60 → 80",
                     f"held_out.chat: data/eval/chat.jsonl (the profile's file) changed (sha256 {'a' * 12} → {'b' * 12})"]
    assert differences(now, now, {}) == []
    assert differences({}, {"student": {"kind": "student", "sha256": "c" * 64}}, {}) == [
        f"student: its student changed (absent → {'c' * 12})"]


def _plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli", "plan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=os.environ | env)


def test_a_profile_that_does_not_load_is_exit_2_naming_the_field(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "test-tiny.yaml").read_text().replace("distill:", "distill:\n  stepz: 3", 1))
    out = _plan(str(bad))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "stepz" in out.stderr and "Traceback" not in out.stderr


def test_servers_that_do_not_answer_are_named_and_the_plan_still_keys_what_it_can(tmp_path) -> None:
    from tests.helpers.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    out = _plan("configs/test-tiny.yaml", "--json", PREFECT_API_URL=f"{dead}/api", MLFLOW_TRACKING_URI=dead,
                PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "results"))
    assert out.returncode == 1, out.stdout + out.stderr
    plan = json.loads(out.stdout)
    assert plan["services"]["prefect"].startswith(f"PREFECT_API_URL={dead}/api does not answer")
    assert plan["services"]["mlflow"].startswith(f"MLFLOW_TRACKING_URI={dead} does not answer")
    assert [s["stage"] for s in plan["stages"]] == ["distill", "calibrate", "quantize", "build_engine", "gate_reference",
                                                     "consistency", "register"]
    [distill] = plan["stages"][0]["calls"]
    if distill["status"] != "unknown":  # the teacher is on this host (tests/conftest.py converts it): keyed, not cached
        assert distill["status"] == "compute" and distill["key"].startswith("train_student-v2-")
        assert distill["why"] == ["MLflow does not answer: what changed is unknown"]
    assert {c["status"] for s in plan["stages"][1:] for c in s["calls"]} == {"after distill"}
