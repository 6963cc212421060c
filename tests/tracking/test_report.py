"""Release report: the student-vs-teacher section shows the distillation's before/after evaluation."""
from __future__ import annotations

from edgeflow.tracking.report import student_table


def test_student_table_shows_agreement_kl_and_perplexity_before_and_after_training():
    s = {"student_top1_before_training": 0.052, "student_kl_before_training": 4.5, "student_ppl_before_training": 2143.7,
         "student_top1_vs_teacher": 0.233, "student_kl_vs_teacher": 1.92, "student_ppl": 137.2, "teacher_ppl": 21.2}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in student_table(s).splitlines()[2:]}
    assert rows["before training"] == ["5.2%", "4.500", "2143.7"]
    assert rows["after training"] == ["23.3%", "1.920", "137.2"]
    assert rows["teacher"][2] == "21.2"


def test_student_table_marks_keys_an_older_cached_student_lacks():
    rows = student_table({"student_top1_vs_teacher": 0.5, "student_ppl": 10.0, "teacher_ppl": 5.0}).splitlines()
    assert rows[2] == "| before training | - | - | - |"
    assert rows[3] == "| after training | 50.0% | - | 10.0 |"


def _gate():
    from tests.helpers.reports import REPORT

    from edgeflow.evaluation.report import GateReport

    return GateReport.model_validate(REPORT)


def test_attempt_summary_names_what_passed_and_the_best_quantized_variant():
    from edgeflow.tracking.report import attempt_summary

    assert attempt_summary(_gate()) == {
        "attempt": 1, "calibration_samples": 64, "passed": ["gptq-w4a16"], "fp_answers_ok": None, "slo_missed": [],
        "quantized": 2, "best": "gptq-w4a16: agreement 98.00%, KL 0.0123; passed",
    }


def test_a_variant_that_missed_a_service_objective_is_shown_with_its_figures_and_the_refused_ones_are_listed():
    from types import SimpleNamespace

    from edgeflow.evaluation.report import GateReport
    from edgeflow.tracking.report import attempt_summary, markdown, release_report
    from tests.helpers.reports import REPORT, row

    objectives = {"prompt_tokens": 128, "concurrency": 2, "max_new_tokens": 64, "ttft_p99_ms": 3000.0,
                  "decode_tok_s": None, "max_memory_mb": 440.0}
    measured = {"ttft_p99_ms": 900.0, "ttft_p50_ms": 700.0, "decode_tok_s": 55.4, "decode_tok_s_solo": 93.3,
                "peak_memory_mb": 472.0, "memory_source": "process peak RSS rise", "requests": 20}
    miss = "peak memory 472 MB > 440 MB (7% over; process peak RSS rise, 128 prompt tokens, concurrency 2)"
    w8 = row("gptq-w8a16", 0.99, False) | {"reasons": [f"slo x86-cpu: {miss}"], "quality_passed": True, "slo": [
        {"device": "x86-cpu", "pool": None, "objectives": objectives, "measured": measured, "misses": [miss],
         "roofline": {"decode_fraction": 0.412, "prefill_fraction": 0.3}}]}
    gate = GateReport.model_validate(REPORT | {"rows": [*REPORT["rows"], w8]})
    summary = attempt_summary(gate) | {"refused_before_build": {"w2": ["x86-cpu: memory 9 MB > 1 MB"]}}
    assert summary["slo_missed"] == ["gptq-w8a16"] and summary["quantized"] == 3
    ctx = SimpleNamespace(release_id="r-1", profile="p", mlflow_parent_run_id="p", prefect_flow_run_id=None,
                          resolved=lambda: SimpleNamespace(distill=SimpleNamespace(steps=3), registry=SimpleNamespace(model_name="m")))
    registry = {"staging": "gptq-w4a16", "staging_version": None, "registered": {}, "why_no_staging": None}
    student = {"student_layers": 2, "student_params": 1.5e6, "size_ratio": 4.0, "teacher_ppl": 5.0}
    text = markdown(release_report(ctx, student, gate, registry, None, [summary]))
    assert ("| gptq-w8a16 | x86-cpu | TTFT p99 ≤ 3000 ms, memory ≤ 440 MB at 128 prompt tokens, concurrency 2 | 900 | "
            f"55.4 (93.3) | 472 | 41%, 30% | **missed**: {miss} |") in text
    assert "## Not built" in text and "- w2: x86-cpu: memory 9 MB > 1 MB" in text
    assert f"- gptq-w8a16: slo x86-cpu: {miss}" in text


def test_release_report_keeps_the_variant_fields_and_the_gate_as_written():
    from types import SimpleNamespace

    from edgeflow.tracking.report import COLUMNS, VARIANT_FIELDS, markdown, release_report

    ctx = SimpleNamespace(release_id="r-1", profile="configs/test-tiny.yaml", mlflow_parent_run_id="p", prefect_flow_run_id=None,
                          resolved=lambda: SimpleNamespace(distill=SimpleNamespace(steps=3), registry=SimpleNamespace(model_name="m")))
    registry = {"staging": None, "staging_version": None, "registered": {}, "why_no_staging": "rtn-w4a16: too far"}
    student = {"student_layers": 2, "student_params": 1.5e6, "size_ratio": 4.0, "student_quality_pct": 50.0, "teacher_ppl": 5.0}
    gate = _gate()
    report = release_report(ctx, student, gate, registry, None, [{"attempt": 0}])
    rtn = report["variants"][2]
    assert list(rtn) == [*VARIANT_FIELDS, "engine_parity", "answers_ok"] and set(COLUMNS) <= set(rtn)
    assert rtn["answers_ok"] is None  # this gate row has no answers (a report written before the gate gave them)
    assert rtn["reasons"] == ["top-1 agreement 91.00% < 97.00%"] and rtn["engine_parity"] == 0.9987
    assert report["gate"] == gate.thresholds and report["gate_reference"]["top_k"] == 64
    assert report["why_no_staging"] == "no variant met the bar after 1 attempt(s); rtn-w4a16: too far"
    assert report["student"]["student_layers"] == 2 and report["student"]["student_ppl"] is None and report["student"]["steps"] == 3
    assert "| rtn-w4a16 | 1.2 | int4 |" in markdown(report) and "No staging: no variant met the bar" in markdown(report)


def test_nightly_markdown_shows_the_window_and_the_outcome():
    from edgeflow.tracking.report import nightly_markdown

    traffic = {"since": "a", "until": "b", "files": 2, "kept": 40, "dropped_eval_overlap": 1,
               "ingest": {"lines": 50, "records_with_pii": 3, "exact_duplicates": 2, "near_duplicates": 1}}
    md = nightly_markdown({"status": "registered", "traffic": traffic, "staging": "version 4 (gptq-w4a16)"})
    assert md.startswith("# Nightly recalibration: registered\n")
    assert "| a → b | 2 | 50 | 40 | 3 | 3 | 1 |" in md and md.endswith("- **Staging:** version 4 (gptq-w4a16)\n")


def test_the_report_shows_the_staged_variant_s_answers_and_counts_the_degenerate_ones():
    from types import SimpleNamespace

    from edgeflow.evaluation.answers import repetition
    from edgeflow.tracking.report import markdown, release_report

    gate = _gate()
    good = "A microcontroller runs a washing machine, reads a thermostat and blinks the lights of a toy."
    loop = "the total of the total of the total of the total"
    gate.rows[1].answers = [{"prompt": "Name three uses of a microcontroller.", "answer": good, "tokens": 20} | repetition(good),
                            {"prompt": "Why do we have seasons on Earth?", "answer": loop, "tokens": 12} | repetition(loop)]
    ctx = SimpleNamespace(release_id="r-2", profile="configs/test-tiny.yaml", mlflow_parent_run_id="p", prefect_flow_run_id=None,
                          resolved=lambda: SimpleNamespace(distill=SimpleNamespace(steps=3), registry=SimpleNamespace(model_name="m")))
    registry = {"staging": gate.rows[1].name, "staging_version": None, "registered": {}, "why_no_staging": None}
    student = {"student_layers": 2, "student_params": 1.5e6, "size_ratio": 4.0, "student_quality_pct": 50.0,
               "teacher_ppl": 5.0, "student_ppl": 10.0}
    report = release_report(ctx, student, gate, registry, None, [{"attempt": 0}])
    assert report["variants"][1]["answers_ok"] == "1/2"
    md = markdown(report)
    assert f"## Answers of {gate.rows[1].name}" in md and f"> {good}" in md and "Held-out perplexity is 2.0× the teacher's." in md
    assert "most frequent 3-gram ×3 · distinct-2 0.30 · **degenerate**" in md
    assert md.count("**degenerate**") == 1
