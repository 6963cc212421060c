"""Nightly recalibration's data path: the window's access logs → clean snapshot → derived profile; the promotion rule."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile, preflight
from edgeflow.calibration.nightly import beats, collect_traffic, derive_profile, parse_time

LOGS = REPO_ROOT / "data" / "access_logs"


@pytest.fixture(scope="module")
def tok(teacher_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)


def test_the_shipped_day_becomes_a_clean_snapshot(tmp_path, tok):
    t = collect_traffic(LOGS, parse_time("2026-11-30T00:00:00Z"), 24, 32, [], tmp_path / "t.jsonl", tok)
    assert t.skipped is None and t.since == "2026-11-29T00:00:00Z" and t.files == 1
    assert t.source == "dir" and t.per_device == {"edge-orin-01": 120}  # a folder's device: the file's name
    # 120 lines: 90 clean + 10 with PII (scrubbed, kept) ; duplicates, malformed, feedback and 2 oversized dropped
    assert t.kept == 100 and t.ingest["records_with_pii"] == 10 and t.ingest["feedback"] == 3
    lines = [json.loads(x) for x in Path(t.snapshot).read_text().splitlines()]
    assert len(lines) == 100 and set(lines[0]) == {"messages", "response", "id"}
    text = Path(t.snapshot).read_text()
    assert "4111 1111 1111 1111" not in text and "[CARD]" in text and "@example.com" not in text


def test_requests_that_overlap_the_eval_set_are_dropped(tmp_path, tok):
    from edgeflow.calibration.textdata import record_text

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
    derived = preflight(derive_profile(p, snap))  # an object, checked on this host as the nightly's release checks it
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


def _ship_day(tmp_path, day: str, counts: dict[str, int]) -> dict[str, str]:
    """Each device's edge-server log: `counts[name]` distinct chat requests on `day`, cut and shipped; {name: device id}."""
    import uuid
    from datetime import timedelta

    from edgeflow.serving.access_log import AccessLog
    from edgeflow.device.identity import DeviceConfig, device_profile
    from edgeflow.device.logship import access_log_path, ship_segments

    profile = load_profile(REPO_ROOT / "configs" / "test-tiny.yaml")
    start = parse_time(f"{day}T06:00:00Z")
    ids = {}
    for name, n in counts.items():
        device = DeviceConfig(id=f"{name}-{uuid.uuid4().hex[:8]}", deploy={"install_dir": str(tmp_path / name)})
        log = AccessLog(access_log_path(device_profile(profile, device)), max_bytes=4096, backups=50, rotate_s=0)
        for i in range(n):
            ts = (start + timedelta(minutes=i)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
            log.write({"ts": ts, "id": f"{device.id}-{i}", "kind": "request", "status": 200,
                       "messages": [{"role": "user", "content": f"How many {name} widgets ship in batch {i}?"}],
                       "response": f"Batch {i} of {name} ships {i * 7} widgets."})
        log.rotate()
        log.close()
        assert ship_segments(profile, device).lines == n
        ids[name] = device.id
    return ids


@pytest.fixture
def store(mlflow_tracking, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "home"))  # this test's own artifact cache
    return mlflow_tracking


def test_the_nightly_reads_the_segments_the_devices_shipped_and_counts_each_devices_lines(store, tmp_path, tok):
    from edgeflow.device.logship import fetch_segments
    from edgeflow.tracking.report import nightly_markdown

    ids = _ship_day(tmp_path, "2026-10-01", {"orin-a": 40, "orin-b": 25})
    until = parse_time("2026-10-02T00:00:00Z")
    fetched = fetch_segments(parse_time("2026-10-01T00:00:00Z"), until, tmp_path / "segments")
    mine = [d for d in fetched if d.device_id in ids.values()]
    assert len(mine) == 2  # (the session's server may hold other tests' devices too)
    t = collect_traffic(mine, until, 24, 32, [], tmp_path / "t.jsonl", tok, fetched_to=tmp_path / "segments")
    assert t.source == "store" and t.skipped is None and t.files == sum(len(d.paths) for d in mine)
    assert t.per_device == {ids["orin-a"]: 40, ids["orin-b"]: 25} and t.kept == 65
    md = nightly_markdown({"status": "registered", "traffic": t.model_dump()})
    assert f"| {ids['orin-a']} | 40 |" in md and f"| {ids['orin-b']} | 25 |" in md and "the devices shipped" in md


def test_a_skipped_night_still_counts_each_devices_lines(store, tmp_path, tok):
    from edgeflow.device.logship import fetch_segments
    from edgeflow.tracking.report import nightly_markdown

    ids = _ship_day(tmp_path, "2026-10-05", {"orin-c": 9, "orin-d": 4})
    until = parse_time("2026-10-06T00:00:00Z")
    mine = [d for d in fetch_segments(parse_time("2026-10-05T00:00:00Z"), until, tmp_path / "segments")
            if d.device_id in ids.values()]
    t = collect_traffic(mine, until, 24, 32, [], tmp_path / "t.jsonl", tok)
    assert "nightly.min_records=32" in t.skipped and t.snapshot is None
    assert t.per_device == {ids["orin-c"]: 9, ids["orin-d"]: 4}
    md = nightly_markdown({"status": "skipped", "reason": t.skipped, "traffic": t.model_dump()})
    assert f"| {ids['orin-c']} | 9 |" in md and f"| {ids['orin-d']} | 4 |" in md
    # a window no device shipped into: skipped, and the reason says where the logs were looked for
    none = collect_traffic([], parse_time("2026-09-01T00:00:00Z"), 24, 32, [], tmp_path / "n.jsonl", tok)
    assert none.per_device == {} and "no access-log segments shipped between 2026-08-31T00:00:00Z" in none.skipped


def test_the_nightly_flow_gathers_the_window_from_the_store_unless_told_a_folder(store, tmp_path, teacher_dir):
    """edgeflow/pipeline/nightly.py:gather_traffic with `nightly.logs_source: store` (the default) reads what the devices shipped;
    a `logs_dir` given to the run reads that folder instead."""
    from mlflow import MlflowClient

    from edgeflow.pipeline.nightly import gather_traffic
    from edgeflow.tracking.runs import experiment_id
    from edgeflow.tracking.store import publish

    ids = _ship_day(tmp_path, "2026-10-09", {"orin-e": 36, "orin-f": 3})
    data = yaml.safe_load((REPO_ROOT / "configs" / "test-tiny.yaml").read_text())
    data["workdir"] = str(tmp_path / "work")
    data.pop("nightly")  # the default source: the store
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    profile = load_profile(path)
    assert profile.nightly.logs_source == "store"
    c = MlflowClient(store)
    run = c.create_run(experiment_id(c, "nightly-test-students"))
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "student"  # what gather_traffic reads of the student: its tokenizer, to render the records
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(tok_dir)
    student = publish(c, run.info.run_id, tok_dir, "student", "student")

    t = gather_traffic.fn(profile, None, "2026-10-10T00:00:00Z", student)
    assert t.source == "store" and t.skipped is None and t.kept == 39  # no other test ships into this day
    assert t.per_device == {ids["orin-e"]: 36, ids["orin-f"]: 3}
    assert Path(t.logs_dir) == tmp_path / "work" / "nightly" / "20261010T000000Z" / "segments"
    folder = gather_traffic.fn(profile, str(LOGS), "2026-11-30T00:00:00Z", student)
    assert folder.source == "dir" and folder.per_device == {"edge-orin-01": 120} and folder.kept == 100
