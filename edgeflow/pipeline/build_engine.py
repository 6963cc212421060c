"""Build-engine stage: compile each checkpoint with the configured backend (CPU engine by default).

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from edgeflow.pipeline.stages import Call, enter_stage
from edgeflow.tracking.artifacts import ArtifactRef, sha256_json, write_manifest
from edgeflow.profile import EngineConfig
from edgeflow.tracking.runs import ReleaseContext, content_key, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def build_one(checkpoint: ArtifactRef, engine: EngineConfig, name: str, ctx: ReleaseContext, builder: str) -> ArtifactRef:
    """Build one engine from one checkpoint and record its metadata."""
    from edgeflow.engines import get_backend
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    key = sha256_json({"ckpt": checkpoint.sha256, "engine": engine.model_dump()})[:16]
    out = profile.work / "artifacts" / "engines" / f"{name}-{engine.backend}-{key}"
    with stage_run(ctx, run_name(name), {"backend": engine.backend, **engine.profile}) as (client, run_id):
        meta = get_backend(engine.backend).build(materialize(checkpoint), out, engine.profile)
        write_manifest(out)
        client.log_dict(run_id, meta, "engine.json")
        return publish(client, run_id, out, "engine", "engine",
                       meta={"variant": name, "backend": engine.backend, "checkpoint_sha256": checkpoint.sha256})


def run_name(name: str) -> str:
    return f"build-engine-{name}"


def engine_calls(ctx: ReleaseContext, checkpoints: list[ArtifactRef]) -> list[Call]:
    """One build per checkpoint, as the stage makes them. The builder's identity is part of the cache key: an engine
    cached by an older edgeflow or runtime (which this machine would refuse to load) is rebuilt, not reused."""
    from edgeflow.engines import get_backend

    p = ctx.resolved()
    builder = get_backend(p.engine.backend).build_identity()
    return [Call(build_one, (c, p.engine, c.meta.get("variant", "fp32"), ctx, builder), run_name(c.meta.get("variant", "fp32")))
            for c in checkpoints]


@flow(name="build-engine", log_prints=True)
def build_engine(ctx: ReleaseContext, checkpoints: list[ArtifactRef]) -> list[ArtifactRef]:
    """Checkpoints in (the FP student first, then each variant), engines out, built on this stage's host."""
    enter_stage(ctx, "build_engine")
    return [call.run() for call in engine_calls(ctx, checkpoints)]
