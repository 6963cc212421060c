import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from edgeflow.calibration.mix import LeakageError, allocate, build_calibration_set, check_no_leakage, find_overlap
from edgeflow.profile import CalibrationConfig


def test_allocate_follows_ratios_exactly():
    assert allocate({"chat": 5, "wiki": 3, "math": 2}, 100) == {"chat": 50, "wiki": 30, "math": 20}
    counts = allocate({"chat": 5, "wiki": 3, "math": 2}, 16)
    assert sum(counts.values()) == 16
    assert counts == {"chat": 8, "wiki": 5, "math": 3}  # 8, 4.8, 3.2 -> largest remainder to wiki


def test_minimum_total_is_enforced_with_a_clear_message():
    with pytest.raises(ValueError, match=r"calibration.total=10 is below calibration.min_total=64"):
        CalibrationConfig(total=10)


def test_ratio_without_source_is_refused():
    with pytest.raises(ValueError, match="without a source"):
        CalibrationConfig(ratios={"code": 1.0}, total=64)


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_build_mixes_by_ratio_truncates_and_is_deterministic(tmp_path, teacher_dir):
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    sources = {
        "chat": _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "answer " * 40}]} for i in range(30)]),
        "wiki": _write(tmp_path / "wiki.jsonl", [{"title": f"T{i}", "text": f"paragraph number {i} " * 5} for i in range(30)]),
        "math": _write(tmp_path / "math.jsonl", [{"question": f"What is {i}+1?", "answer": f"{i + 1}"} for i in range(30)]),
    }
    ratios = {"chat": 5, "wiki": 3, "math": 2}
    stats = build_calibration_set(sources, ratios, 40, 32, 7, tok, tmp_path / "a.parquet")
    again = build_calibration_set(sources, ratios, 40, 32, 7, tok, tmp_path / "b.parquet")
    assert stats["counts"] == {"chat": 20, "math": 8, "wiki": 12}
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert all(len(r["input_ids"]) <= 32 for r in rows)
    assert stats["truncated"] == sum(r["truncated"] for r in rows) >= 20  # every chat sample is longer than 32 tokens
    assert rows == pq.read_table(tmp_path / "b.parquet").to_pylist() and stats == again
    other = build_calibration_set(sources, ratios, 40, 32, 8, tok, tmp_path / "c.parquet")
    assert pq.read_table(tmp_path / "c.parquet").to_pylist() != rows and other["counts"] == stats["counts"]


def test_overlap_is_found_and_named():
    calib = ["The Nile is the longest river in Africa and flows north into the Mediterranean Sea.", "unrelated text"]
    evals = [
        "the nile is the longest river in africa and flows north into the mediterranean sea",  # exact after normalising
        "Fun fact: The Nile is the longest river in Africa and flows north into the Mediterranean Sea, they say.",
        "Mount Everest is the highest mountain above sea level on Earth.",
    ]
    hits = find_overlap(calib, evals)
    assert [h["eval_index"] for h in hits] == [0, 1]
    assert hits[0]["kind"] == "exact" and hits[1]["kind"] == "8-gram"
    with pytest.raises(LeakageError, match=r"(?s)2 evaluation item\(s\) overlap.*eval\[0\].*eval\[1\]"):
        check_no_leakage(calib, evals)
    check_no_leakage(calib, evals[2:])  # disjoint sets pass


def test_shipped_calibration_sources_do_not_leak_into_eval(teacher_dir):
    from edgeflow.paths import REPO_ROOT
    from edgeflow.calibration.textdata import load_texts

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    calib = load_texts(sorted((REPO_ROOT / "data" / "corpora").glob("*.jsonl")), tok)
    evals = load_texts(sorted((REPO_ROOT / "data" / "eval").glob("*.jsonl")), tok)
    assert len(calib) > 300 and len(evals) > 100
    # chat rendering adds the same system prompt to every item: compare the content, not the template
    strip = lambda t: t.replace("You are a helpful AI assistant named SmolLM, trained by Hugging Face", "")  # noqa: E731
    check_no_leakage([strip(t) for t in calib], [strip(t) for t in evals])


def test_access_log_directory_is_a_source_and_arrives_scrubbed(tmp_path, teacher_dir):
    from edgeflow.paths import REPO_ROOT

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    sources = {"traffic": REPO_ROOT / "data" / "access_logs", "wiki": REPO_ROOT / "data" / "corpora" / "wiki.jsonl"}
    stats = build_calibration_set(sources, {"traffic": 1, "wiki": 1}, 64, 128, 0, tok, tmp_path / "c.parquet")
    assert stats["counts"] == {"traffic": 32, "wiki": 32}
    ingest = stats["access_log_ingest"]["traffic"]
    assert (ingest["malformed"], ingest["exact_duplicates"], ingest["near_duplicates"]) == (5, 6, 4)
    assert (ingest["dropped_too_long"], ingest["records_with_pii"], ingest["kept"]) == (2, 10, 100)  # two ~6,400-word messages
    texts = pq.read_table(tmp_path / "c.parquet").column("text").to_pylist()
    from edgeflow.calibration.access_logs import scrub
    from tests.helpers.pii import PLANTED  # the independent list of planted PII fragments

    for t in texts:
        assert scrub(t)[1] == {}, t  # the scrubber's own patterns find nothing left
        assert not any(f in t for f in PLANTED), t
    assert stats["token_length"]["max"] <= 128
