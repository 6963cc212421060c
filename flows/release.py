"""Release: distill → calibrate → quantize → build engines → gate reference → consistency gate → register → deploy.

Tiny CPU run (services up, see README): python -m flows.release --profile configs/test-tiny.yaml --deploy none

The data path only: the part the nightly shares (open the release run, the gate loop, the pool deploy) is in
flows/chain.py, the MLflow runs in tasks/runs.py, the report in tasks/report.py.
"""
from __future__ import annotations

import argparse
import os
from typing import Literal

from prefect import flow, task

from flows.chain import open_release, quantize_and_gate, run_deploy_on_pool, summarize_attempt
from flows.deploy_edge import deploy_edge
from flows.distill import distill
from flows.register import lineage_of, register, stage_calls as register_calls
from flows.stages import check_placement, run_stage
from tasks.artifacts import ArtifactRef
from tasks.config import load_profile
from tasks.runs import ReleaseContext

# Defined in flows/chain.py (shared with the nightly); importable from here as before.
__all__ = ["GateFailed", "open_release", "quantize_and_gate", "release", "run_deploy_on_pool", "summarize_attempt", "write_report"]


@task
def write_report(
    ctx: ReleaseContext, student: ArtifactRef, gate_report: ArtifactRef, registry: dict, deployed: dict | None, attempts: list[dict]
) -> dict:
    """Assemble the report, save it as reports/<release_id>.json and .md, and log both to MLflow (tasks/report.py)."""
    from tasks.evaluation.report import load_gate_report
    from tasks.report import write_release_report

    return write_release_report(ctx, student, load_gate_report(gate_report), registry, deployed, attempts)


@flow(name="release", log_prints=True)
def release(profile: str = "configs/demo-cpu.yaml", deploy: Literal["pool", "inline", "none"] = "pool") -> dict:
    """The whole chain on one profile; returns the report."""
    check_placement(load_profile(profile).placement)  # a bad profile or placement fails before anything runs
    ctx = open_release(profile)
    student = run_stage(ctx, "distill", distill)
    gate_report, calibration, attempts = quantize_and_gate(ctx, student)
    registry = run_stage(ctx, "register", register, calls=register_calls, gate_report=gate_report,
                         lineage=lineage_of(student, calibration))
    deployed = None
    if registry["staging"] and deploy == "pool":
        deployed = run_deploy_on_pool(profile, "staging")
    elif registry["staging"] and deploy == "inline":
        deployed = deploy_edge(profile, "staging")
    report = write_report(ctx, student, gate_report, registry, deployed, attempts)
    if not registry["staging"]:
        # A release without a candidate is a failed release: red in the UI, aliases untouched, report written.
        raise GateFailed(f"{report['why_no_staging']} (report: reports/{ctx.release_id}.md)")
    return report


class GateFailed(RuntimeError):
    """No quantized variant met the gate after the bounded recalibration."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", None), description=__doc__)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--deploy", default="inline", choices=["pool", "inline", "none"])
    a = ap.parse_args()
    release(a.profile, a.deploy)
