"""The typed gate report: what the consistency stage writes reads back field for field, in the order it was written."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from edgeflow.evaluation.report import GateReport, GateRow, parse_gate_report

from tests.helpers.reports import REPORT, ref, row


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
