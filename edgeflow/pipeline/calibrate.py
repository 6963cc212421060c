"""Calibrate stage: a domain-mixed calibration set (chat : wiki : math = 5:3:2 by default) as Parquet.

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from prefect import flow, task

from edgeflow.pipeline.stages import Call, StageCalls, enter_stage
from edgeflow.tracking.artifacts import ArtifactRef, sha256_json
from edgeflow.profile import CalibrationConfig
from edgeflow.tracking.runs import ReleaseContext, content_key, log_values, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def build_calibration(
    student: ArtifactRef, cfg: CalibrationConfig, sources: dict[str, ArtifactRef], eval_sets: dict[str, ArtifactRef],
    eval_prompts: int, ctx: ReleaseContext, attempt: int = 0,
) -> ArtifactRef:
    """Sample the sources by ratio, truncate, check it is disjoint from the eval set, and log it as a dataset input."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag
    from transformers import AutoTokenizer

    from edgeflow.calibration.mix import build_calibration_set, check_no_leakage
    from edgeflow.evaluation.gate import eval_texts
    from edgeflow.tracking.store import materialize, publish, source_url

    profile = ctx.resolved()
    key = sha256_json({"cfg": cfg.model_dump(), "sources": {d: r.sha256 for d, r in sources.items()}})[:16]
    out = profile.work / "artifacts" / "calibration" / key / "calibration.parquet"
    tok = AutoTokenizer.from_pretrained(materialize(student))
    with stage_run(ctx, run_name(attempt), cfg.model_dump()) as (client, run_id):
        stats = build_calibration_set(
            {d: materialize(r) for d, r in sources.items()}, cfg.ratios, cfg.total, cfg.max_tokens, cfg.seed, tok, out
        )
        df = pd.read_parquet(out, columns=["domain", "text", "n_tokens"])
        # Fail here, before hours of quantization, if calibration and evaluation overlap (the gate re-checks).
        check_no_leakage(df["text"].tolist(), eval_texts({d: materialize(r) for d, r in eval_sets.items()}, eval_prompts, tok))
        ref = publish(client, run_id, out, "calibration", "calibration", meta=stats)
        ds = mlflow.data.from_pandas(df, source=source_url(ref.uri), name=f"calibration-{ref.sha256[:12]}")
        client.log_inputs(run_id, datasets=[DatasetInput(ds._to_mlflow_entity(), [InputTag("mlflow.data.context", "calibration")])])
        client.log_dict(run_id, stats, "calibration_stats.json")
        log_values(client, run_id, metrics={f"count_{d}": n for d, n in stats["counts"].items()})
        return ref


def run_name(attempt: int) -> str:
    return "calibrate" + (f"-attempt{attempt}" if attempt else "")


def calibration_call(ctx: ReleaseContext, student: ArtifactRef, attempt: int = 0) -> Call:
    """The calibration set as the stage builds it: the attempt's settings, the published sources and eval sets."""
    p = ctx.resolved()
    sources = {d: ctx.input(path) for d, path in p.calibration.sources.items()}
    eval_sets = {d: ctx.input(path) for d, path in p.gate.eval_sources.items()}
    return Call(build_calibration, (student, p.calibration.for_attempt(attempt), sources, eval_sets, p.gate.num_prompts,
                                    ctx, attempt), run_name(attempt))


def stage_calls(ctx: ReleaseContext, student: ArtifactRef, attempt: int = 0) -> StageCalls:
    """The stage's calls, for the release to look up before it submits the stage (edgeflow/pipeline/stages.py run_stage)."""
    return StageCalls([calibration_call(ctx, student, attempt)], many=False)


@flow(name="calibrate", log_prints=True)
def calibrate(ctx: ReleaseContext, student: ArtifactRef, attempt: int = 0) -> ArtifactRef:
    """Published sources in, calibration Parquet out (attempt > 0: a larger recalibration set)."""
    enter_stage(ctx, "calibrate")
    return calibration_call(ctx, student, attempt).run()
