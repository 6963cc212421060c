"""Release: distill → calibrate → quantize → build engines → gate reference → consistency gate → register → deploy.

Tiny CPU run (services up, see README): python -m flows.release --profile configs/test-tiny.yaml --deploy none
"""
from __future__ import annotations

import argparse
import json
import shutil
from datetime import datetime, timezone
from typing import Literal

from prefect import flow, task
from prefect.runtime import flow_run

from flows.build_engine import build_engine
from flows.calibrate import calibrate
from flows.consistency import consistency
from flows.deploy_edge import deploy_edge
from flows.distill import distill
from flows.gate_reference import gate_reference
from flows.quantize import quantize
from flows.register import register
from flows.stages import check_placement, run_stage
from tasks.artifacts import ArtifactRef
from tasks.config import REPO_ROOT, load_profile
from tasks.report import markdown, table
from tasks.runs import ReleaseContext, experiment_id, tracking_uri


@task
def open_release(profile: str) -> ReleaseContext:
    """Create (or, on a retry of the same flow run, reuse) the MLflow parent run of this release, resolve the
    profile once and publish every file it names to that run, so stages on other hosts read them from the store."""
    from mlflow import MlflowClient

    from tasks.codeversion import code_identity
    from tasks.store import check_reachable

    p = load_profile(profile)
    check_reachable(tracking_uri())
    run_id = flow_run.get_id()
    c = MlflowClient(tracking_uri())
    exp_id = experiment_id(c, p.registry.experiment, p.registry.artifact_location)
    found = run_id and c.search_runs([exp_id], f"tags.`edgeflow.prefect_flow_run_id` = '{run_id}'", max_results=1)
    if found:
        parent = found[0]
        c.update_run(parent.info.run_id, status="RUNNING")
        release_id = parent.data.tags["edgeflow.release_id"]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        release_id = f"{p.name}-{stamp}" + (f"-{run_id[:8]}" if run_id else "")
        parent = c.create_run(exp_id, run_name=f"release {release_id}", tags={
            "edgeflow.release_id": release_id, "edgeflow.profile": profile, "edgeflow.prefect_flow_run_id": run_id or "",
        })
        c.log_dict(parent.info.run_id, p.model_dump(by_alias=True), "profile.json")
    return ReleaseContext(release_id=release_id, profile=profile, mlflow_parent_run_id=parent.info.run_id,
                          prefect_flow_run_id=run_id, settings=p.settings(),
                          inputs=publish_inputs(c, parent.info.run_id, p), code=code_identity())


def publish_inputs(client, run_id: str, p) -> dict[str, ArtifactRef]:
    """Every file the profile names, logged to the release's run under inputs/<sha256>/…: content-addressed, so a
    retry after an edit publishes the new content beside the old instead of over it."""
    from tasks.artifacts import sha256_tree
    from tasks.store import publish

    refs = {}
    for path in dict.fromkeys(p.input_files().values()):
        local = p.resolve(path)
        sha = sha256_tree(local)
        refs[path] = publish(client, run_id, local, f"inputs/{sha[:16]}", "input", meta={"profile_path": path}, sha256=sha)
    return refs


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
    from tasks.store import materialize

    gate = json.loads(materialize(gate_report).read_text())
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

    from tasks.store import materialize

    gate = json.loads(materialize(gate_report).read_text())
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
        "gate_reference": gate["reference"],
        # .get: a student cached by an older release may lack the newer evaluation keys; the report shows what it has
        "student": {k: s.get(k) for k in ("student_top1_vs_teacher", "student_kl_vs_teacher", "teacher_ppl", "student_ppl",
                                          "student_ppl_before_training", "student_top1_before_training",
                                          "student_kl_before_training", "student_quality_pct", "student_layers",
                                          "student_params", "size_ratio")}
        | {"steps": ctx.resolved().distill.steps},
        "mlflow_parent_run_id": ctx.mlflow_parent_run_id,
        "prefect_flow_run_id": ctx.prefect_flow_run_id,
    }
    out = REPO_ROOT / "reports"
    out.mkdir(exist_ok=True)
    # the final attempt's plots next to the report, linked from the markdown by relative path
    plot_dir = out / ctx.release_id
    plot_dir.mkdir(exist_ok=True)
    report["plots"] = {}
    for name, ref in gate.get("plots", {}).items():
        ref = ArtifactRef.model_validate(ref)
        shutil.copyfile(materialize(ref), plot_dir / ref.name)
        report["plots"][name] = f"{ctx.release_id}/{ref.name}"
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


def quantize_and_gate(ctx: ReleaseContext, student: ArtifactRef) -> tuple[ArtifactRef, ArtifactRef, list[dict]]:
    """calibrate → quantize → build engines → gate, recalibrating while no variant passes.

    Bounded recalibration: when no variant meets the bar, try again with a larger calibration set
    (each attempt's stages are their own MLflow runs), at most gate.recalibration_attempts times.
    Returns the last attempt's gate report and calibration set, and every attempt's summary.
    Each stage runs where the profile's placement says (flows/stages.py).
    """
    attempts = []
    for attempt in range(ctx.resolved().gate.recalibration_attempts + 1):
        calibration = run_stage(ctx, "calibrate", calibrate, student=student, attempt=attempt)
        quantized = run_stage(ctx, "quantize", quantize, student=student, calibration=calibration, attempt=attempt)
        checkpoints = [student, *quantized]
        engines = run_stage(ctx, "build_engine", build_engine, checkpoints=checkpoints)
        reference = run_stage(ctx, "gate_reference", gate_reference, student=student, calibration=calibration,
                              checkpoints=checkpoints, attempt=attempt)
        gate_report = run_stage(ctx, "consistency", consistency, reference=reference, checkpoints=checkpoints,
                                engines=engines, attempt=attempt)
        attempts.append(summarize_attempt(gate_report))
        if attempts[-1]["passed"]:
            break
        print(f"attempt {attempt}: no quantized variant met the bar ({attempts[-1]['best']})")
    return gate_report, calibration, attempts


@flow(name="release", log_prints=True)
def release(profile: str = "configs/demo-cpu.yaml", deploy: Literal["pool", "inline", "none"] = "pool") -> dict:
    """The whole chain on one profile; returns the report."""
    check_placement(load_profile(profile).placement)  # a bad profile or placement fails before anything runs
    ctx = open_release(profile)
    student = run_stage(ctx, "distill", distill)
    gate_report, calibration, attempts = quantize_and_gate(ctx, student)
    teacher = ArtifactRef.model_validate(student.meta["teacher"])
    registry = run_stage(ctx, "register", register, gate_report=gate_report,
                         lineage={"teacher": teacher, "student": student, "calibration": calibration})
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
