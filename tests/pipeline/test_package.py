"""Importing `flows` prepares a stage process: MLflow's client telemetry is off unless the environment sets it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = ("import edgeflow.pipeline; import mlflow.telemetry.utils as u, os; "
         "print(os.environ['MLFLOW_DISABLE_TELEMETRY'], u.is_telemetry_disabled())")


def _probe(**env: str) -> str:
    # CI and DO_NOT_TRACK also turn MLflow's telemetry off: removed here, so only the flows package decides
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "CI")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=base | env, capture_output=True, text=True, check=True)
    return out.stdout.split()[-2:]


def test_a_stage_process_turns_mlflow_telemetry_off_and_keeps_an_explicit_setting():
    assert _probe() == ["true", "True"]
    assert _probe(MLFLOW_DISABLE_TELEMETRY="false")[0] == "false"
