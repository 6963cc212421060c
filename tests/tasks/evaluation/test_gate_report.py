"""The typed gate report: what the consistency stage writes reads back field for field, in the order it was written."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from edgeflow.evaluation.report import GateReport, GateRow, parse_gate_report


def ref(kind: str, name: str) -> dict:
    return {"kind": kind, "uri": f"mlflow-artifacts:/1/abc/artifacts/{name}", "sha256": name * 8, "mlflow_run_id": "abc",
            "meta": {"variant": name, "size_mb": 1.25}}


def row(name: str, top1: float, passed: bool, quantized: bool = True) -> dict:
    """A row as edgeflow/pipeline/consistency.py:gate_variants writes it (edgeflow/evaluation/gate.py:run_gate, then its additions)."""
    return {
        "name": name, "size_mb": 1.2, "decode_tok_s": 51.3, "ttft_ms": 20.5, "top1_agreement": top1, "kl": 0.01234,
        "kl_p99": 0.05, "top1_last": 0.9, "greedy_exact": None if not quantized else 0.75, "ppl": 11.125, "passed": passed,
        "quantized": quantized, "reasons": [] if passed else [f"top-1 agreement {top1:.2%} < 97.00%"],
        "metrics": {"engine_parity": 0.99871, "positions": 420, "greedy_exact_match": None, "kl": 0.0123401},
        "checkpoint": ref("quantized" if quantized else "student", name), "engine": ref("engine", name),
        "engine_precision": "int4" if quantized else "fp32", "layer_error": [0.01, 0.02] if quantized else None,
    }


REPORT = {
    "thresholds": {"min_top1_agreement": 0.97, "max_mean_kl": 0.1, "max_ppl_increase": 0.1, "min_engine_parity": 0.99, "num_prompts": 16},
    "eval_prompts": 16, "eval_positions": 900,
    "reference": {"sha256": "f" * 64, "uri": "mlflow-artifacts:/1/r/artifacts/reference", "top_k": 64, "tail_mass_mean": 0.0125},
    "backend": "cpu_native", "attempt": 1, "calibration": {"sha256": "c" * 64, "total": 64},
    "rows": [row("fp32", 1.0, True, quantized=False), row("gptq-w4a16", 0.98, True), row("rtn-w4a16", 0.91, False)],
    "plots": {"layer_error": ref("plot", "layer_error.png")},
}


def test_a_written_report_reads_back_and_dumps_to_the_same_json():
    report = parse_gate_report(json.dumps(REPORT, indent=1))
    assert [r.name for r in report.quantized] == ["gptq-w4a16", "rtn-w4a16"]
    assert report.row("rtn-w4a16").reasons == ["top-1 agreement 91.00% < 97.00%"] and report.row("nope") is None
    assert report.rows[1].metrics["positions"] == 420 and isinstance(report.rows[1].metrics["positions"], int)
    # the register stage packs rows from the typed report: the bytes must be the ones the gate wrote
    assert json.dumps(report.model_dump(exclude_unset=True), indent=1) == json.dumps(REPORT, indent=1)


def test_a_verdict_only_report_reads_with_its_measurements_absent():
    report = GateReport.model_validate({"thresholds": {}, "attempt": 0, "rows": [row("gptq-w4a16", 0.98, True)]})
    assert (report.reference, report.eval_prompts, report.plots) == (None, None, {})
    assert report.rows[0].model_dump(exclude_unset=True) == row("gptq-w4a16", 0.98, True)


def test_unknown_or_missing_fields_are_refused_by_name():
    with pytest.raises(ValidationError, match="rows.0.tpo1_agreement"):
        GateReport.model_validate(REPORT | {"rows": [row("a", 0.9, False) | {"tpo1_agreement": 0.9}]})
    with pytest.raises(ValidationError, match="rows.0.passed"):
        GateReport.model_validate(REPORT | {"rows": [{k: v for k, v in row("a", 0.9, False).items() if k != "passed"}]})
    with pytest.raises(ValidationError, match="attempt"):
        GateReport.model_validate({k: v for k, v in REPORT.items() if k != "attempt"})


def test_every_field_is_described():
    from edgeflow.evaluation.report import GateReferenceInfo

    for model in (GateReport, GateRow, GateReferenceInfo):
        assert model.model_config["extra"] == "forbid"
        assert all(f.description for f in model.model_fields.values()), model
