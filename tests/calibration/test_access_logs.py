import json
from datetime import datetime, timezone

from edgeflow.calibration.access_logs import ingest, log_files, normalize, scrub
from edgeflow.paths import REPO_ROOT

LOGS = REPO_ROOT / "data" / "access_logs"

def test_sample_log_counts_match_its_readme():
    records, rep = ingest(log_files(LOGS))
    assert (rep.lines, rep.malformed, rep.feedback) == (120, 5, 3)
    assert (rep.exact_duplicates, rep.near_duplicates, rep.dropped_too_long) == (6, 4, 2)
    assert rep.records_with_pii == 10
    assert rep.pii_replaced == {"email": 2, "phone": 3, "ssn": 1, "card": 1, "api_key": 1, "github_token": 1, "jwt": 1}
    assert rep.kept == len(records) == 112 - 6 - 4 - 2


def test_no_pii_survives_by_both_pattern_sets():
    records, _ = ingest(log_files(LOGS))
    blob = json.dumps(records)
    for text in (m["content"] for r in records for m in r["messages"]):
        assert scrub(text)[1] == {}, text
    for fragment in PLANTED:
        assert fragment not in blob, fragment
    assert "[EMAIL]" in blob and "[PHONE]" in blob and "[CARD]" in blob and "[API_KEY]" in blob and "[NATIONAL_ID]" in blob


def test_time_window_and_long_entries():
    _, rep = ingest(log_files(LOGS), since=datetime(2026, 11, 30, tzinfo=timezone.utc))
    assert rep.kept == 0 and rep.outside_window == 112
    records, rep = ingest(log_files(LOGS), max_words=50, drop_over_words=100_000)
    assert rep.dropped_too_long == 0 and rep.truncated >= 2
    assert max(len(m["content"].split()) for r in records for m in r["messages"]) <= 50


def test_scrub_keeps_ordinary_numbers_and_replaces_typed():
    text, found = scrub("Order 1234 5678 9012 3456 ships in 3 days; call +1 415-555-0132 or mail a.b@corp.io")
    assert "1234 5678 9012 3456" in text  # fails the Luhn check: not a card
    assert "[PHONE]" in text and "[EMAIL]" in text and found == {"phone": 1, "email": 1}
    assert scrub("The year 2026 had 365 days.")[1] == {}


def test_normalize_makes_near_duplicates_equal():
    assert normalize("What is  the capital of France?") == normalize("what is the capital of france")


# --- any shape of line: counted, never fatal --------------------------------------------------------------

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgeflow.calibration.access_logs import IngestReport  # noqa: E402
from tests.helpers.pii import PLANTED

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = {"ts": "2026-11-29T09:41:49.966Z", "id": "req-1", "kind": "request", "model": "edgeflow-student",
         "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "response": "Paris.", "status": 200, "prompt_tokens": 9, "completion_tokens": 2}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**30, max_value=10**60) | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
FIELDS = ["ts", "id", "kind", "model", "messages", "response", "status", "prompt_tokens", "messages[0]",
          "messages[0].role", "messages[0].content", "messages[1]"]


def _ingest_lines(lines: list[bytes]) -> tuple[list[dict], IngestReport]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "edge.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        return ingest([path])


def _with(field: str, value) -> dict:
    rec = json.loads(json.dumps(VALID))
    if field.startswith("messages[0]."):
        rec["messages"][0][field.split(".")[1]] = value
    elif field == "messages[0]":
        rec["messages"][0] = value
    elif field == "messages[1]":
        rec["messages"].append(value)
    else:
        rec[field] = value
    return rec


def _assert_accounted(records: list[dict], rep: IngestReport) -> None:
    assert rep.lines == rep.accounted(), rep
    assert rep.kept == len(records)
    assert (rep.malformed == 0) == (rep.malformed_examples == [])
    assert sum(rep.malformed_by_field.values()) == rep.malformed


def test_counts_add_up_on_the_sample_log():
    records, rep = ingest(log_files(LOGS))
    assert rep.lines == rep.accounted() == 120
    assert rep.malformed_by_field == {"line": 4, "messages": 1}


@FAST
@given(field=st.sampled_from(FIELDS), value=JSON)
def test_any_json_value_in_any_field_is_counted_never_fatal(field, value):
    rec = _with(field, value)
    records, rep = _ingest_lines([json.dumps(rec).encode(), json.dumps(VALID | {"id": "req-2", "messages": [
        {"role": "user", "content": "A different question?"}]}).encode()])
    _assert_accounted(records, rep)
    assert rep.lines == 2 and len(records) >= 1  # the valid neighbour is kept whatever the first line holds
    if rep.malformed:  # the example names the field that was changed (or the messages list it is in)
        named = rep.malformed_examples[0].split(": ")[1]
        assert named == field or named.startswith(field.split(".")[0].split("[")[0]), (field, rep.malformed_examples)
    for r in records:
        assert isinstance(r["response"], str) and all(isinstance(m["content"], str) for m in r["messages"])


@FAST
@given(lines=st.lists(st.binary(max_size=60) | st.text(max_size=60).map(str.encode), max_size=6))
def test_arbitrary_bytes_and_text_lines_are_counted(lines):
    lines = [ln.replace(b"\n", b" ") for ln in lines] + [json.dumps(VALID).encode()]
    records, rep = _ingest_lines(lines)
    _assert_accounted(records, rep)
    assert rep.lines == len(lines) and rep.kept == 1


@pytest.mark.parametrize("field, value, named", [
    ("messages[0].content", 42, "messages[0].content"),
    ("messages[0].content", [{"type": "text", "text": "hi"}], "messages[0].content"),
    ("messages[0].content", None, "messages[0].content"),
    ("messages", [["nested", ["list"]]], "messages[0]"),
    ("messages", [], "messages"),
    ("messages", None, "messages"),
    ("messages", "hello", "messages"),
    ("messages[0]", "user: hi", "messages[0]"),
    ("messages[0].role", 1, "messages[0].role"),
    ("messages[0].role", "robot", "messages[0].role"),
    ("messages[0].role", "system", "messages"),  # no user message left
    ("ts", 1795939200, "ts"),
    ("ts", "yesterday", "ts"),
    ("ts", "2026-11-29T09:41:49", "ts"),  # no UTC offset: cannot be placed in the window
    ("ts", None, "ts"),
    ("status", "200", "status"),
    ("status", 10**30, "status"),
    ("status", True, "status"),
    ("status", 200.0, "status"),
    ("response", {"text": "Paris."}, "response"),
    ("response", ["Paris."], "response"),
    ("id", {"x": 1}, "id"),
    ("kind", "heartbeat", "kind"),
    ("kind", ["request"], "kind"),
])
def test_malformed_fields_are_named_in_the_example(field, value, named):
    records, rep = _ingest_lines([json.dumps(_with(field, value)).encode()])
    assert (rep.malformed, rep.kept, records) == (1, 0, [])
    example = rep.malformed_examples[0]
    assert f": {named}: got " in example and "expected" in example, example
    assert rep.malformed_by_field == {named: 1}


def test_lines_that_are_not_json_objects():
    huge = b'{"ts": "2026-11-29T09:41:49Z", "status": ' + b"9" * 5000 + b"}"
    lines = [b"\xff\xfe not utf-8 \xc3\x28", b"", b"plain text", b"[1, 2]", b"null", huge, b'{"ts": 1e999}',
             b'{"messages": [' * 100_000]
    records, rep = _ingest_lines(lines)
    assert (rep.lines, rep.malformed, rep.kept) == (8, 8, 0)
    assert rep.lines == rep.accounted()
    assert any("invalid UTF-8 byte 0xff at byte 0" in e for e in rep.malformed_examples)
    assert len(rep.malformed_examples) >= 5


def test_failed_requests_with_anything_in_messages_are_failed_not_malformed():
    lines = [json.dumps(VALID | {"status": 400, "response": None, "messages": {"bad": "input"}}).encode(),
             json.dumps(VALID | {"status": 200, "response": None}).encode(),
             json.dumps(VALID | {"response": ""}).encode()]
    records, rep = _ingest_lines(lines)
    assert (rep.failed_requests, rep.malformed, rep.kept) == (3, 0, 0)


def test_line_separators_inside_strings_and_a_bom_do_not_split_records():
    rec = VALID | {"messages": [{"role": "user", "content": "line one\u2028line two\x85three\x0bfour"}]}
    data = b"\xef\xbb\xbf" + json.dumps(rec, ensure_ascii=False).encode() + b"\r\n"
    records, rep = _ingest_lines([data.rstrip(b"\n")])
    assert (rep.lines, rep.malformed, rep.kept) == (1, 0, 1)
    assert records[0]["messages"][0]["content"] == "line one\u2028line two\x85three\x0bfour"


def test_raw_logs_from_older_servers_are_scrubbed_at_ingestion():
    rec = VALID | {"messages": [{"role": "user", "content": "Meine Nummer ist 0151 23456789, IBAN DE89 3704 0044 0532 "
                                                              "0130 00, 身份证11010519491231002X"}]}
    records, rep = _ingest_lines([json.dumps(rec, ensure_ascii=False).encode()])
    assert records[0]["messages"][0]["content"] == "Meine Nummer ist [PHONE], IBAN [IBAN], 身份证[NATIONAL_ID]"
    assert rep.pii_replaced == {"phone": 1, "iban": 1, "cn_ric": 1} and rep.records_with_pii == 1


def test_completions_requests_are_counted_apart_not_malformed():
    completion = {"ts": VALID["ts"], "id": "cmpl-1", "kind": "request", "endpoint": "/v1/completions",
                  "prompt": "The capital of France is", "response": " Paris.", "status": 200}
    records, rep = _ingest_lines([json.dumps(completion).encode(), json.dumps(VALID).encode()])
    assert rep.completions == 1 and rep.malformed == 0 and rep.kept == 1 and records[0]["id"] == "req-1"
    _assert_accounted(records, rep)
