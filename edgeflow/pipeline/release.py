"""Release: distill → calibrate → quantize → build engines → gate reference → consistency gate → register → deploy.

Tiny CPU run (services up, see README): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none

The data path only: the part the nightly shares (open the release run, the gate loop, the pool deploy) is in
edgeflow/pipeline/chain.py, the MLflow runs in edgeflow/tracking/runs.py, the report in edgeflow/tracking/report.py.
"""
from __future__ import annotations

import argparse
import os
from typing import Literal

from prefect import flow, task

from edgeflow.pipeline.chain import SLOUnreachable, open_release, quantize_and_gate, run_deploy_on_pool, summarize_attempt
from edgeflow.pipeline.deploy_edge import deploy_edge
from edgeflow.pipeline.distill import distill
from edgeflow.pipeline.register import lineage_of, register, stage_calls as register_calls
from edgeflow.pipeline.stages import check_placement, run_stage
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.preflight import load_profile
from edgeflow.tracking.runs import ReleaseContext

# open_release, quantize_and_gate, run_deploy_on_pool and summarize_attempt are defined in edgeflow/pipeline/chain.py (shared with
# the nightly); importable from here as before.
__all__ = ["GateFailed", "StudentRejected", "check_student_gate", "open_release", "quantize_and_gate", "release",
           "run_deploy_on_pool", "summarize_attempt", "write_report"]


@task
def write_report(
    ctx: ReleaseContext, student: ArtifactRef, gate_report: ArtifactRef | None, registry: dict, deployed: dict | None,
    attempts: list[dict], student_gate: dict | None = None,
) -> dict:
    """Assemble the report, save it as reports/<release_id>.json and .md, and log both to MLflow (edgeflow/tracking/report.py).
    gate_report is None when the student gate refused the student before any quantization."""
    from edgeflow.evaluation.report import load_gate_report
    from edgeflow.tracking.report import write_release_report

    gate = load_gate_report(gate_report) if gate_report is not None else None
    return write_release_report(ctx, student, gate, registry, deployed, attempts, student_gate)


@task
def check_student_gate(ctx: ReleaseContext, student: ArtifactRef, gate_report: ArtifactRef | None = None) -> dict:
    """The student gate (edgeflow/evaluation/student_gate.py) on the student's evaluation against the teacher, and, given
    a gate report, on the FP student's own answers to the demo prompts; recorded on the release's parent run."""
    from edgeflow.evaluation.report import load_gate_report
    from edgeflow.evaluation.student_gate import check_student
    from edgeflow.tracking.runs import record_student_gate

    fp = load_gate_report(gate_report).fp_row if gate_report is not None else None
    verdict = check_student(student.meta, ctx.resolved().gate.student, fp.answers if fp else None)
    record_student_gate(ctx, verdict)
    return verdict


def not_registered(ctx: ReleaseContext, why: str) -> dict:
    """The register stage's answer for a release that never reached it: nothing registered, aliases untouched."""
    return {"model_name": ctx.resolved().registry.model_name, "registered": {}, "staging": None, "staging_version": None,
            "staging_before": None, "why_no_staging": why}


@flow(name="release", log_prints=True)
def release(profile: str = "configs/demo-cpu.yaml", deploy: Literal["pool", "inline", "none"] = "pool") -> dict:
    """The whole chain on one profile; returns the report."""
    from edgeflow.evaluation.student_gate import rejection_message

    p = load_profile(profile)  # read and preflighted once; the release's stages get it through ctx.settings
    check_placement(p.placement)  # a bad profile or placement fails before anything runs
    ctx = open_release(profile, p)
    student = run_stage(ctx, "distill", distill)
    # the student against the teacher first: a student not worth serving costs no quantization; its own answers
    # come with the first gate attempt (the FP row), and quantize_and_gate stops recalibrating when they fail
    verdict = check_student_gate(ctx, student)
    gate_report, calibration, attempts = None, None, []
    if verdict["passed"]:
        try:
            gate_report, calibration, attempts = quantize_and_gate(ctx, student)
        except SLOUnreachable as e:  # no variant could meet slo.targets on any engine: nothing was built
            write_report(ctx, student, None, not_registered(ctx, str(e)), None, [], verdict)
            raise SLOUnreachable(f"{e}. Nothing was built, registered or deployed (report: reports/{ctx.release_id}.md)") from None
        verdict = check_student_gate(ctx, student, gate_report)
    if not verdict["passed"]:
        # Refused: nothing registered, no alias moved, nothing deployed; the report says why. A Retry finds the
        # student cached and refuses it again, unless an input changed.
        p = ctx.resolved()
        why = rejection_message(verdict, p.distill.steps, student.meta.get("student_layers"))
        write_report(ctx, student, gate_report, not_registered(ctx, why), None, attempts, verdict)
        raise StudentRejected(f"{why} (report: reports/{ctx.release_id}.md)")
    registry = run_stage(ctx, "register", register, calls=register_calls, gate_report=gate_report,
                         lineage=lineage_of(student, calibration))
    deployed = None
    if registry["staging"] and deploy == "pool":
        deployed = run_deploy_on_pool(profile, "staging")
    elif registry["staging"] and deploy == "inline":
        deployed = deploy_edge(profile, "staging")
    report = write_report(ctx, student, gate_report, registry, deployed, attempts, verdict)
    if not registry["staging"]:
        # A release without a candidate is a failed release: red in the UI, aliases untouched, report written.
        raise GateFailed(f"{report['why_no_staging']} (report: reports/{ctx.release_id}.md)")
    return report


class GateFailed(RuntimeError):
    """No quantized variant met the gate after the bounded recalibration."""


class StudentRejected(RuntimeError):
    """The student gate refused the distilled student (gate.student): nothing of it is registered or deployed."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", None), description=__doc__)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--deploy", default="inline", choices=["pool", "inline", "none"])
    a = ap.parse_args()
    release(a.profile, a.deploy)
