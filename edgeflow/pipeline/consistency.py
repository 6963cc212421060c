"""Consistency stage, engine side: every variant's built engine, on the host that built it, against the stored FP reference.

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml

The FP student's side ran in the gate-reference stage (edgeflow/pipeline/gate_reference.py), where torch runs; this
stage needs the engines' runtime only, so it runs on the pool that built them (the Orin for TensorRT-LLM).
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, task

from edgeflow.pipeline.stages import Call, StageCalls, enter_stage
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.profile import GateConfig
from edgeflow.profile.slo import SLOConfig
from edgeflow.tracking.runs import ReleaseContext, content_key, log_values, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def gate_variants(
    reference: ArtifactRef,
    checkpoints: list[ArtifactRef],
    engines: list[ArtifactRef],
    gate: GateConfig,
    backend: str,
    ctx: ReleaseContext,
    attempt: int = 0,
    slo: SLOConfig | None = None,
    pool: str = "inline",
) -> ArtifactRef:
    """Score each engine against the reference and measure it against the service objectives this host stands for
    (`pool`: where this stage runs), and write the gate report (with its plots)."""
    from edgeflow.evaluation import plots
    from edgeflow.evaluation.gate import run_gate
    from edgeflow.evaluation.report import GateReport
    from edgeflow.evaluation.reference import load_reference
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    ref = load_reference(materialize(reference))
    variants = []
    for c, e in zip(checkpoints, engines, strict=True):
        engine_dir = materialize(e)
        # the FP student carries no size: the build on this host fetched it already, so this is a cache hit
        size = c.meta.get("size_mb") or sum(f.stat().st_size for f in materialize(c).rglob("*.safetensors")) / 2**20
        variants.append({"name": c.meta.get("variant", "fp32"), "engine_dir": str(engine_dir), "size_mb": size,
                         "quantized": c.kind == "quantized", "checkpoint": c, "engine": e})
    stage = run_name(attempt)
    params = gate.model_dump() | {"backend": backend, "reference_sha256": reference.sha256, "pool": pool}
    with stage_run(ctx, stage, params) as (client, run_id):
        rows, dists = run_gate(ref, variants, gate, backend, slo.targets if slo else None, pool)
        add_roofline(profile, rows, variants)
        for v, row in zip(variants, rows):
            row["checkpoint"] = v["checkpoint"].model_dump()
            row["engine"] = v["engine"].model_dump()
            row["engine_precision"] = engine_precision(v["engine_dir"])
            row["layer_error"] = dists["layer_error"].get(row["name"])
        figures = {}
        for row in rows:
            for k in ("top1_agreement", "top1_agreement_last", "kl", "kl_p99", "ppl", "greedy_exact_match",
                      "decode_tok_s", "ttft_ms", "engine_parity"):
                if row["metrics"][k] is not None:
                    figures[f"{row['name']}.{k}"] = row["metrics"][k]
            figures[f"{row['name']}.decode_tok_s_greedy"] = row["decode_tok_s_greedy"]
            for t in row["slo"] or []:  # e.g. gptq-w4a16.slo.x86-cpu.ttft_p99_ms
                figures |= {f"{row['name']}.slo.{t['device']}.{k}": v for k, v in (t.get("measured") or {}).items()
                            if isinstance(v, (int, float))}
        log_values(client, run_id, metrics=figures)
        plot_dir = profile.work / "releases" / ctx.release_id / f"plots-attempt{attempt}"
        plot_dir.mkdir(parents=True, exist_ok=True)
        quantized = {v["name"] for v in variants if v["quantized"]}
        figures = [
            plots.layer_error_plot(dists["layer_error"], plot_dir / "layer_error.png"),
            plots.agreement_histogram({n: a for n, a in dists["seq_agreement"].items() if n in quantized},
                                      gate.min_top1_agreement, plot_dir / "agreement_histogram.png"),
            plots.kl_distribution({n: k for n, k in dists["kl"].items() if n in quantized}, gate.max_mean_kl,
                                  plot_dir / "kl_distribution.png"),
        ]
        report = {
            "thresholds": gate.model_dump(exclude={"eval_sources"}),
            "eval_prompts": ref.meta["eval_prompts"],
            "eval_positions": ref.meta["eval_positions"],
            "reference": {"sha256": reference.sha256, "uri": reference.uri, "top_k": ref.meta["top_k"],
                          "tail_mass_mean": ref.meta["tail_mass_mean"]},
            "backend": backend,
            "attempt": attempt,
            "calibration": ref.meta["calibration"],
            "rows": rows,
            "plots": {f.stem: publish(client, run_id, f, "plots", "plot").model_dump() for f in figures},
        }
        GateReport.model_validate(report)  # the shape every reader parses (edgeflow/evaluation/report.py); fail here, not there
        out = profile.work / "releases" / ctx.release_id / f"gate-attempt{attempt}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        return publish(client, run_id, out, "gate", "gate-report")


def add_roofline(profile, rows: list[dict], variants: list[dict]) -> None:
    """Each measured slo target of each row gets `roofline`: the measured decode and TTFT as fractions of the host's
    limits (edgeflow/estimate/variants.py roofline_fractions), from the FP student's config.json (the variants share it)."""
    from edgeflow.engines.checkpoint import read_config
    from edgeflow.estimate.variants import roofline_fractions
    from edgeflow.model.architecture import describe
    from edgeflow.tracking.store import materialize

    measured = [(row, t) for row in rows for t in row.get("slo") or [] if t.get("measured")]
    if not measured:
        return
    fp = next(v for v in variants if not v["quantized"])
    try:
        student = describe(read_config(materialize(fp["checkpoint"])), "the student's config.json")
    except ValueError as e:
        student = str(e)
    for row, t in measured:
        t["roofline"] = {"not_estimated": student} if isinstance(student, str) else \
            roofline_fractions(profile, student, row["name"], t)


def engine_precision(engine_dir) -> str:
    """What the engine computes with, from its engine.json (e.g. 'int4', 'fp32 (dequantized)')."""
    from edgeflow.engines.engine_dir import read_meta

    return read_meta(Path(engine_dir)).label


def run_name(attempt: int) -> str:
    return "consistency" + (f"-attempt{attempt}" if attempt else "")


@flow(name="consistency", log_prints=True)
def consistency(
    ctx: ReleaseContext, reference: ArtifactRef, checkpoints: list[ArtifactRef], engines: list[ArtifactRef], attempt: int = 0,
) -> ArtifactRef:
    """Stored reference and engines in, gate report out (on the host whose pool the engines were built for)."""
    enter_stage(ctx, "consistency")
    return gate_call(ctx, reference, checkpoints, engines, attempt).run()


def stage_calls(ctx: ReleaseContext, reference: ArtifactRef, checkpoints: list[ArtifactRef], engines: list[ArtifactRef],
                attempt: int = 0) -> StageCalls:
    """The stage's calls, for the release to look up before it submits the stage (edgeflow/pipeline/stages.py run_stage)."""
    return StageCalls([gate_call(ctx, reference, checkpoints, engines, attempt)], many=False)


def gate_call(ctx: ReleaseContext, reference: ArtifactRef, checkpoints: list[ArtifactRef], engines: list[ArtifactRef],
              attempt: int = 0) -> Call:
    """The gate as the stage runs it: reference, checkpoints and engines, with the gate settings and the backend."""
    p = ctx.resolved()
    return Call(gate_variants, (reference, checkpoints, engines, p.gate, p.engine.backend, ctx, attempt, p.slo,
                                p.placement.consistency), run_name(attempt))
