"""The student gate: is the distilled student worth quantizing and serving at all?

The consistency gate (edgeflow/evaluation/gate.py) compares each quantized variant with the full-precision *student*: it
measures what quantization lost, not whether the student is any good. This gate measures the student itself, against
the limits of `gate.student` (edgeflow/profile/gate.py:StudentGateConfig):
- against the teacher, on the held-out eval text, as the distill stage recorded it in the student's meta
  (edgeflow/distill/run.py:compare_to_teacher): top-1 agreement, mean KL(teacher ‖ student), perplexity ratio;
- on its own answers: the share of the FP student's engine's answers to the demo prompts that are not degenerate
  (edgeflow/evaluation/answers.py), which the consistency stage records in the gate report's FP row.

The release checks the first three as soon as the student exists (a student that fails costs no quantization), and
the answers once the first gate attempt has them. No torch, no I/O: the callers hand in what was measured.
"""
from __future__ import annotations

from typing import Any

from edgeflow.profile import StudentGateConfig
from edgeflow.evaluation.answers import ok_share

# measure -> (the StudentGateConfig field that limits it, "min" or "max", how the message names it, format)
MEASURES: dict[str, tuple[str, str, str, str]] = {
    "top1_vs_teacher": ("min_top1_vs_teacher", "min", "held-out top-1 agreement with the teacher", ".1%"),
    "kl_vs_teacher": ("max_kl_vs_teacher", "max", "held-out mean KL(teacher ‖ student)", ".3f"),
    "ppl_ratio": ("max_ppl_ratio", "max", "held-out perplexity as a multiple of the teacher's", ".2f"),
    "answers_ok": ("min_answers_ok", "min", "share of the FP student's demo answers not degenerate", ".0%"),
}


def measures(meta: dict[str, Any], answers: list[dict] | None) -> dict[str, float | None]:
    """The student's measures: from the distill stage's evaluation (`meta`, the student ArtifactRef's) and, once the
    consistency stage has answered the demo prompts with the FP student's engine, from those `answers` (else None)."""
    ppl_s, ppl_t = meta.get("student_ppl"), meta.get("teacher_ppl")
    return {
        "top1_vs_teacher": meta.get("student_top1_vs_teacher"),
        "kl_vs_teacher": meta.get("student_kl_vs_teacher"),
        "ppl_ratio": ppl_s / ppl_t if ppl_s is not None and ppl_t else None,
        "answers_ok": None if answers is None else ok_share(answers),
    }


def check_student(meta: dict[str, Any], limits: StudentGateConfig, answers: list[dict] | None = None) -> dict[str, Any]:
    """The verdict on one student: {passed, failures (one line per missed limit, naming the measure, its value, the
    limit and its field), measures, limits, answers_checked}. Without `answers` the answers limit is not checked yet
    (answers_checked False); a limited measure the distill stage did not record fails, naming that."""
    got = measures(meta, answers)
    failures = []
    for measure, (field, kind, label, fmt) in MEASURES.items():
        limit = getattr(limits, field)
        if limit is None or (measure == "answers_ok" and answers is None):
            continue
        value = got[measure]
        if value is None:
            failures.append(f"{label}: not recorded by the distill stage that made this student (gate.student.{field}="
                            f"{limit}); re-run its distillation, or set gate.student.{field}: null")
        elif (value < limit) if kind == "min" else (value > limit):
            sign = "<" if kind == "min" else ">"
            failures.append(f"{label} {format(value, fmt)} {sign} {format(limit, fmt)} (gate.student.{field})")
    return {"passed": not failures, "failures": failures, "measures": got, "limits": limits.limits(),
            "answers_checked": answers is not None}


def rejection_message(verdict: dict[str, Any], steps: int, layers: int | None) -> str:
    """Why the release refused its student, and what to change: the message the release fails with."""
    kept = f"{layers}-layer " if layers else ""
    return (f"the student gate refused the {kept}student: " + "; ".join(verdict["failures"]) + ". Nothing was "
            f"registered, staged or deployed. Fix: train longer (distill.steps, now {steps}), keep more of the teacher "
            "(distill.keep_layers, a smaller distill.drop_block or distill.keep_every_k), or, if this student is what you mean to serve, lower the limits under gate.student")
