"""Distill stage: frozen teacher -> layer-dropped student.

Tiny CPU run (with services up): python -m flows.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from tasks.artifacts import ArtifactRef, sha256_json, sha256_tree
from tasks.config import DistillConfig, load_profile
from tasks.model_source import ensure_teacher
from tasks.runs import ReleaseContext, content_key, stage_run


@task
def resolve_teacher(profile: str) -> ArtifactRef:
    """Resolve the teacher into a plain safetensors checkpoint (converted once, then found by hash)."""
    return ensure_teacher(load_profile(profile))


@task(cache_key_fn=content_key, persist_result=True)
def train_student(teacher: ArtifactRef, cfg: DistillConfig, eval_sources: dict[str, str], ctx: ReleaseContext) -> ArtifactRef:
    """Train the student with α·KL·T² + (1−α)·CE and log curves, metrics and weights to MLflow."""
    from tasks.distill import run_distill
    from tasks.evaluation.gate import eval_texts

    from transformers import AutoTokenizer

    profile = load_profile(ctx.profile)
    out = profile.work / "artifacts" / "student" / f"{teacher.sha256[:12]}-{sha256_json(cfg.model_dump())[:12]}"
    tok = AutoTokenizer.from_pretrained(teacher.uri)
    held_out = eval_texts({k: profile.resolve(v) for k, v in eval_sources.items()}, 24, tok)
    with stage_run(ctx, "distill", cfg.model_dump() | {"teacher_sha256": teacher.sha256}) as (client, run_id):
        metrics = run_distill(
            teacher.path, cfg, [profile.resolve(c) for c in cfg.corpora], held_out, out,
            log=lambda step, m: [client.log_metric(run_id, k, v, step=step) for k, v in m.items() if k != "step"],
        )
        history = metrics.pop("history")
        for k, v in metrics.items():
            client.log_metric(run_id, f"final_{k}" if k in ("lr",) else k, float(v))
        client.log_dict(run_id, {"history": history}, "distill_history.json")
        client.log_artifacts(run_id, str(out), "student")
        return ArtifactRef(kind="student", uri=str(out), sha256=sha256_tree(out), mlflow_run_id=run_id, meta=metrics | {"teacher": teacher.model_dump()})


@flow(name="distill", log_prints=True)
def distill(profile: str, ctx: ReleaseContext) -> ArtifactRef:
    """Teacher in, trained student out."""
    p = load_profile(profile)
    teacher = resolve_teacher(profile)
    return train_student(teacher, p.distill, p.gate.eval_sources, ctx)
