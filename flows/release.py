"""Release: distill → calibrate → quantize → build engines → consistency gate → register → deploy.

Tiny CPU run (services up, see README): python -m flows.release --profile configs/test-tiny.yaml --deploy none
"""
from __future__ import annotations

import argparse
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from prefect import flow, task
from prefect.runtime import flow_run

from flows.build_engine import build_engine
from flows.calibrate import calibrate
from flows.consistency import consistency
from flows.deploy_edge import deploy_edge
from flows.distill import distill
from flows.quantize import quantize
from flows.register import register
from tasks.artifacts import ArtifactRef
from tasks.config import REPO_ROOT, load_profile
from tasks.report import markdown, table
from tasks.runs import ReleaseContext, tracking_uri


@task
def open_release(profile: str) -> ReleaseContext:
    """Create (or, on a retry of the same flow run, reuse) the MLflow parent run of this release."""
    from mlflow import MlflowClient

    p = load_profile(profile)
    run_id = flow_run.get_id()
    c = MlflowClient(tracking_uri())
    exp = c.get_experiment_by_name(p.registry.experiment)
    exp_id = exp.experiment_id if exp else c.create_experiment(p.registry.experiment)
    if run_id:
        found = c.search_runs([exp_id], f"tags.`edgeflow.prefect_flow_run_id` = '{run_id}'", max_results=1)
        if found:
            r = found[0]
            c.update_run(r.info.run_id, status="RUNNING")
            return ReleaseContext(release_id=r.data.tags["edgeflow.release_id"], profile=profile,
                                  mlflow_parent_run_id=r.info.run_id, prefect_flow_run_id=run_id)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    release_id = f"{p.name}-{stamp}" + (f"-{run_id[:8]}" if run_id else "")
    parent = c.create_run(exp_id, run_name=f"release {release_id}", tags={
        "edgeflow.release_id": release_id, "edgeflow.profile": profile, "edgeflow.prefect_flow_run_id": run_id or "",
    })
    c.log_dict(parent.info.run_id, p.model_dump(), "profile.json")
    return ReleaseContext(release_id=release_id, profile=profile, mlflow_parent_run_id=parent.info.run_id,
                          prefect_flow_run_id=run_id)


@task
def run_deploy_on_pool(profile: str, alias: str) -> dict:
    """Deploy through the `deploy-edge` deployment, so it runs on the `orin` pool's worker."""
    from prefect.deployments import run_deployment

    fr = run_deployment("deploy-edge/deploy-edge", parameters={"profile": profile, "alias": alias}, timeout=None)
    if not fr.state.is_completed():
        raise RuntimeError(f"deploy-edge flow run {fr.id} ended {fr.state.type.value}: {fr.state.message}")
    return fr.state.result()


@task
def summarize_attempt(gate_report: ArtifactRef) -> dict:
    """Did any quantized variant pass this attempt's gate, and how close did the best one come?"""
    gate = json.loads(gate_report.path.read_text())
    quantized = [r for r in gate["rows"] if r["quantized"]]
    best = max(quantized, key=lambda r: r["top1_agreement"], default=None)
    return {
        "attempt": gate["attempt"],
        "calibration_samples": gate["calibration"]["total"],
        "passed": [r["name"] for r in quantized if r["passed"]],
        "best": best and f"{best['name']}: agreement {best['top1_agreement']:.2%}, KL {best['kl']:.4f}; {'; '.join(best['reasons']) or 'passed'}",
    }


@task
def write_report(
    ctx: ReleaseContext, student: ArtifactRef, gate_report: ArtifactRef, registry: dict, deployed: dict | None, attempts: list[dict]
) -> dict:
    """Assemble the report, save it as reports/<release_id>.json and .md, and log both to MLflow."""
    from mlflow import MlflowClient

    gate = json.loads(gate_report.path.read_text())
    s = student.meta
    report = {
        "release_id": ctx.release_id,
        "profile": ctx.profile,
        "variants": [{k: r[k] for k in ("name", "size_mb", "engine_precision", "decode_tok_s", "ttft_ms", "top1_agreement",
                                        "top1_last", "kl", "kl_p99", "ppl", "greedy_exact", "passed", "quantized", "reasons")}
                     | {"engine_parity": round(r["metrics"]["engine_parity"], 4)}
                     for r in gate["rows"]],
        "staging": registry["staging"],
        "staging_version": registry["staging_version"],
        "registered": registry["registered"],
        "why_no_staging": registry["why_no_staging"] and (
            f"no variant met the bar after {len(attempts)} attempt(s); " + registry["why_no_staging"]
        ),
        "attempts": attempts,
        "smoke_answer": deployed["smoke_answer"] if deployed else None,
        "deploy": deployed and {k: deployed[k] for k in ("url", "version", "engine_binding")},
        "gate": gate["thresholds"],
        "eval_prompts": gate["eval_prompts"],
        "eval_positions": gate["eval_positions"],
        # .get: a student cached by an older release may lack the newer evaluation keys; the report shows what it has
        "student": {k: s.get(k) for k in ("student_top1_vs_teacher", "student_kl_vs_teacher", "teacher_ppl", "student_ppl",
                                          "student_ppl_before_training", "student_top1_before_training",
                                          "student_kl_before_training", "student_quality_pct", "student_layers",
                                          "student_params", "size_ratio")}
        | {"steps": load_profile(ctx.profile).distill.steps},
        "mlflow_parent_run_id": ctx.mlflow_parent_run_id,
        "prefect_flow_run_id": ctx.prefect_flow_run_id,
    }
    out = REPO_ROOT / "reports"
    out.mkdir(exist_ok=True)
    # the final attempt's plots next to the report, linked from the markdown by relative path
    plot_dir = out / ctx.release_id
    plot_dir.mkdir(exist_ok=True)
    report["plots"] = {}
    for name, src in gate.get("plots", {}).items():
        dst = plot_dir / Path(src).name
        shutil.copyfile(src, dst)
        report["plots"][name] = f"{ctx.release_id}/{dst.name}"
    (out / f"{ctx.release_id}.json").write_text(json.dumps(report, indent=1))
    (out / f"{ctx.release_id}.md").write_text(markdown(report))
    c = MlflowClient(tracking_uri())
    c.log_artifact(ctx.mlflow_parent_run_id, str(out / f"{ctx.release_id}.json"), "report")
    c.log_artifact(ctx.mlflow_parent_run_id, str(out / f"{ctx.release_id}.md"), "report")
    if report["plots"]:
        c.log_artifacts(ctx.mlflow_parent_run_id, str(plot_dir), f"report/{ctx.release_id}")
    for r in report["variants"]:
        c.log_metric(ctx.mlflow_parent_run_id, f"{r['name']}.top1_agreement", r["top1_agreement"])
    c.set_terminated(ctx.mlflow_parent_run_id, "FINISHED")
    print(table(report["variants"]))
    return report


def quantize_and_gate(profile: str, ctx: ReleaseContext, student: ArtifactRef) -> tuple[ArtifactRef, ArtifactRef, list[dict]]:
    """calibrate → quantize → build engines → gate, recalibrating while no variant passes.

    Bounded recalibration: when no variant meets the bar, try again with a larger calibration set
    (each attempt's stages are their own MLflow runs), at most gate.recalibration_attempts times.
    Returns the last attempt's gate report and calibration set, and every attempt's summary.
    """
    p = load_profile(profile)
    attempts = []
    for attempt in range(p.gate.recalibration_attempts + 1):
        calibration = calibrate(profile, ctx, student, attempt)
        quantized = quantize(profile, ctx, student, calibration, attempt)
        checkpoints = [student, *quantized]
        engines = build_engine(profile, ctx, checkpoints)
        gate_report = consistency(profile, ctx, student, calibration, checkpoints, engines, attempt)
        attempts.append(summarize_attempt(gate_report))
        if attempts[-1]["passed"]:
            break
        print(f"attempt {attempt}: no quantized variant met the bar ({attempts[-1]['best']})")
    return gate_report, calibration, attempts


@flow(name="release", log_prints=True)
def release(profile: str = "configs/demo-cpu.yaml", deploy: Literal["pool", "inline", "none"] = "pool") -> dict:
    """The whole chain on one profile; returns the report."""
    load_profile(profile)  # fail on a bad profile before anything runs
    ctx = open_release(profile)
    student = distill(profile, ctx)
    gate_report, calibration, attempts = quantize_and_gate(profile, ctx, student)
    teacher = ArtifactRef.model_validate(student.meta["teacher"])
    registry = register(profile, ctx, gate_report, {"teacher": teacher, "student": student, "calibration": calibration})
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
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--deploy", default="inline", choices=["pool", "inline", "none"])
    a = ap.parse_args()
    release(a.profile, a.deploy)
