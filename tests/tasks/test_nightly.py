"""Nightly recalibration's data path: the window's access logs → clean snapshot → derived profile; the promotion rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks.config import REPO_ROOT, load_profile
from tasks.nightly import beats, collect_traffic, derive_profile, parse_time

LOGS = REPO_ROOT / "data" / "access_logs"


@pytest.fixture(scope="module")
def tok(teacher_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)


def test_the_shipped_day_becomes_a_clean_snapshot(tmp_path, tok):
    t = collect_traffic(LOGS, parse_time("2026-11-30T00:00:00Z"), 24, 32, [], tmp_path / "t.jsonl", tok)
    assert t.skipped is None and t.since == "2026-11-29T00:00:00Z" and t.files == 1
    # 120 lines: 90 clean + 10 with PII (scrubbed, kept) ; duplicates, malformed, feedback and 2 oversized dropped
    assert t.kept == 100 and t.ingest["records_with_pii"] == 10 and t.ingest["feedback"] == 3
    lines = [json.loads(x) for x in Path(t.snapshot).read_text().splitlines()]
    assert len(lines) == 100 and set(lines[0]) == {"messages", "response", "id"}
    text = Path(t.snapshot).read_text()
    assert "4111 1111 1111 1111" not in text and "[CARD]" in text and "@example.com" not in text


def test_requests_that_overlap_the_eval_set_are_dropped(tmp_path, tok):
    from tasks.textdata import record_text

    first = json.loads((LOGS / "2026-11-29" / "edge-orin-01.jsonl").read_text().splitlines()[0])
    eval_text = record_text(first, tok)  # production traffic asked an eval question verbatim
    t = collect_traffic(LOGS, parse_time("2026-11-30T00:00:00Z"), 24, 32, [eval_text], tmp_path / "t.jsonl", tok)
    assert t.dropped_eval_overlap == 1 and t.kept == 99
    assert first["id"] not in Path(t.snapshot).read_text()


def test_too_little_or_no_traffic_is_a_skip_with_the_reason(tmp_path, tok):
    early = collect_traffic(LOGS, parse_time("2026-11-29T01:00:00Z"), 24, 32, [], tmp_path / "a.jsonl", tok)
    assert early.snapshot is None and "nightly.min_records=32" in early.skipped and "2026-11-28T01:00:00Z" in early.skipped
    (tmp_path / "empty").mkdir()
    none = collect_traffic(tmp_path / "empty", parse_time(None), 24, 32, [], tmp_path / "b.jsonl", tok)
    assert none.skipped == f"no access logs under {tmp_path / 'empty'}" and not (tmp_path / "b.jsonl").exists()


def test_derived_profile_swaps_only_the_nightly_domain(tmp_path):
    p = load_profile(REPO_ROOT / "configs" / "test-tiny.yaml")
    snap = tmp_path / "traffic.jsonl"
    snap.write_text('{"messages": [{"role": "user", "content": "hi"}], "response": "hello", "id": "x"}\n')
    derived = load_profile(derive_profile(p, snap, tmp_path / "profile.yaml"))
    assert derived.calibration.sources["chat"] == str(snap.resolve())
    assert {k: v for k, v in derived.calibration.sources.items() if k != "chat"} == {
        k: v for k, v in p.calibration.sources.items() if k != "chat"}
    assert derived.name == "test-tiny-nightly" and derived.registry == p.registry and derived.quantize == p.quantize
    data = yaml.safe_load((REPO_ROOT / "configs" / "test-tiny.yaml").read_text())
    data["nightly"] = {"domain": "poetry"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="nightly.domain='poetry' is not a calibration domain"):
        load_profile(bad)  # refused when the profile loads, not at 02:30


@pytest.mark.parametrize("new,cur,verdict", [
    ({"top1_agreement": 0.99, "kl": 0.010}, {"top1_agreement": 0.98, "kl": 0.010}, True),
    ({"top1_agreement": 0.98, "kl": 0.009}, {"top1_agreement": 0.98, "kl": 0.010}, True),
    ({"top1_agreement": 0.98, "kl": 0.010}, {"top1_agreement": 0.98, "kl": 0.010}, False),  # a tie is not better
    ({"top1_agreement": 0.99, "kl": 0.020}, {"top1_agreement": 0.98, "kl": 0.010}, False),  # trades KL for agreement
])
def test_production_moves_only_for_a_pareto_better_gate(new, cur, verdict):
    ok, why = beats(new, cur)
    assert ok is verdict and ("beats production" if verdict else "does not beat production") in why
