"""Gate-reference stage: the FP student's side of the consistency gate, where torch runs; stored for the device.

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml

Checks that calibration and evaluation are disjoint, then runs the FP student (and each quantized variant's
fake-quantized twin) over the eval sequences and publishes what the engine side needs
(edgeflow/evaluation/reference.py). The consistency stage then scores the built engines against it on the
host that built them.
"""
from __future__ import annotations

from prefect import flow, task

from edgeflow.pipeline.stages import Call, StageCalls, enter_stage
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.profile import GateConfig
from edgeflow.tracking.runs import ReleaseContext, content_key, stage_run

# What of the gate config the reference depends on (the thresholds are the engine half's).
# (The eval files' content comes as eval_sets references; their paths are not part of what it computes.)
REFERENCE_FIELDS = ("num_prompts", "max_tokens", "greedy_prompts", "greedy_tokens", "reference_top_k")
# The prompt whose generation the gate times on every engine (decode tok/s, TTFT).
SPEED_QUESTION = "Explain in a few sentences why the sky is blue."


@task(cache_key_fn=content_key, persist_result=True)
def fp_reference(
    student: ArtifactRef, calibration: ArtifactRef, checkpoints: list[ArtifactRef], eval_sets: dict[str, ArtifactRef],
    settings: dict, ctx: ReleaseContext, attempt: int = 0,
) -> ArtifactRef:
    """Leakage check, then the FP student's top-k log-probabilities, next-token log-probabilities and greedy
    continuations, and each quantized checkpoint's fake-quantized argmax and layer error, as one artifact.

    settings: the gate fields this half reads (REFERENCE_FIELDS), so a changed threshold does not recompute it.
    """
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from edgeflow.calibration.mix import check_no_leakage
    from edgeflow.evaluation.gate import eval_texts, greedy_prompts, tokenize
    from edgeflow.engines.engine_dir import stop_ids
    from edgeflow.evaluation.reference import compute_reference, save_reference
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    gate = GateConfig.model_validate(settings)
    student_dir = materialize(student)
    tok = AutoTokenizer.from_pretrained(student_dir)
    texts = eval_texts({d: materialize(r) for d, r in eval_sets.items()}, gate.num_prompts, tok)
    check_no_leakage(pq.read_table(materialize(calibration), columns=["text"]).column("text").to_pylist(), texts)
    seqs = tokenize(texts, tok, gate.max_tokens)
    speed_text = tok.apply_chat_template([{"role": "user", "content": SPEED_QUESTION}], add_generation_prompt=True, tokenize=False)
    quantized = {c.meta["variant"]: materialize(c) for c in checkpoints if c.kind == "quantized"}
    stage = run_name(attempt)
    with stage_run(ctx, stage, {"num_prompts": gate.num_prompts, "max_tokens": gate.max_tokens,
                                "reference_top_k": gate.reference_top_k, "student_sha256": student.sha256}) as (client, run_id):
        ref = compute_reference(
            student_dir, quantized, seqs, greedy_prompts(seqs, gate.greedy_prompts), gate.greedy_tokens, gate.reference_top_k,
            tok(speed_text, add_special_tokens=False)["input_ids"], stop_ids(student_dir),
            meta={"calibration": {"sha256": calibration.sha256, "total": calibration.meta.get("total")},
                  "student_sha256": student.sha256},
        )
        out = save_reference(ref, profile.work / "releases" / ctx.release_id / f"gate-reference-attempt{attempt}")
        client.log_metric(run_id, "tail_mass_mean", ref.meta["tail_mass_mean"])
        return publish(client, run_id, out, "gate-reference", "gate-reference",
                       meta={k: ref.meta[k] for k in ("top_k", "tail_mass_mean", "eval_prompts", "eval_positions")})


def run_name(attempt: int) -> str:
    return "gate-reference" + (f"-attempt{attempt}" if attempt else "")


@flow(name="gate-reference", log_prints=True)
def gate_reference(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, checkpoints: list[ArtifactRef],
                   attempt: int = 0) -> ArtifactRef:
    """FP student and checkpoints in, the gate's stored reference out."""
    enter_stage(ctx, "gate_reference")
    return reference_call(ctx, student, calibration, checkpoints, attempt).run()


def stage_calls(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, checkpoints: list[ArtifactRef],
                attempt: int = 0) -> StageCalls:
    """The stage's calls, for the release to look up before it submits the stage (edgeflow/pipeline/stages.py run_stage)."""
    return StageCalls([reference_call(ctx, student, calibration, checkpoints, attempt)], many=False)


def reference_call(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, checkpoints: list[ArtifactRef],
                   attempt: int = 0) -> Call:
    """The FP reference as the stage computes it: the published eval sets and the gate settings it reads."""
    p = ctx.resolved()
    eval_sets = {d: ctx.input(path) for d, path in p.gate.eval_sources.items()}
    settings = p.gate.model_dump(include=set(REFERENCE_FIELDS))
    return Call(fp_reference, (student, calibration, checkpoints, eval_sets, settings, ctx, attempt), run_name(attempt))
