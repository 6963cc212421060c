"""What the release and the nightly recalibration share: open the release's MLflow run, calibrate → quantize →
build engines → gate reference → consistency gate with bounded recalibration, and deploy through the pool.

Tiny CPU run (services up, see README): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none

The data path only: the MLflow bookkeeping is edgeflow/tracking/runs.py's, the attempt summary edgeflow/tracking/report.py's.
"""
from __future__ import annotations

from prefect import task
from prefect.runtime import flow_run

from edgeflow.pipeline import calibrate as calibrate_stage
from edgeflow.pipeline import consistency as consistency_stage
from edgeflow.pipeline import gate_reference as gate_reference_stage
from edgeflow.pipeline import quantize as quantize_stage
from edgeflow.pipeline.build_engine import build_engine
from edgeflow.pipeline.stages import run_stage
from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.profile import Profile
from edgeflow.tracking.runs import ReleaseContext, open_release_run


@task
def open_release(profile: str, p: Profile) -> ReleaseContext:
    """Create (or, on a retry of the same flow run, reuse) the MLflow parent run of this release for `p`, the profile
    its entry point read from `profile` and preflighted (or derived from it: the nightly's), and publish every file it
    names to that run, so stages on other hosts read them from the store. Another release or nightly of the same
    model that is already running refuses this one first (edgeflow/pipeline/locks.py)."""
    from edgeflow.pipeline.locks import model_of, refuse_if_running

    refuse_if_running("release", ["release", "nightly-recalibration"], p.registry.model_name, model_of,
                      flow_run.get_id())
    return open_release_run(profile, p, flow_run.get_id())


@task
def run_deploy_on_pool(profile: str, alias: str) -> dict:
    """Deploy through the `deploy-edge` deployment, so it runs on the `orin` pool's worker."""
    from prefect.deployments import run_deployment

    from edgeflow.pipeline.stages import wait_until_final

    fr = wait_until_final(run_deployment("deploy-edge/deploy-edge", parameters={"profile": profile, "alias": alias},
                                         timeout=0).id)
    if not fr.state.is_completed():
        raise RuntimeError(f"deploy-edge flow run {fr.id} ended {fr.state.type.value}: {fr.state.message}")
    return fr.state.result()


class SLOUnreachable(RuntimeError):
    """Every variant of the profile misses a service objective even at the hardware's limit: nothing is built."""


def unservable_variants(ctx: ReleaseContext, student: ArtifactRef) -> dict[str, list[str]]:
    """{variant: why no engine could serve it within slo.targets}, from the student's config.json as the distill stage
    published it (edgeflow/estimate/variants.py unservable); {} for a student published without it or of a family the
    model description cannot count (the plan says so; the gate still measures every built variant)."""
    from edgeflow.estimate.variants import CONFIG_META_KEY, unservable
    from edgeflow.model.architecture import describe

    config = student.meta.get(CONFIG_META_KEY)
    if config is None or not ctx.resolved().slo.targets:
        return {}
    try:
        arch = describe(config, "the student's config.json")
    except ValueError:
        return {}
    return unservable(ctx.resolved(), arch)


@task
def summarize_attempt(gate_report: ArtifactRef) -> dict:
    """Did any quantized variant pass this attempt's gate, and how close did the best one come?"""
    from edgeflow.evaluation.report import load_gate_report
    from edgeflow.tracking.report import attempt_summary

    return attempt_summary(load_gate_report(gate_report))


def quantize_and_gate(ctx: ReleaseContext, student: ArtifactRef) -> tuple[ArtifactRef, ArtifactRef, list[dict]]:
    """calibrate → quantize → build engines → gate, recalibrating while no variant passes.

    Bounded recalibration: when no variant meets the bar, try again with a larger calibration set
    (each attempt's stages are their own MLflow runs), at most gate.recalibration_attempts times, and not at all when
    the FP student's own answers fail gate.student.min_answers_ok (a calibration set cannot fix the student) or when
    every quantized variant missed a service objective (nor make an engine faster).
    Returns the last attempt's gate report and calibration set, and every attempt's summary.
    Each stage runs where the profile's placement says (edgeflow/pipeline/stages.py).
    """
    attempts = []
    refused = unservable_variants(ctx, student)
    for name, why in refused.items():
        print(f"{name}: not built, no engine could serve it within slo (set slo.build_anyway to build it): {'; '.join(why)}")
    if refused and len(refused) == len(ctx.resolved().quantize.variants):
        raise SLOUnreachable("no variant can meet the service objectives on its target, whatever the engine (the roofline "
                             "estimate, edgeflow/estimate/): " + "; ".join(f"{n}: {', '.join(w)}" for n, w in refused.items())
                             + ". Relax slo.targets, choose a smaller student or fewer bits, or set slo.build_anyway")
    for attempt in range(ctx.resolved().gate.recalibration_attempts + 1):
        # `calls`: the stages the release can look up before submitting them; distill and build_engine key on what
        # their own host resolves (the teacher, the builder), so only their host can say whether they are cached.
        calibration = run_stage(ctx, "calibrate", calibrate_stage.calibrate, calls=calibrate_stage.stage_calls,
                                student=student, attempt=attempt)
        quantized = run_stage(ctx, "quantize", quantize_stage.quantize, calls=quantize_stage.stage_calls,
                              student=student, calibration=calibration, attempt=attempt, refused=sorted(refused))
        checkpoints = [student, *quantized]
        engines = run_stage(ctx, "build_engine", build_engine, checkpoints=checkpoints)
        reference = run_stage(ctx, "gate_reference", gate_reference_stage.gate_reference, calls=gate_reference_stage.stage_calls,
                              student=student, calibration=calibration, checkpoints=checkpoints, attempt=attempt)
        gate_report = run_stage(ctx, "consistency", consistency_stage.consistency, calls=consistency_stage.stage_calls,
                                reference=reference, checkpoints=checkpoints, engines=engines, attempt=attempt)
        attempts.append(summarize_attempt(gate_report) | {"refused_before_build": refused})
        if attempts[-1]["passed"]:
            break
        if attempts[-1]["slo_missed"] and len(attempts[-1]["slo_missed"]) == attempts[-1]["quantized"]:
            # a larger calibration set cannot make an engine faster or smaller
            print(f"attempt {attempt}: every quantized variant missed a service objective (slo); not recalibrating")
            break
        limit, fp_ok = ctx.resolved().gate.student.min_answers_ok, attempts[-1]["fp_answers_ok"]
        if limit is not None and fp_ok is not None and fp_ok < limit:
            # the FP student itself answers in loops: no calibration set can fix that (the student gate says so)
            print(f"attempt {attempt}: the full-precision student's own answers fail gate.student.min_answers_ok "
                  f"({fp_ok:.0%} < {limit:.0%}); not recalibrating")
            break
        print(f"attempt {attempt}: no quantized variant met the bar ({attempts[-1]['best']})")
    return gate_report, calibration, attempts
