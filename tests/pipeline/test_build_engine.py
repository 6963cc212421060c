"""The build stage's cache key carries the builder's identity, so a cached engine this machine would
refuse (older engine format, other kernel source or runtime) is rebuilt instead of reused."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import edgeflow.pipeline.build_engine as stage
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.tracking.codeversion import code_identity
from edgeflow.preflight import load_profile
from edgeflow.engines import cpu_native
from edgeflow.tracking.runs import ReleaseContext, content_key

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs" / "test-tiny.yaml"


def _ctx() -> ReleaseContext:
    return ReleaseContext(release_id="r1", profile=str(PROFILE), mlflow_parent_run_id="0" * 32,
                          settings=load_profile(PROFILE).settings(), code=code_identity())


def test_build_engine_passes_the_backends_build_identity() -> None:
    """The stage's calls (edgeflow/pipeline/build_engine.py engine_calls, what it runs and `edgeflow plan` keys): one per checkpoint,
    named by its variant, with the backend's build identity in the key."""
    ckpts = [ArtifactRef(kind="student", uri="mlflow-artifacts:/x", sha256="a" * 64),
             ArtifactRef(kind="quantized", uri="mlflow-artifacts:/y", sha256="b" * 64, meta={"variant": "awq"})]
    calls = stage.engine_calls(_ctx(), ckpts)
    assert load_profile(PROFILE).engine.backend == "cpu_native"
    assert [(c.task, c.args[2], c.args[4]) for c in calls] == [(stage.build_one, "fp32", cpu_native.build_identity()),
                                                               (stage.build_one, "awq", cpu_native.build_identity())]
    assert [c.run_name for c in calls] == ["build-engine-fp32", "build-engine-awq"]
    assert calls[0].key() != calls[1].key() and calls[0].key().startswith("build_one-v2-")


def test_a_new_kernel_or_format_changes_the_cache_key(monkeypatch) -> None:
    task_ctx = SimpleNamespace(task=SimpleNamespace(name="build_one"))
    params = {"checkpoint": ArtifactRef(kind="quantized", uri="/y", sha256="b" * 64), "engine": load_profile(PROFILE).engine,
              "name": "awq", "ctx": _ctx()}
    before = cpu_native.build_identity()
    key = content_key(task_ctx, {**params, "builder": before})
    assert content_key(task_ctx, {**params, "builder": before, "ctx": _ctx().model_copy(update={"release_id": "r2"})}) == key
    monkeypatch.setattr(cpu_native.builder, "kernel_sha256", lambda: "f" * 64)
    assert cpu_native.build_identity() != before
    assert content_key(task_ctx, {**params, "builder": cpu_native.build_identity()}) != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu_native.builder, "FORMAT_VERSION", cpu_native.FORMAT_VERSION + 1)
    assert cpu_native.build_identity() != before
