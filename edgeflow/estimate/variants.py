"""A profile's variants estimated on each of its SLO targets before anything is built: the student's architecture (the
teacher's config.json with the distill cut), each variant's weight scheme (its recipe), and the runtime that serves
each target (its slo runtime, else the profile's engine backend). What `edgeflow plan` prints, and what a release
refuses to build when no engine could serve it.
"""
from __future__ import annotations

from typing import Any

from edgeflow.estimate.counts import Scheme, token_cost
from edgeflow.estimate.roofline import estimate
from edgeflow.estimate.runtimes import ROOFLINE, target_runtime
from edgeflow.model.architecture import Architecture
from edgeflow.profile import Profile

# The student ArtifactRef's meta key holding its config.json (edgeflow/pipeline/distill.py writes it).
CONFIG_META_KEY = "config"

# The FP student's row (variant_schemes): the gate's yardstick, built whatever the objectives, never a candidate.
_FP_ROWS = ("fp32", "fp16")

# cpu_native keeps its head as int8 rows whatever the variant (engines/cpu_native/settings.py FORMAT_VERSION 2), and
# its fp32 reference engine fp32 layers; GPU runtimes keep the head in fp16.
_QUANTIZED_HEAD_BITS = {"cpu_native": 8}


def student_architecture(teacher: Architecture, profile: Profile) -> Architecture | str:
    """The layer-dropped student's description: the teacher's with the kept layer count (its first layer kinds: which
    block drop_block removes is chosen at training); a reason string for a student_from student."""
    kept = profile.distill.student_layers(teacher.num_hidden_layers)
    if kept is None:
        return "the student is distill.student_from's own model: estimate it with `edgeflow estimate --model` on it"
    return teacher.model_copy(update={"num_hidden_layers": kept, "layer_types": teacher.layer_types[:kept]})


def variant_schemes(profile: Profile, runtime: str | None = None) -> dict[str, Scheme | str]:
    """{variant: its Scheme, or why it cannot be counted}: the fp reference row, then each variant's recipe, as
    `runtime` (default: engine.backend) holds them: the FP row's width and the head's."""
    from edgeflow.quantize.recipe import load_recipe, weight_spec

    backend = runtime or profile.engine.backend
    fp_bits = 32 if backend in ("cpu_native", "cpu") else 16
    out: dict[str, Scheme | str] = {"fp32" if fp_bits == 32 else "fp16": Scheme(bits=fp_bits, head_bits=fp_bits)}
    for v in profile.quantize.variants:
        if v.recipe is None:
            out[v.name] = "pre-quantized: estimate its checkpoint with `edgeflow estimate --model`"
            continue
        try:
            bits, group, symmetric = weight_spec(load_recipe(profile.resolve(v.recipe), profile.quantize.recipe_overrides))
        except ValueError as e:
            out[v.name] = f"recipe {v.recipe}: {e}"
            continue
        if bits not in (4, 8):
            out[v.name] = f"recipe {v.recipe}: {bits}-bit weights are not counted"
            continue
        out[v.name] = Scheme(bits=bits, group_size=group, zero_point=not symmetric,
                             head_bits=_QUANTIZED_HEAD_BITS.get(backend, 16))
    return out


def slo_estimates(profile: Profile, teacher: Architecture) -> list[dict[str, Any]]:
    """Per SLO target: the device's limits and, per variant, the estimate and the objectives it cannot meet."""
    return student_estimates(profile, student_architecture(teacher, profile))


def student_estimates(profile: Profile, student: Architecture | str) -> list[dict[str, Any]]:
    """slo_estimates for a student already described (`student`: its description, or why there is none)."""
    from edgeflow.estimate import limits_for

    out, schemes_of = [], {}  # the recipes read once per runtime, not once per target
    for i, target in enumerate(profile.slo.targets):
        runtime = target_runtime(profile.engine.backend, target, f"slo.targets[{i}]")
        if runtime.name not in schemes_of:
            schemes_of[runtime.name] = variant_schemes(profile, runtime.name) if not isinstance(student, str) else {}
        schemes = schemes_of[runtime.name]
        limits = limits_for(target.device)
        rows = []
        for name, scheme in schemes.items():
            if isinstance(scheme, str):
                rows.append({"variant": name, "not_estimated": scheme})
                continue
            cost = token_cost(student, scheme)
            est = estimate(cost, limits, runtime, target.prompt_tokens, target.concurrency, target.max_new_tokens)
            best = estimate(cost, limits, ROOFLINE, target.prompt_tokens, target.concurrency, target.max_new_tokens)
            # misses: with the runtime's fitted efficiency; unservable: even at the roofline (what the release refuses)
            rows.append({"variant": name, "estimate": est.model_dump(), "misses": est.misses(target),
                         "unservable": [] if name in _FP_ROWS else best.misses(target)})
        out.append({"target": target.model_dump(), "limits": limits.model_dump(), "runtime": runtime.model_dump(),
                    "student": student if isinstance(student, str) else f"{student.num_hidden_layers} layers",
                    "variants": rows})
    return out


def unservable(profile: Profile, student: Architecture) -> dict[str, list[str]]:
    """{variant: why no engine could serve it}, for the variants whose roofline (every efficiency 1, no runtime
    overhead: the best any engine can do on the device) misses an objective of some slo target (student_estimates'
    `unservable`); what a release refuses to quantize and build. Empty without targets or with slo.build_anyway."""
    if profile.slo.build_anyway:
        return {}
    out: dict[str, list[str]] = {}
    for t in student_estimates(profile, student):
        for r in t["variants"]:
            if r.get("unservable"):
                out.setdefault(r["variant"], []).extend(f"{t['target']['device']}: {m}" for m in r["unservable"])
    return out


def roofline_fractions(profile: Profile, student: Architecture, variant: str, measured_target: dict[str, Any]) -> dict[str, Any]:
    """How close a variant's engine came to the host's limits on one measured slo target (a row's `slo` entry, as
    edgeflow/evaluation/service.py wrote it): the roofline decode and TTFT of the same workload (every efficiency 1:
    the host's bandwidth and peak, the bytes and FLOPs counted here) and the measured figures as fractions of them;
    {"not_estimated": why} for a variant whose scheme or a model whose family is not counted."""
    from edgeflow.estimate import limits_for
    from edgeflow.profile.slo import SLOTarget

    scheme = variant_schemes(profile).get(variant)
    if not isinstance(scheme, Scheme):
        return {"not_estimated": scheme or f"{variant} is not a variant of this profile"}
    m = measured_target["measured"]
    target = SLOTarget(device=measured_target["device"], **measured_target["objectives"])
    limits = limits_for(target.device)
    best = estimate(token_cost(student, scheme), limits, ROOFLINE, target.prompt_tokens, target.concurrency,
                    target.max_new_tokens)
    return {
        "bandwidth_gb_s": limits.bandwidth_gb_s, "peak_tflops": limits.peak_tflops,
        "step_bytes": best.step_bytes, "prefill_flops": best.prefill_flops,
        "decode_roofline_tok_s": round(best.decode_roofline_tok_s, 1),
        "decode_fraction": round(m["decode_tok_s"] / best.decode_roofline_tok_s, 3) if m.get("decode_tok_s") else None,
        "ttft_roofline_ms": round(best.ttft_p99_ms, 2),
        "prefill_fraction": round(best.ttft_p99_ms / m["ttft_p99_ms"], 3) if m.get("ttft_p99_ms") else None,
    }
