"""Calibrate stage: a domain-mixed calibration set (chat : wiki : math = 5:3:2 by default) as Parquet.

Tiny CPU run (with services up): python -m flows.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from tasks.artifacts import ArtifactRef, sha256_file, sha256_json, sha256_tree
from tasks.config import CalibrationConfig, load_profile
from tasks.runs import ReleaseContext, content_key, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def build_calibration(
    student: ArtifactRef, cfg: CalibrationConfig, source_hashes: dict[str, str], ctx: ReleaseContext, attempt: int = 0,
    eval_hashes: dict[str, str] | None = None,
) -> ArtifactRef:
    """Sample the sources by ratio, truncate, check it is disjoint from the eval set, and log it as a dataset input."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag
    from transformers import AutoTokenizer

    from tasks.calibration import build_calibration_set, check_no_leakage
    from tasks.evaluation.gate import eval_texts

    profile = load_profile(ctx.profile)
    key = sha256_json({"cfg": cfg.model_dump(), "sources": source_hashes})[:16]
    out = profile.work / "artifacts" / "calibration" / key / "calibration.parquet"
    tok = AutoTokenizer.from_pretrained(student.uri)
    with stage_run(ctx, "calibrate" + (f"-attempt{attempt}" if attempt else ""), cfg.model_dump()) as (client, run_id):
        stats = build_calibration_set(
            {d: profile.resolve(p) for d, p in cfg.sources.items()}, cfg.ratios, cfg.total, cfg.max_tokens, cfg.seed, tok, out
        )
        sha = sha256_file(out)
        df = pd.read_parquet(out, columns=["domain", "text", "n_tokens"])
        # Fail here, before hours of quantization, if calibration and evaluation overlap (the gate re-checks).
        gate = profile.gate
        check_no_leakage(df["text"].tolist(), eval_texts({d: profile.resolve(p) for d, p in gate.eval_sources.items()}, gate.num_prompts, tok))
        ds = mlflow.data.from_pandas(df, source=str(out), name=f"calibration-{sha[:12]}")
        client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", "calibration")])])
        client.log_dict(run_id, stats, "calibration_stats.json")
        client.log_artifact(run_id, str(out), "calibration")
        for d, n in stats["counts"].items():
            client.log_metric(run_id, f"count_{d}", n)
        return ArtifactRef(kind="calibration", uri=str(out), sha256=sha, mlflow_run_id=run_id, meta=stats)


def _content_hash(path) -> str:
    """A source is a file, or a directory of access logs (hashed as a tree)."""
    return sha256_tree(path) if path.is_dir() else sha256_file(path)


@flow(name="calibrate", log_prints=True)
def calibrate(profile: str, ctx: ReleaseContext, student: ArtifactRef, attempt: int = 0) -> ArtifactRef:
    """Shipped sources in, calibration Parquet out (attempt > 0: a larger recalibration set)."""
    p = load_profile(profile)
    hashes = {d: _content_hash(p.resolve(path)) for d, path in p.calibration.sources.items()}
    eval_hashes = {d: sha256_file(p.resolve(path)) for d, path in p.gate.eval_sources.items()} | {"num_prompts": str(p.gate.num_prompts)}
    return build_calibration(student, p.calibration.for_attempt(attempt), hashes, ctx, attempt, eval_hashes)
