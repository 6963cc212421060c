"""Quantize stage: one llm-compressor recipe per variant (AWQ / GPTQ W4A16 …) over the calibration set.

Tiny CPU run (with services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prefect import flow, task

from edgeflow.pipeline.stages import Call, StageCalls, enter_stage, refreshed_if_missing
from edgeflow.tracking.artifacts import ArtifactRef, sha256_json
from edgeflow.profile import VariantConfig
from edgeflow.tracking.runs import ReleaseContext, content_key, stage_run


# log_prints off: `datasets` fingerprints the calibration set with dill, which disassembles functions and reads the
# listing back from a captured stdout; the flow's log_prints turned every listing line into a log record instead.
@task(cache_key_fn=content_key, persist_result=True, log_prints=False)
def quantize_variant(
    student: ArtifactRef, calibration: ArtifactRef, variant: VariantConfig, recipe: dict, ctx: ReleaseContext,
    attempt: int = 0, slot: int = 0,
) -> ArtifactRef:
    """Run llm-compressor oneshot with the variant's recipe and log the compressed checkpoint."""
    import pyarrow.parquet as pq

    from edgeflow.quantize.run import quantize
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    key = sha256_json({"student": student.sha256, "calib": calibration.sha256, "recipe": recipe, "v": variant.model_dump()})[:16]
    out = profile.work / "artifacts" / "quantized" / f"{variant.name}-{key}"
    ids = pq.read_table(materialize(calibration), columns=["input_ids"]).column("input_ids").to_pylist()
    if variant.calibration_samples:
        ids = ids[: variant.calibration_samples]
    with stage_run(ctx, run_name(variant, attempt), variant.model_dump() | {"calibration_sha256": calibration.sha256}) as (client, run_id):
        info = quantize(materialize(student), recipe, ids, out, slot)
        client.log_dict(run_id, info["weight_error"], "weight_error.json")
        client.log_dict(run_id, recipe, "recipe.yaml")
        client.log_metric(run_id, "size_mb", info["size_mb"])
        return publish(client, run_id, out, "quantized", "quantized",
                       meta={"variant": variant.name, "recipe": variant.recipe, "recipe_sha256": sha256_json(recipe), **info})


@task(cache_key_fn=content_key, persist_result=True)
def adopt_variant(student: ArtifactRef, checkpoint: ArtifactRef, variant: VariantConfig, ctx: ReleaseContext,
                  attempt: int = 0) -> ArtifactRef:
    """A variant quantized elsewhere (variant.prequantized): checked against the student, imported bit-exactly, logged
    like a quantized checkpoint."""
    from edgeflow.quantize.run import adopt
    from edgeflow.tracking.store import materialize, publish

    profile = ctx.resolved()
    key = sha256_json({"student": student.sha256, "checkpoint": checkpoint.sha256, "v": variant.model_dump()})[:16]
    out = profile.work / "artifacts" / "quantized" / f"{variant.name}-{key}"
    with stage_run(ctx, run_name(variant, attempt), variant.model_dump() | {"checkpoint_sha256": checkpoint.sha256}) as (client, run_id):
        info = adopt(materialize(student), materialize(checkpoint), out)
        client.log_dict(run_id, info["weight_error"], "weight_error.json")
        client.log_metric(run_id, "size_mb", info["size_mb"])
        return publish(client, run_id, out, "quantized", "quantized",
                       meta={"variant": variant.name, "recipe": f"prequantized:{variant.prequantized}", **info})


def run_name(variant: VariantConfig, attempt: int) -> str:
    return f"quantize-{variant.name}" + (f"-attempt{attempt}" if attempt else "")


def variant_calls(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, attempt: int = 0,
                  open_input: Callable[[ArtifactRef], Path] | None = None, refused: list[str] | None = None) -> list[Call]:
    """One call per variant of this attempt, as the stage makes them: a variant quantized elsewhere is adopted, the
    others quantized with their recipe (read through `open_input`, the store by default) in slots of max_parallel.
    `refused`: variants the release will not build (no engine could serve them within slo: edgeflow/pipeline/chain.py)."""
    from edgeflow.quantize.recipe import load_recipe
    from edgeflow.tracking.store import materialize

    p = ctx.resolved()
    variants = [
        # a recalibration attempt also scales a variant's own sample cap (e.g. AWQ's 16 on the CPU demo)
        v.model_copy(update={"calibration_samples": v.calibration_samples * 2**attempt}) if v.calibration_samples else v
        # attempt k also tries the k first less aggressive fallbacks (mixed W8/W4, then W8A16, …)
        for v in p.quantize.variants + p.quantize.fallback_variants[:attempt]
        if v.name not in (refused or ())
    ]
    read = open_input or materialize
    calls, slot = [], 0
    for v in variants:  # in the profile's order, the order of the checkpoints the stage hands on
        if v.prequantized is not None:
            calls.append(Call(adopt_variant, (student, ctx.input(v.prequantized), v, ctx, attempt), run_name(v, attempt)))
            continue
        recipe = load_recipe(read(ctx.input(v.recipe)), p.quantize.recipe_overrides)
        calls.append(Call(quantize_variant, (student, calibration, v, recipe, ctx, attempt, slot % p.quantize.max_parallel),
                          run_name(v, attempt)))
        slot += 1
    return calls


def stage_calls(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, attempt: int = 0,
                refused: list[str] | None = None) -> StageCalls:
    """The stage's calls, for the release to look up before it submits the stage (edgeflow/pipeline/stages.py run_stage): one
    per variant, in the profile's order, which is the order of the checkpoints the stage returns."""
    return StageCalls(variant_calls(ctx, student, calibration, attempt, refused=refused), many=True)


@flow(name="quantize", log_prints=True)
def quantize(ctx: ReleaseContext, student: ArtifactRef, calibration: ArtifactRef, attempt: int = 0,
             refused: list[str] | None = None) -> list[ArtifactRef]:
    """Student and calibration set in, one compressed checkpoint per variant out (less the `refused` ones)."""
    enter_stage(ctx, "quantize")
    p = ctx.resolved()
    calls = variant_calls(ctx, student, calibration, attempt, refused=refused)
    # quantized elsewhere: checked and imported, no oneshot (a cached result whose checkpoint the store lost is adopted again)
    refs = [c.run() for c in calls if c.task is adopt_variant]
    quantizing = [c for c in calls if c.task is quantize_variant]
    # Variants are mapped tasks: a GPU worker runs max_parallel of them at once, one GPU each. The
    # CPU profiles keep max_parallel at 1 because parallel variants would only share the same cores.
    for start in range(0, len(quantizing), p.quantize.max_parallel):
        batch = quantizing[start:start + p.quantize.max_parallel]
        if p.quantize.max_parallel == 1:
            # One at a time: in this thread, not in the task runner's. Inline stages share one process, and after
            # distill has trained here, oneshot in a new thread ran a third slower than in this one (gptq-w4a16 on 64
            # sequences: 130 s against 99 s, benchmarks/quantize_time.py --train-steps 8 [--thread]; in the demo
            # 96-107 s, against 60-70 s alone). BENCHMARKS.md#quantize-in-thread.
            done = [quantize_variant(*batch[0].args)]
        else:  # each parameter as a list, one value per variant of the batch
            done = quantize_variant.map(*[list(column) for column in zip(*(c.args for c in batch))]).result()
        # a cached result whose checkpoint the store lost is quantized again
        refs += [refreshed_if_missing(ref, c.task, *c.args) for ref, c in zip(done, batch)]
    order = [v.name for v in p.quantize.variants + p.quantize.fallback_variants[:attempt]]
    return sorted(refs, key=lambda r: order.index(r.meta["variant"]))
