"""Consistency stage: every variant's built engine against the full-precision student.

Tiny CPU run (with services up): python -m flows.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import json

from prefect import flow, task

from tasks.artifacts import ArtifactRef, sha256_file
from tasks.config import GateConfig, load_profile
from tasks.runs import ReleaseContext, content_key, stage_run


@task(cache_key_fn=content_key, persist_result=True)
def gate_variants(
    student: ArtifactRef,
    calibration: ArtifactRef,
    checkpoints: list[ArtifactRef],
    engines: list[ArtifactRef],
    gate: GateConfig,
    backend: str,
    ctx: ReleaseContext,
    attempt: int = 0,
) -> ArtifactRef:
    """Check calibration/eval disjointness, then score each engine and write the gate report."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from tasks.calibration import check_no_leakage
    from tasks.evaluation import plots
    from tasks.evaluation.gate import eval_texts, greedy_prompts, run_gate, tokenize

    profile = load_profile(ctx.profile)
    tok = AutoTokenizer.from_pretrained(student.uri)
    texts = eval_texts({d: profile.resolve(p) for d, p in gate.eval_sources.items()}, gate.num_prompts, tok)
    check_no_leakage(pq.read_table(calibration.uri, columns=["text"]).column("text").to_pylist(), texts)
    seqs = tokenize(texts, tok, gate.max_tokens)
    speed_text = tok.apply_chat_template(
        [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}], add_generation_prompt=True, tokenize=False
    )
    speed_prompt = tok(speed_text, add_special_tokens=False)["input_ids"]
    prompts = greedy_prompts(seqs, gate.greedy_prompts)
    variants = [
        {
            "name": c.meta.get("variant", "fp32"),
            "engine_dir": e.uri,
            "checkpoint_dir": c.uri,
            "size_mb": c.meta.get("size_mb") or sum(f.stat().st_size for f in c.path.rglob("*.safetensors")) / 2**20,
            "quantized": c.kind == "quantized",
            "checkpoint": c,
            "engine": e,
        }
        for c, e in zip(checkpoints, engines, strict=True)
    ]
    stage = "consistency" + (f"-attempt{attempt}" if attempt else "")
    with stage_run(ctx, stage, gate.model_dump() | {"backend": backend}) as (client, run_id):
        rows, dists = run_gate(student.path, variants, seqs, gate, backend, speed_prompt, prompts, [tok.eos_token_id])
        for v, row in zip(variants, rows):
            row["checkpoint"] = v["checkpoint"].model_dump()
            row["engine"] = v["engine"].model_dump()
            row["engine_precision"] = engine_precision(v["engine"].path)
            row["layer_error"] = dists["layer_error"].get(row["name"])
            for k in ("top1_agreement", "top1_agreement_last", "kl", "kl_p99", "ppl", "greedy_exact_match",
                      "decode_tok_s", "ttft_ms", "engine_parity"):
                if row["metrics"][k] is not None:
                    client.log_metric(run_id, f"{row['name']}.{k}", float(row["metrics"][k]))
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
        for f in figures:
            client.log_artifact(run_id, str(f), "plots")
        report = {
            "thresholds": gate.model_dump(exclude={"eval_sources"}),
            "eval_prompts": len(seqs),
            "eval_positions": sum(len(s) - 1 for s in seqs),
            "backend": backend,
            "attempt": attempt,
            "calibration": {"sha256": calibration.sha256, "total": calibration.meta.get("total")},
            "rows": rows,
            "plots": {f.stem: str(f) for f in figures},
        }
        out = profile.work / "releases" / ctx.release_id / f"gate-attempt{attempt}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        client.log_artifact(run_id, str(out), "gate")
        return ArtifactRef(kind="gate-report", uri=str(out), sha256=sha256_file(out), mlflow_run_id=run_id)


def engine_precision(engine_dir) -> str:
    """What the engine computes with, from its engine.json (e.g. 'int4', 'fp32 (dequantized)')."""
    meta = json.loads((engine_dir / "engine.json").read_text())
    return meta.get("precision", "?") + (" (dequantized)" if meta.get("dequantized") else "")


@flow(name="consistency", log_prints=True)
def consistency(
    profile: str, ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef,
    checkpoints: list[ArtifactRef], engines: list[ArtifactRef], attempt: int = 0,
) -> ArtifactRef:
    """Engines in, gate report out."""
    p = load_profile(profile)
    return gate_variants(student, calibration, checkpoints, engines, p.gate, p.engine.backend, ctx, attempt)
