"""Distill stage: frozen teacher -> student (layer-dropped, or from distill.student_from).

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from edgeflow.pipeline.stages import Call, enter_stage
from edgeflow.tracking.artifacts import ArtifactRef, sha256_json
from edgeflow.profile import DistillConfig
from edgeflow.model.source import ensure_teacher
from edgeflow.tracking.runs import ReleaseContext, content_key, log_training_set, log_values, mlflow_step_logger, stage_run


@task
def resolve_teacher(ctx: ReleaseContext) -> ArtifactRef:
    """Resolve the teacher into a plain safetensors checkpoint on this host (converted once, then found by hash)."""
    return ensure_teacher(ctx.resolved())


@task(cache_key_fn=content_key, persist_result=True)
def train_student(teacher: ArtifactRef, cfg: DistillConfig, corpora: list[ArtifactRef], held_out: dict[str, ArtifactRef],
                  ctx: ReleaseContext, student_from: ArtifactRef | None = None) -> ArtifactRef:
    """Train the student with α·KL·T² + (1−α)·CE (+ β·hidden MSE) and log curves, metrics and weights to MLflow.

    corpora and held_out are the training files and the gate's eval files as the release published them: their
    sha256 are part of this task's cache key, so editing one in place retrains, and nothing else does.
    """
    from transformers import AutoTokenizer

    from edgeflow.distill import seqkd, teacher_cache
    from edgeflow.distill.run import cache_spec, teacher_cache_root
    from edgeflow.distill.launch import distill_runner
    from edgeflow.evaluation.gate import eval_texts
    from edgeflow.engines.checkpoint import read_config
    from edgeflow.estimate.variants import CONFIG_META_KEY
    from edgeflow.tracking.lineage import TEACHER_META_KEY
    from edgeflow.model.source import teacher_dir
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    teacher_path = teacher_dir(profile)  # resolve_teacher hashed it moments ago, in this flow run, on this host
    identity = [teacher.sha256, sha256_json(cfg.model_dump())] + ([student_from.sha256] if student_from else [])
    out = profile.work / "artifacts" / "student" / f"{teacher.sha256[:12]}-{sha256_json(identity)[:12]}"
    tok = AutoTokenizer.from_pretrained(teacher_path)
    held_out_texts = eval_texts({k: materialize(v) for k, v in held_out.items()}, 24, tok)
    corpus_files = [materialize(c) for c in corpora]
    params = cfg.model_dump() | {"teacher_sha256": teacher.sha256, "teacher_uri": teacher.uri} | ({"student_from_sha256": student_from.sha256} if student_from else {})
    spec, cache_root = cache_spec(cfg, teacher.sha256), teacher_cache_root(profile.work)
    with stage_run(ctx, "distill", params) as (client, run_id):
        log_training_set(client, run_id, dict(zip(cfg.corpora, corpus_files)))
        if cfg.teacher_cache.enabled:  # what any host computed for this teacher before, fetched and checked by sha256
            client.log_metric(run_id, "teacher_cache_shards_fetched", teacher_cache.pull(client, spec, cache_root))
        if cfg.sequence_kd.enabled:  # the teacher's answers to the chat prompts: fetched, or generated here once
            answers, stats = seqkd.shared_answers(client, teacher_path, teacher.sha256, cfg.sequence_kd, corpus_files, cache_root,
                                                  profile.registry.artifact_location)
            log_values(client, run_id, metrics=stats)
            corpus_files = corpus_files + ([answers] if answers else [])
        metrics = distill_runner(cfg)(  # in this process, or torchrun over distill.processes GPUs
            teacher_path, cfg, corpus_files, held_out_texts, out, profile.work,
            student_from=materialize(student_from) if student_from else None, log=mlflow_step_logger(client, run_id),
            teacher_sha256=teacher.sha256,
        )
        if cfg.teacher_cache.enabled:  # what this run computed, for the next run on any host
            pushed = teacher_cache.push(client, spec, cache_root, profile.registry.artifact_location)
            client.log_metric(run_id, "teacher_cache_shards_pushed", len(pushed))
        history = metrics.pop("history")
        log_values(client, run_id, metrics=metrics)
        client.log_dict(run_id, {"history": history}, "distill_history.json")
        # the student's config.json rides along: the release estimates its variants from it before building any
        return publish(client, run_id, out, "student", "student", meta=metrics | {TEACHER_META_KEY: teacher.model_dump(),
                                                                              CONFIG_META_KEY: read_config(out)})


def train_call(ctx: ReleaseContext, teacher: ArtifactRef) -> Call:
    """The student's training as the stage calls it: the teacher, the distill settings and every file they read."""
    p = ctx.resolved()
    corpora = [ctx.input(c) for c in p.distill.corpora]
    held_out = {d: ctx.input(path) for d, path in p.gate.eval_sources.items()}
    student_from = ctx.input(p.distill.student_from) if p.distill.student_from else None
    return Call(train_student, (teacher, p.distill, corpora, held_out, ctx, student_from), "distill")


@flow(name="distill", log_prints=True)
def distill(ctx: ReleaseContext) -> ArtifactRef:
    """Teacher in, trained student out."""
    enter_stage(ctx, "distill")
    return train_call(ctx, resolve_teacher(ctx)).run()
