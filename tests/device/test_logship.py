"""Access logs come home: devices ship their segments to a real MLflow server, the nightly fetches them verified."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from edgeflow.serving.access_log import AccessLog, segments
from edgeflow.tracking.artifacts import ChecksumError
from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile
from edgeflow.device.identity import DeviceConfig
from edgeflow.device.logship import (
    access_log_path, describe, device_run, fetch_segments, read_manifest, ship_segments, upload_segments,
)

T0 = datetime(2026, 11, 29, 8, 0, tzinfo=timezone.utc)
TAMPERED = T0 - timedelta(days=30)  # the tampered segment's day: no other test's window reaches it


@pytest.fixture
def store(mlflow_tracking, tmp_path, monkeypatch) -> str:
    """The session's MLflow server, and an artifact cache of this test's own (a fetch downloads, not reuses)."""
    monkeypatch.setenv("EDGEFLOW_HOME", str(tmp_path / "home"))
    return mlflow_tracking


def _device(tmp_path: Path, name: str) -> DeviceConfig:
    # unique per test: the MLflow server is the session's, and each device keeps one run in it
    return DeviceConfig(id=f"{name}-{uuid.uuid4().hex[:8]}", deploy={"install_dir": str(tmp_path / name)})


def _profile():
    return load_profile(REPO_ROOT / "configs" / "test-tiny.yaml")


def _ts(minutes: float, base: datetime = T0) -> str:
    return (base + timedelta(minutes=minutes)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write(log: AccessLog, device: str, start: int, n: int, base: datetime = T0) -> list[str]:
    """n request lines, one a minute from base + start minutes; returns their ids."""
    ids = []
    for i in range(start, start + n):
        rid = f"{device}-{i}"
        log.write({"ts": _ts(i, base), "id": rid, "kind": "request", "status": 200, "response": f"answer {i}",
                   "messages": [{"role": "user", "content": f"question number {i} from {device}"}]})
        ids.append(rid)
    return ids


def stored_ids(device_id: str, dest: Path) -> list[str]:
    """Every line the store holds for the device (all its segments, whatever their window)."""
    got = [d for d in fetch_segments(T0 - timedelta(days=1), T0 + timedelta(days=1), dest) if d.device_id == device_id]
    return [json.loads(x)["id"] for d in got for p in d.paths for x in Path(p).read_text().splitlines()]


def _devprof(profile, device):
    from edgeflow.device.identity import device_profile

    return device_profile(profile, device)


def _client():
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import tracking_uri

    return MlflowClient(tracking_uri())


def _open(profile, device: DeviceConfig, max_bytes: int = 1 << 20) -> AccessLog:
    """The device's access log as its edge server opens it (rotation on age off: the tests cut segments themselves)."""
    return AccessLog(access_log_path(_devprof(profile, device)), max_bytes=max_bytes, backups=50, rotate_s=0)


def test_shipping_across_rotations_stores_every_line_exactly_once(store, tmp_path):
    profile, device = _profile(), _device(tmp_path, "orin-a")
    log = _open(profile, device, max_bytes=2048)  # small segments: a size rotation every dozen lines
    written = write(log, device.id, 0, 40)
    log.rotate()
    first = ship_segments(profile, device)
    assert first.lines == sum(e.lines for e in first.uploaded) and not first.problems
    active = write(log, device.id, 40, 25)  # more lines, some still in the active file when the next ship runs
    log.rotate()
    written += active
    second = ship_segments(profile, device)
    assert first.lines + second.lines == len(written) and len(first.uploaded) > 1 and len(second.uploaded) > 1
    assert segments(access_log_path(_devprof(profile, device))) == [] and second.removed  # shipped ones are gone
    assert ship_segments(profile, device).uploaded == []  # nothing left to ship
    ids = stored_ids(device.id, tmp_path / "fetched")
    assert sorted(ids) == sorted(written) and len(ids) == len(set(ids))
    manifest = read_manifest(_client(), first.run_id)
    assert sum(e.lines for e in manifest.values()) == len(written)
    log.close()


def test_a_retry_after_a_crash_between_upload_and_marking_counts_nothing_twice(store, tmp_path):
    profile, device = _profile(), _device(tmp_path, "orin-b")
    log = _open(profile, device)
    written = write(log, device.id, 0, 12)
    log.rotate()
    written += write(log, device.id, 12, 9)
    log.rotate()
    path = access_log_path(_devprof(profile, device))
    c = _client()
    run_id = device_run(c, device.id)
    # the upload step of a ship that then died: segments and manifest in the store, nothing marked on the device
    upload_segments(c, run_id, device.id, [(s, describe(s)) for s in segments(path)], read_manifest(c, run_id))
    assert len(segments(path)) == 2
    retry = ship_segments(profile, device)
    assert retry.uploaded == [] and retry.lines == 0 and len(retry.already_stored) == 2 and segments(path) == []
    assert sum(e.lines for e in read_manifest(c, run_id).values()) == len(written) == 21
    ids = stored_ids(device.id, tmp_path / "fetched")
    assert sorted(ids) == sorted(written)
    log.close()


def test_two_devices_ship_and_a_window_fetch_returns_each_devices_lines(store, tmp_path):
    profile = _profile()
    a, b = _device(tmp_path, "orin-c"), _device(tmp_path, "orin-d")
    logs = {a.id: _open(profile, a), b.id: _open(profile, b)}
    written = {a.id: write(logs[a.id], a.id, 0, 30), b.id: write(logs[b.id], b.id, 5, 17)}
    for dev in (a, b):
        logs[dev.id].rotate()
        ship_segments(profile, dev)
    late = write(logs[a.id], a.id, 600, 4)  # ten hours later: outside the window below
    logs[a.id].rotate()
    ship_segments(profile, a)
    got = {d.device_id: d for d in fetch_segments(T0, T0 + timedelta(hours=2), tmp_path / "fetched")}
    assert {a.id, b.id} <= set(got)
    for dev in (a, b):
        ids = [json.loads(x)["id"] for p in got[dev.id].paths for x in Path(p).read_text().splitlines()]
        assert ids == written[dev.id] and got[dev.id].lines == len(written[dev.id])
        assert all(Path(p).parent.name == dev.id for p in got[dev.id].paths)
    assert not set(late) & {json.loads(x)["id"] for p in got[a.id].paths for x in Path(p).read_text().splitlines()}
    for log in logs.values():
        log.close()


def test_a_tampered_segment_in_the_store_fails_its_sha256_check(store, mlflow_server, tmp_path):
    profile, device = _profile(), _device(tmp_path, "orin-e")
    log = _open(profile, device)
    write(log, device.id, 0, 6, base=TAMPERED)
    log.rotate()
    log.close()
    entry = ship_segments(profile, device).uploaded[0]
    stored = next((mlflow_server.log.parent / "artifacts").rglob(f"{entry.sha256}.jsonl"))
    original = stored.read_bytes()
    stored.write_bytes(original.replace(b'"answer 3"', b'"answer 4"'))  # one edited line in the store's copy
    try:
        with pytest.raises(ChecksumError) as e:
            fetch_segments(TAMPERED, TAMPERED + timedelta(hours=1), tmp_path / "fetched")
    finally:
        stored.write_bytes(original)
    msg = str(e.value)
    assert f"device {device.id}: access-log segment {entry.file}" in msg and "fails its sha256 check" in msg
    assert f"does not match the manifest's {entry.sha256}" in msg and "downloaded sha256" in msg
