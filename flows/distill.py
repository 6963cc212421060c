"""Distill stage: frozen teacher -> student (layer-dropped, or from distill.student_from).

Tiny CPU run (with services up): python -m flows.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from tasks.artifacts import ArtifactRef, sha256_json, sha256_tree
from tasks.config import DistillConfig, load_profile
from tasks.model_source import ensure_teacher
from tasks.runs import ReleaseContext, content_key, log_training_set, mlflow_step_logger, stage_run


@task
def resolve_teacher(profile: str) -> ArtifactRef:
    """Resolve the teacher into a plain safetensors checkpoint (converted once, then found by hash)."""
    return ensure_teacher(load_profile(profile))


def student_source(profile: str) -> ArtifactRef | None:
    """distill.student_from as a hashed reference (so the stage's cache key follows its content), or None."""
    p = load_profile(profile)
    if p.distill.student_from is None:
        return None
    path = p.resolve(p.distill.student_from)
    if not path.is_dir():
        raise FileNotFoundError(
            f"distill.student_from={p.distill.student_from} is not a directory ({path}); point it at a saved model or config "
            "directory (paths are relative to the repository root)"
        )
    return ArtifactRef(kind="student-source", uri=str(path), sha256=sha256_tree(path))


@task
def resolve_student_source(profile: str) -> ArtifactRef | None:
    """Hash distill.student_from when the profile sets it."""
    return student_source(profile)


@task(cache_key_fn=content_key, persist_result=True)
def train_student(teacher: ArtifactRef, cfg: DistillConfig, eval_sources: dict[str, str], ctx: ReleaseContext,
                  student_from: ArtifactRef | None = None) -> ArtifactRef:
    """Train the student with α·KL·T² + (1−α)·CE (+ β·hidden MSE) and log curves, metrics and weights to MLflow."""
    from tasks.distill_launch import distill_runner
    from tasks.evaluation.gate import eval_texts

    from transformers import AutoTokenizer

    profile = load_profile(ctx.profile)
    identity = [teacher.sha256, sha256_json(cfg.model_dump())] + ([student_from.sha256] if student_from else [])
    out = profile.work / "artifacts" / "student" / f"{teacher.sha256[:12]}-{sha256_json(identity)[:12]}"
    tok = AutoTokenizer.from_pretrained(teacher.uri)
    held_out = eval_texts({k: profile.resolve(v) for k, v in eval_sources.items()}, 24, tok)
    params = cfg.model_dump() | {"teacher_sha256": teacher.sha256} | ({"student_from_sha256": student_from.sha256} if student_from else {})
    with stage_run(ctx, "distill", params) as (client, run_id):
        log_training_set(client, run_id, [profile.resolve(c) for c in cfg.corpora])
        metrics = distill_runner(cfg)(  # in this process, or torchrun over distill.processes GPUs
            teacher.path, cfg, [profile.resolve(c) for c in cfg.corpora], held_out, out, profile.work,
            student_from=student_from.path if student_from else None, log=mlflow_step_logger(client, run_id),
        )
        history = metrics.pop("history")
        for k, v in metrics.items():
            client.log_metric(run_id, k, float(v))
        client.log_dict(run_id, {"history": history}, "distill_history.json")
        client.log_artifacts(run_id, str(out), "student")
        return ArtifactRef(kind="student", uri=str(out), sha256=sha256_tree(out), mlflow_run_id=run_id,
                           meta=metrics | {"teacher": teacher.model_dump()})


@flow(name="distill", log_prints=True)
def distill(profile: str, ctx: ReleaseContext) -> ArtifactRef:
    """Teacher in, trained student out."""
    p = load_profile(profile)
    teacher = resolve_teacher(profile)
    return train_student(teacher, p.distill, p.gate.eval_sources, ctx, resolve_student_source(profile))
