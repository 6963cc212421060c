"""The access log's segments: cut on size and on age, never written after the cut, kept until shipped or past the
retention budget, shared safely by the blue and green servers of one device."""
from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone

import httpx
import pytest

from edgeflow.serving.access_log import AccessLog, identity, mark_shipped, remove_shipped, segments, shipped_marker
from tests.helpers.require import lacking


def _rec(i: int, ts: str = "2026-11-29T09:41:49.966Z") -> dict:
    return {"ts": ts, "id": f"r{i}", "kind": "request", "pad": "x" * 40}


def _lines(paths) -> list[str]:
    return [json.loads(x)["id"] for p in paths for x in p.read_text().splitlines()]


def test_a_quiet_log_is_cut_on_age_into_a_segment_named_by_its_first_line(tmp_path):
    path = tmp_path / "access.jsonl"
    first = datetime(2026, 11, 29, 9, 41, 49, 966000, tzinfo=timezone.utc).timestamp()
    now = [first]  # the log's clock: the records' own times
    log = AccessLog(path, max_bytes=1 << 20, backups=5, rotate_s=3600, clock=lambda: now[0])
    log.write(_rec(0, "2026-11-29T09:41:49.966Z"))
    now[0] = first + 500
    log.write(_rec(1, "2026-11-29T09:50:00.000Z"))
    assert log.maybe_rotate(now=first + 3599) is None  # not an hour old yet
    seg = log.maybe_rotate(now=first + 3600)
    assert seg is not None and seg.name == "access-20261129T094149Z-1.jsonl"
    assert _lines([seg]) == ["r0", "r1"] and path.read_bytes() == b""
    assert log.maybe_rotate(now=first + 99999) is None  # an empty active file is not cut
    log.write(_rec(2, "2026-11-29T09:41:49.000Z"))  # same second: the next segment gets the next number
    now[0] = first + 3600 + 500
    log.write(_rec(3, "2026-11-29T09:41:49.500Z"))  # a write past the age cuts first, then lands in a fresh file
    assert _lines([tmp_path / "access-20261129T094149Z-2.jsonl"]) == ["r2"] and _lines([path]) == ["r3"]
    assert log.rotate().name == "access-20261129T094149Z-3.jsonl"
    assert [s.name for s in segments(path)] == [f"access-20261129T094149Z-{n}.jsonl" for n in (1, 2, 3)]
    log.close()


def test_rotation_on_size_keeps_every_line_once_in_order(tmp_path):
    path = tmp_path / "access.jsonl"
    log = AccessLog(path, max_bytes=1024, backups=100, rotate_s=0)
    for i in range(60):
        log.write(_rec(i))
    log.close()
    segs = segments(path)
    assert len(segs) > 3 and all(s.stat().st_size <= 1024 for s in segs)
    assert _lines(segs + [path]) == [f"r{i}" for i in range(60)]


def test_a_second_writer_follows_a_rotation_made_by_the_first(tmp_path):
    """Blue and green servers append to one file; after one cuts a segment, the other writes to the new file."""
    path = tmp_path / "access.jsonl"
    blue = AccessLog(path, max_bytes=1 << 20, backups=5, rotate_s=0)
    green = AccessLog(path, max_bytes=1 << 20, backups=5, rotate_s=0)
    blue.write(_rec(0))
    green.write(_rec(1))
    seg = blue.rotate()
    frozen = seg.read_bytes()
    green.write(_rec(2))  # green still held the file that became the segment
    blue.write(_rec(3))
    assert seg.read_bytes() == frozen and _lines([seg]) == ["r0", "r1"]
    assert _lines([path]) == ["r2", "r3"]
    blue.close()
    green.close()


def test_shipped_segments_are_deleted_and_unshipped_ones_kept_up_to_the_budget(tmp_path, caplog):
    path = tmp_path / "access.jsonl"
    log = AccessLog(path, max_bytes=1024, backups=3, rotate_s=0)
    cut = []
    for i in range(3):
        log.write(_rec(i))
        cut.append(log.rotate())
    assert segments(path) == cut
    assert mark_shipped(cut[0], "ab" * 32, identity(cut[0]))
    assert shipped_marker(cut[0]).read_text().strip() == "ab" * 32 and segments(path) == cut[1:]
    log.write(_rec(3))
    cut.append(log.rotate())  # a rotation sweeps what is shipped
    assert not cut[0].exists() and not shipped_marker(cut[0]).exists() and segments(path) == cut[1:]
    assert log.dropped == []
    # past backups x max_bytes of unshipped segments the oldest goes, and says so
    for i in range(4, 40):
        log.write(_rec(i))
        log.rotate()
    assert sum(s.stat().st_size for s in segments(path)) <= 3 * 1024 and log.dropped
    assert cut[1].name in log.dropped and "before it was shipped" in caplog.text
    log.close()


def test_a_segment_replaced_after_it_was_hashed_is_not_marked(tmp_path):
    path = tmp_path / "access.jsonl"
    log = AccessLog(path, max_bytes=1 << 20, backups=5, rotate_s=0)
    log.write(_rec(0))
    seg = log.rotate()
    seen = identity(seg)
    seg.unlink()  # retention deleted it while it shipped ...
    log.write(_rec(1))
    again = log.rotate()  # ... and the next cut took the free name
    assert again == seg and not mark_shipped(seg, "00" * 32, seen) and segments(path) == [seg]
    assert remove_shipped(path) == [] and seg.exists()
    log.close()


def test_backups_zero_keeps_no_segment(tmp_path):
    path = tmp_path / "access.jsonl"
    log = AccessLog(path, max_bytes=1024, backups=0, rotate_s=0)
    for i in range(40):
        log.write(_rec(i))
    log.close()
    assert segments(path) == [] and path.stat().st_size <= 1024


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs: a disk that fills after a few dozen records (root only, as the multi-host tests)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (m := subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True)).returncode:
        lacking(f"mounting a tmpfs failed: {m.stderr.strip()}", "run the tests as root, as .ci/run does")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_loses_no_request_leaves_no_half_line_and_is_counted(engine_dir, tiny_disk):
    """The access-log disk fills mid-traffic: every request is still answered 200, the log holds only whole lines,
    the refused records are counted (edgeflow_access_log_dropped_records_total, the alert's input) and the log
    writes again once space is freed."""
    from tests.helpers.live_server import LiveServer

    log = tiny_disk / "access.jsonl"
    body = {"model": "tiny-edge", "messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 2}
    with LiveServer(engine_dir, model_name="tiny-edge", access_log=log, access_log_max_bytes=1 << 20) as s:
        statuses = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).status_code for _ in range(40)]
        assert statuses == [200] * 40
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        dropped = float(next(l.split()[1] for l in metrics.splitlines() if l.startswith("edgeflow_access_log_dropped_records_total ")))
        assert dropped > 0 and "edgeflow_access_log_writable 0.0" in metrics
        assert httpx.get(f"{s.url}/health", timeout=30).json()["status"] == "healthy"
        lines = log.read_bytes().split(b"\n")
        assert lines[-1] == b"" and all(json.loads(l)["status"] == 200 for l in lines[:-1])  # whole lines only
        assert len(lines) - 1 + dropped == 40
        # room again (the shipper took a segment): the next record is written and the gauge says so
        log.write_bytes(b"")
        assert httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert "edgeflow_access_log_writable 1.0" in httpx.get(f"{s.url}/metrics", timeout=10).text
        assert len(log.read_bytes().splitlines()) == 1
