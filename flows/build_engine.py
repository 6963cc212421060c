"""Build-engine stage: compile each checkpoint with the configured backend (CPU engine by default).

Tiny CPU run (with services up): python -m flows.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from tasks.artifacts import ArtifactRef, sha256_json, sha256_tree, write_manifest
from tasks.config import EngineConfig, load_profile
from tasks.runs import ReleaseContext, content_key, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def build_one(checkpoint: ArtifactRef, engine: EngineConfig, name: str, ctx: ReleaseContext, builder: str) -> ArtifactRef:
    """Build one engine from one checkpoint and record its metadata."""
    from tasks.engines import get_backend

    profile = load_profile(ctx.profile)
    key = sha256_json({"ckpt": checkpoint.sha256, "engine": engine.model_dump()})[:16]
    out = profile.work / "artifacts" / "engines" / f"{name}-{engine.backend}-{key}"
    with stage_run(ctx, f"build-engine-{name}", {"backend": engine.backend, **engine.profile}) as (client, run_id):
        meta = get_backend(engine.backend).build(checkpoint.path, out, engine.profile)
        write_manifest(out)
        client.log_dict(run_id, meta, "engine.json")
        client.log_artifacts(run_id, str(out), "engine")
        return ArtifactRef(
            kind="engine", uri=str(out), sha256=sha256_tree(out), mlflow_run_id=run_id,
            meta={"variant": name, "backend": engine.backend, "checkpoint_sha256": checkpoint.sha256},
        )


@flow(name="build-engine", log_prints=True)
def build_engine(profile: str, ctx: ReleaseContext, checkpoints: list[ArtifactRef]) -> list[ArtifactRef]:
    """Checkpoints in (the FP student first, then each variant), engines out."""
    from tasks.engines import get_backend

    p = load_profile(profile)
    # The builder's identity is part of the cache key: an engine cached by an older edgeflow or runtime
    # (which this machine would refuse to load) is rebuilt, not reused.
    builder = get_backend(p.engine.backend).build_identity()
    return [build_one(c, p.engine, c.meta.get("variant", "fp32"), ctx, builder) for c in checkpoints]
