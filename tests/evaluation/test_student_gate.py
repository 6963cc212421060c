"""The student gate (edgeflow/evaluation/student_gate.py) and the gate's answers rule (edgeflow/evaluation/gate.py):
the verdicts on measured students and variants, and what the report says of them. The release that refuses a
student end to end: tests/pipeline/test_release_e2e.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgeflow.profile import GateConfig, StudentGateConfig
from edgeflow.evaluation.answers import repetition
from edgeflow.evaluation.student_gate import check_student, rejection_message

# What the distill stage recorded for test-tiny's 3-layer, 3-step student, and for the SmolLM2 demo student (BENCHMARKS.md#student-gate)
TINY = {"student_top1_vs_teacher": 0.0668, "student_kl_vs_teacher": 7.7646, "student_ppl": 34048.6, "teacher_ppl": 37.3,
        "student_layers": 3}
DEMO = {"student_top1_vs_teacher": 0.627, "student_kl_vs_teacher": 0.536, "student_ppl": 13.9, "teacher_ppl": 21.2,
        "student_layers": 24}
FLUENT = "A microcontroller runs a washing machine, reads a thermostat and blinks the lights of a toy."
LOOP = "the total of the total of the total of the total"


def answers(fluent: int, looping: int) -> list[dict]:
    return [{"answer": FLUENT} | repetition(FLUENT)] * fluent + [{"answer": LOOP} | repetition(LOOP)] * looping


def test_a_student_far_from_its_teacher_fails_naming_each_measure_its_value_and_limit():
    v = check_student(TINY, StudentGateConfig())
    assert not v["passed"] and not v["answers_checked"]
    assert v["failures"] == [
        "held-out top-1 agreement with the teacher 6.7% < 30.0% (gate.student.min_top1_vs_teacher)",
        "held-out mean KL(teacher ‖ student) 7.765 > 3.000 (gate.student.max_kl_vs_teacher)",
        "held-out perplexity as a multiple of the teacher's 912.83 > 3.00 (gate.student.max_ppl_ratio)",
    ]
    assert v["measures"]["answers_ok"] is None  # its answers come with the first gate attempt


def test_the_demo_student_passes_the_defaults_and_fails_on_its_answers_alone_when_they_loop():
    assert check_student(DEMO, StudentGateConfig(), answers(5, 0))["passed"]
    assert check_student(DEMO, StudentGateConfig(), answers(3, 2))["passed"]  # 3/5: the limit, 0.6
    v = check_student(DEMO, StudentGateConfig(), answers(2, 3))
    assert v["failures"] == ["share of the FP student's demo answers not degenerate 40% < 60% (gate.student.min_answers_ok)"]
    assert v["answers_checked"] and v["measures"]["answers_ok"] == pytest.approx(0.4)


def test_a_limit_set_to_none_is_not_checked_and_a_measure_never_recorded_fails_by_name():
    off = StudentGateConfig(min_top1_vs_teacher=None, max_kl_vs_teacher=None, max_ppl_ratio=None, min_answers_ok=None)
    assert check_student(TINY, off, answers(0, 5)) == {
        "passed": True, "failures": [], "limits": {}, "answers_checked": True,
        "measures": {"top1_vs_teacher": 0.0668, "kl_vs_teacher": 7.7646, "ppl_ratio": pytest.approx(912.83, rel=1e-4),
                     "answers_ok": 0.0}}
    v = check_student({k: v for k, v in DEMO.items() if k != "student_kl_vs_teacher"}, StudentGateConfig())
    assert [f.split(":")[0] for f in v["failures"]] == ["held-out mean KL(teacher ‖ student)"]
    assert "not recorded by the distill stage" in v["failures"][0] and "gate.student.max_kl_vs_teacher: null" in v["failures"][0]


def test_the_rejection_says_nothing_shipped_and_what_to_change():
    msg = rejection_message(check_student(TINY, StudentGateConfig()), steps=3, layers=3)
    assert msg.startswith("the student gate refused the 3-layer student: held-out top-1 agreement with the teacher 6.7% < 30.0%")
    assert "Nothing was registered, staged or deployed" in msg
    assert "distill.steps, now 3" in msg and "distill.drop_block" in msg and "gate.student" in msg


def test_the_limits_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="min_top1_vs_teacher"):
        StudentGateConfig(min_top1_vs_teacher=1.5)
    with pytest.raises(ValueError, match="max_ppl_ratio"):
        StudentGateConfig(max_ppl_ratio=0)
    with pytest.raises(ValueError, match="min_answers_ok"):
        GateConfig(min_answers_ok=-0.1)


MEASURED = {"engine_parity": 1.0, "top1_agreement": 0.999, "kl": 0.001, "greedy_exact_match": 1.0, "ppl_increase": 0.0}


def test_a_variant_whose_answers_degenerate_fails_whatever_its_kl():
    from edgeflow.evaluation.gate import variant_reasons

    gate = GateConfig()
    assert variant_reasons(MEASURED, gate, answers(5, 0)) == []
    assert variant_reasons(MEASURED, gate, answers(3, 2)) == []
    assert variant_reasons(MEASURED, gate, answers(1, 4)) == [
        "answers: 4 of 5 demo answers degenerate, 20% not degenerate < 60% (gate.min_answers_ok)"]
    assert variant_reasons(MEASURED, GateConfig(min_answers_ok=None), answers(0, 5)) == []  # reported, not gated
    assert variant_reasons(MEASURED | {"kl": 1.0}, gate, answers(5, 0)) == ["mean KL 1.0000 > 0.02"]


def _ctx():
    return SimpleNamespace(release_id="r-3", profile="configs/demo-cpu.yaml", mlflow_parent_run_id="p", prefect_flow_run_id=None,
                           resolved=lambda: SimpleNamespace(distill=SimpleNamespace(steps=3), gate=GateConfig(),
                                                            registry=SimpleNamespace(model_name="m")))


def test_a_report_of_a_refused_student_has_no_variants_and_says_why_and_what_failed():
    from edgeflow.tracking.report import markdown, release_report

    verdict = check_student(TINY, StudentGateConfig())
    why = rejection_message(verdict, 3, 3)
    registry = {"staging": None, "staging_version": None, "registered": {}, "why_no_staging": why}
    student = TINY | {"student_params": 3.9e7, "size_ratio": 3.5, "student_quality_pct": 0.1}
    report = release_report(_ctx(), student, None, registry, None, [], verdict)
    assert report["variants"] == [] and report["why_no_staging"] == why and report["student_gate"] == verdict
    assert report["gate"]["student"]["min_top1_vs_teacher"] == 0.3 and report["eval_prompts"] is None
    md = markdown(report)
    assert "No variant was quantized: the student gate refused the student first." in md
    assert "## Student gate" in md and "**failed**: held-out top-1 agreement with the teacher 6.7% < 30.0%" in md
    assert "| held-out top-1 agreement with the teacher | 6.7% | ≥ 30.0% |" in md
    assert "| share of the FP student's demo answers not degenerate | - | ≥ 60% |" in md  # not measured: no engine built
    assert f"No staging: {why}" in md


def test_the_quality_line_never_exceeds_100_percent_without_its_reason():
    from edgeflow.tracking.report import quality_phrase

    assert quality_phrase({"student_quality_pct": 64.0}) == "quality 64% of the teacher (teacher perplexity / student perplexity)"
    above = quality_phrase({"student_quality_pct": 152.5})
    assert above.startswith("quality 152% of the teacher") and "not because it is the better model" in above
