"""Nightly recalibration: yesterday's traffic → calibration set → re-quantize the production student → gate → staging.

Tiny CPU run (services up, a release done): python -m edgeflow.pipeline.nightly --profile configs/test-tiny.yaml --until 2026-11-30T00:00:00Z

The student is not retrained: distillation is the expensive, slow-moving part, and what drifts night to
night is the traffic the quantizer should be calibrated on. `production` moves only when the profile
allows auto-promotion and the new version is Pareto-better on the gate than the one serving; then it is
deployed first and promoted through the same checks as a manual promotion.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Literal

from prefect import flow, task

from edgeflow.pipeline.chain import open_release, quantize_and_gate, run_deploy_on_pool
from edgeflow.pipeline.register import register, stage_calls as register_calls
from edgeflow.pipeline.stages import check_placement, run_stage
from edgeflow.profile import Profile
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.preflight import load_profile, preflight
from edgeflow.calibration.nightly import Traffic, beats, collect_traffic, derive_profile, parse_time
from edgeflow.tracking.runs import tracking_uri


@task
def gather_traffic(p: Profile, logs_dir: str | None, until: str | None, student: ArtifactRef) -> Traffic:
    """Clean the last window of access logs into a snapshot, or say why the night is skipped.

    The logs are the segments the devices shipped to the artifact store (`nightly.logs_source: store`, fetched and
    checked by sha256), else the folder `nightly.logs_dir`; a `logs_dir` given to the flow run is always read."""
    from datetime import timedelta

    from transformers import AutoTokenizer

    from edgeflow.evaluation.gate import eval_texts
    from edgeflow.device.logship import fetch_segments
    from edgeflow.tracking.store import materialize

    end = parse_time(until)
    tok = AutoTokenizer.from_pretrained(materialize(student))
    evals = eval_texts({d: p.resolve(s) for d, s in p.gate.eval_sources.items()}, p.gate.num_prompts, tok)
    night = p.work / "nightly" / end.strftime("%Y%m%dT%H%M%SZ")
    out = night / "traffic.jsonl"
    if logs_dir is None and p.nightly.logs_source == "store":
        fetched = night / "segments"
        logs = fetch_segments(end - timedelta(hours=p.nightly.window_hours), end, fetched)
        return collect_traffic(logs, end, p.nightly.window_hours, p.nightly.min_records, evals, out, tok, fetched_to=fetched)
    return collect_traffic(p.resolve(logs_dir or p.nightly.logs_dir), end, p.nightly.window_hours, p.nightly.min_records,
                           evals, out, tok)


@task
def base_student(p: Profile) -> dict:
    """The version behind `nightly.base_alias` (else `staging`) and the student it was quantized from."""
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import alias_version, gate_figures, load_run_json, split_runs_uri

    c = MlflowClient(tracking_uri())
    name = p.registry.model_name
    for alias in dict.fromkeys([p.nightly.base_alias, "staging"]):
        version = alias_version(c, name, alias)
        if version:
            break
    else:
        return {"skipped": f"{name} has neither `{p.nightly.base_alias}` nor `staging`: run a release first"}
    mv = c.get_model_version(name, version)
    lineage = load_run_json(c, mv.run_id, f"{split_runs_uri(mv.source)[1]}/lineage.json")
    student = ArtifactRef.model_validate(lineage["student"])
    # The student must be in the store, bit for bit, or re-quantizing it would calibrate a different model.
    from edgeflow.tracking.store import in_store

    if not in_store(student):
        raise FileNotFoundError(
            f"version {version} ({alias}) was quantized from student {student.uri} (sha256 {student.sha256[:12]}, run "
            f"{student.mlflow_run_id}), which the artifact store no longer has; re-run the release to distill it again"
        )
    return {"version": version, "alias": alias, "student": student, "teacher": ArtifactRef.model_validate(lineage["teacher"]),
            "gate": gate_figures(mv)}


@task
def write_night_report(profile: str, p: Profile, report: dict) -> dict:
    """Save the night's report as reports/nightly-<stamp>.json and .md and log it to MLflow (edgeflow/tracking/report.py)."""
    from edgeflow.tracking.report import write_nightly_report

    return write_nightly_report(profile, p, report)


@flow(name="nightly-recalibration", log_prints=True)
def nightly_recalibration(
    profile: str = "configs/demo-cpu.yaml",
    logs_dir: str | None = None,
    until: str | None = None,
    deploy: Literal["pool", "inline", "none"] = "pool",
) -> dict:
    """Access logs of the last window in (the devices' shipped segments, or `logs_dir`); a new staging version (or a
    'skipped' report) out."""
    p = load_profile(profile)  # read and preflighted once: every step below is handed it (or the night's derived one)
    late = started_late(p.nightly.max_late_h)
    if late:
        return write_night_report(profile, p, {"status": "skipped", "reason": late})
    check_placement(p.placement)  # before any compute
    base = base_student(p)
    if base.get("skipped"):
        return write_night_report(profile, p, {"status": "skipped", "reason": base["skipped"]})
    traffic = gather_traffic(p, logs_dir, until, base["student"])
    if traffic.skipped:
        return write_night_report(profile, p, {"status": "skipped", "reason": traffic.skipped, "traffic": traffic.model_dump()})
    ctx = open_release(profile, preflight(derive_profile(p, Path(traffic.snapshot))))
    gate_report, calibration, attempts = quantize_and_gate(ctx, base["student"])
    registry = run_stage(ctx, "register", register, calls=register_calls, gate_report=gate_report,
                         lineage={"teacher": base["teacher"], "student": base["student"], "calibration": calibration})
    report = {"status": "registered" if registry["staging"] else "gate_failed", "release_id": ctx.release_id,
              "traffic": traffic.model_dump(), "attempts": attempts,
              "base": f"version {base['version']} (`{base['alias']}`), student {base['student'].sha256[:12]}",
              "staging": registry["staging"] and f"version {registry['staging_version']} ({registry['staging']})",
              "reason": registry["why_no_staging"]}
    if registry["staging"] and p.nightly.auto_promote:
        report |= promote_if_better(profile, p, registry, base, deploy)
    return write_night_report(profile, p, report)


def started_late(max_late_h: float | None) -> str | None:
    """Why this night is skipped when it started more than `max_late_h` hours after its scheduled time (None: it is
    not). A run created by hand (run_deployment, `edgeflow nightly`) is scheduled when it is created, so it is late
    only if it waited that long for a worker."""
    from datetime import datetime, timezone

    from prefect.runtime import flow_run

    scheduled = flow_run.scheduled_start_time
    if max_late_h is None or scheduled is None or not flow_run.get_id():
        return None
    late_h = (datetime.now(timezone.utc) - scheduled).total_seconds() / 3600
    if late_h <= max_late_h:
        return None
    return (f"started {late_h:.1f} h after its scheduled time {scheduled:%Y-%m-%d %H:%M} UTC, later than "
            f"nightly.max_late_h={max_late_h:g} (the workers were down); the next night runs on time, or run one now "
            "with `edgeflow nightly`")


def promote_if_better(profile: str, p: Profile, registry: dict, base: dict, deploy: str) -> dict:
    """Deploy the new staging version and move `production` to it, if it beats production on the gate. `profile`: the
    path the devices' deploy-edge runs read (a deployment's parameter); `p`: what this night read from it."""
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import gate_figures

    c = MlflowClient(tracking_uri())
    mv = c.get_model_version(p.registry.model_name, registry["staging_version"])
    new = gate_figures(mv)
    better, why = beats(new, base["gate"]) if base["alias"] == "production" else (True, "no production version yet")
    if not better:
        return {"promotion": f"not promoted: {why}"}
    if deploy == "none":
        return {"promotion": f"not promoted: {why}, but deploy=none (production needs a successful edge deployment)"}
    if deploy == "pool":
        run_deploy_on_pool(profile, "staging")
    else:
        from edgeflow.pipeline.deploy_edge import deploy_edge

        deploy_edge(profile, "staging")
    from edgeflow.tracking.promotion import promote

    move = promote(c, p.registry.model_name, registry["staging_version"], "production", reason=f"nightly: {why}")
    return {"status": "promoted", "promotion": f"version {registry['staging_version']} promoted: {why}", "move": str(move)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", None), description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--logs-dir", help="Read this folder instead of the store's shipped segments (nightly.logs_source).")
    ap.add_argument("--until", help="Window end, ISO 8601 (default now).")
    ap.add_argument("--deploy", default="inline", choices=["pool", "inline", "none"])
    a = ap.parse_args()
    nightly_recalibration(a.profile, a.logs_dir, a.until, a.deploy)
