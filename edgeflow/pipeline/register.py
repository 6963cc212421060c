"""Register stage: every variant that passed the gate becomes a model version; the best gets `staging`.

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefect import flow, task

from edgeflow.pipeline.stages import Call, StageCalls, enter_stage
from edgeflow.tracking.artifacts import MANIFEST, ArtifactRef, write_manifest
from edgeflow.tracking.runs import ReleaseContext, content_key, stage_run


def _link_tree(ref: dict, dst: Path) -> None:
    """One part of the package, materialized from the store on this host (verified), then hard-linked from this
    host's own cache: the package is a view of files already here, not a second copy on disk."""
    from edgeflow.tracking.store import link_or_copy, materialize

    shutil.copytree(materialize(ArtifactRef.model_validate(ref)), dst, copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns(MANIFEST))


def package_variant(row: dict, lineage: dict, dest: Path) -> str:
    """Lay out checkpoint/ + engine/ + gate.json + lineage.json with a manifest; returns its tree hash."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    _link_tree(row["checkpoint"], dest / "checkpoint")
    _link_tree(row["engine"], dest / "engine")
    (dest / "gate.json").write_text(json.dumps({k: v for k, v in row.items() if k not in ("checkpoint", "engine")}, indent=1))
    (dest / "lineage.json").write_text(json.dumps(lineage, indent=1))
    return write_manifest(dest)


def slo_tags(row: dict) -> dict[str, str]:
    """{edgeflow.slo.<device>: what the gate measured against that target}, for a registered version's tags."""
    tags = {}
    for t in row.get("slo") or []:
        m = t.get("measured")
        tags[f"edgeflow.slo.{t['device']}"] = (
            f"not measured: {t['not_measured']}" if "not_measured" in t else
            f"met: TTFT p99 {m['ttft_p99_ms']:g} ms, decode {m['decode_tok_s']} tok/s per stream, peak {m['peak_memory_mb']:g} MB "
            f"at {t['objectives']['prompt_tokens']} prompt tokens, concurrency {t['objectives']['concurrency']}")[:5000]
    return tags


def choose_staging(rows: list[dict]) -> dict | None:
    """The smallest passing quantized variant; ties go to the higher agreement.

    Passing includes every service objective the gate measured (slo.targets): among the variants that meet them all,
    the smallest leaves the device the most memory for KV caches and costs the fleet the least to download, and no
    objective asks for more speed than it states."""
    passing = [r for r in rows if r["passed"] and r["quantized"]]
    return min(passing, key=lambda r: (r["size_mb"], -r["top1_agreement"])) if passing else None


# Cached like the stages before it: a retried or re-run release whose gate report and lineage did not
# change gets the versions registered the first time instead of a duplicate set (the model name is part
# of the key, so the same report under another registered model registers anew).
@task(cache_key_fn=content_key, persist_result=True)
def register_passing(
    gate_report: ArtifactRef, lineage: dict[str, ArtifactRef], ctx: ReleaseContext, model_name: str | None = None
) -> dict:
    """Register passing variants with lineage tags and move `staging` to the best one."""
    from edgeflow.evaluation.report import load_gate_report
    from edgeflow.tracking.registry import GATE_REPORT_TAG, PACKAGE_SHA256_TAG, alias_version, gate_report_link, register_version

    profile = ctx.resolved()
    name = model_name or profile.registry.model_name
    # each row as the consistency stage wrote it (fields in its order), for the package's gate.json and lineage.json
    rows = [r.model_dump(exclude_unset=True) for r in load_gate_report(gate_report).rows]
    lin = {k: v.model_dump() for k, v in lineage.items()}
    registered: dict[str, str] = {}
    with stage_run(ctx, "register", {"model_name": name}) as (client, run_id):
        staging_before = alias_version(client, name, "staging")
        for row in rows:
            if not (row["passed"] and row["quantized"]):
                continue
            dest = profile.work / "releases" / ctx.release_id / "package" / row["name"]
            tree = package_variant(row, lin | {"checkpoint": row["checkpoint"], "engine": row["engine"]}, dest)
            client.log_artifacts(run_id, str(dest), f"model/{row['name']}")
            registered[row["name"]] = register_version(
                client, name, run_id, f"model/{row['name']}",
                tags={
                    "edgeflow.release_id": ctx.release_id,
                    "edgeflow.variant": row["name"],
                    PACKAGE_SHA256_TAG: tree,
                    "edgeflow.teacher_sha256": lineage["teacher"].sha256,
                    "edgeflow.student_run_id": lineage["student"].mlflow_run_id or "",
                    "edgeflow.student_sha256": lineage["student"].sha256,
                    "edgeflow.calibration_sha256": lineage["calibration"].sha256,
                    "edgeflow.recipe": row["checkpoint"]["meta"].get("recipe", ""),
                    "edgeflow.engine_backend": row["engine"]["meta"].get("backend", ""),
                    "edgeflow.gate.top1_agreement": str(row["top1_agreement"]),
                    "edgeflow.gate.kl": str(row["kl"]),
                    "edgeflow.gate.ppl": str(row["ppl"]),
                    "edgeflow.gate.passed": "true",
                    GATE_REPORT_TAG: gate_report_link(gate_report),
                } | slo_tags(row),
            )
        best = choose_staging(rows)
        if best:
            client.set_registered_model_alias(name, "staging", registered[best["name"]])
        client.log_dict(run_id, {"registered": registered, "staging": best and best["name"]}, "registered.json")
        if any(r.get("slo") for r in rows):  # every quantized variant's objectives, the missed ones with their figures
            client.log_dict(run_id, {r["name"]: r["slo"] for r in rows if r.get("slo")}, "slo.json")
    return {
        "model_name": name,
        "registered": registered,
        "staging": best["name"] if best else None,
        "staging_version": registered[best["name"]] if best else None,
        "staging_before": staging_before,
        "why_no_staging": None if best else "no quantized variant passed the gate: " + "; ".join(
            f"{r['name']}: {', '.join(r['reasons'])}" for r in rows if r["quantized"]
        ),
    }


def lineage_of(student: ArtifactRef, calibration: ArtifactRef) -> dict[str, ArtifactRef]:
    """What a registered version records it came from: the teacher (as the student's run recorded it), the student and
    the calibration set."""
    from edgeflow.tracking.lineage import teacher_of

    return {"teacher": teacher_of(student), "student": student, "calibration": calibration}


def register_call(ctx: ReleaseContext, gate_report: ArtifactRef, lineage: dict[str, ArtifactRef]) -> Call:
    """The registration as the stage makes it (its result is the registry's answer, not an artifact)."""
    return Call(register_passing, (gate_report, lineage, ctx, ctx.resolved().registry.model_name), "register")


def stage_calls(ctx: ReleaseContext, gate_report: ArtifactRef, lineage: dict[str, ArtifactRef]) -> StageCalls:
    """The stage's call, for the release to look up before it submits the stage (edgeflow/pipeline/stages.py run_stage): a
    registration already made for this gate report and lineage is the registry's answer again."""
    return StageCalls([register_call(ctx, gate_report, lineage)], many=False)


@flow(name="register", log_prints=True)
def register(ctx: ReleaseContext, gate_report: ArtifactRef, lineage: dict[str, ArtifactRef]) -> dict:
    """Gate report in, registered versions and the `staging` alias out."""
    enter_stage(ctx, "register")
    return register_passing(*register_call(ctx, gate_report, lineage).args)
