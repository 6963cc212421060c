"""Access logs come home: a device ships its rotated access-log segments to the artifact store; the nightly fetches them.

    python -m edgeflow.device.logship ship --profile configs/demo-cpu.yaml        # on a device (its device.yaml)
    python -m edgeflow.device.logship fetch --since 2026-11-29T00:00:00Z --until 2026-11-30T00:00:00Z --dest /tmp/logs

The edge server cuts its access log into immutable segments (edgeflow/serving/access_log.py) that are PII-scrubbed as written.
Each device has one MLflow run in the `edgeflow-access-logs` experiment, found by its `edgeflow.device_id` tag
(created on first ship). Shipping a segment uploads it as `segments/<sha256>.jsonl`, then adds its entry
{file, sha256, first_ts, last_ts, lines} to the run's `manifest.json`, then marks it shipped on the device (which
then deletes it). The manifest is keyed by sha256, so a retry after a crash anywhere in between re-uploads the same
bytes under the same name or only marks: no line is lost and none is counted twice. A reader takes the segments
whose [first_ts, last_ts] overlaps its window and checks each against the sha256 its manifest entry names.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.serving.access_log import identity, mark_shipped, remove_shipped, segments
from edgeflow.calibration.access_logs import _lines, _parse_ts
from edgeflow.tracking.artifacts import ArtifactRef, ChecksumError, sha256_file
from edgeflow.profile import Profile
from edgeflow.device.state import access_log_path  # the one owner of the device layout (re-exported for callers here)
from edgeflow.device.identity import DeviceConfig, device_profile

EXPERIMENT = "edgeflow-access-logs"
DEVICE_TAG = "edgeflow.device_id"
MANIFEST = "manifest.json"
SEGMENTS_DIR = "segments"
SEGMENT_KIND = "access-log-segment"


class SegmentEntry(BaseModel):
    """One shipped segment, as the device's manifest lists it."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="The segment's name on the device (access-<UTC stamp of its first line>-<n>.jsonl).")
    sha256: str = Field(description="Content hash; the segment is stored as segments/<sha256>.jsonl.")
    first_ts: str | None = Field(description="Earliest record `ts` (ISO 8601, UTC); None when no line has a readable one.")
    last_ts: str | None = Field(description="Latest record `ts` (ISO 8601, UTC); None when no line has a readable one.")
    lines: int = Field(description="Lines in the segment (every line, readable or not).")
    untimed: int = Field(default=0, description="Lines without a readable `ts` (shipped as they are; ingestion counts "
                         "them malformed).")


class ShipReport(BaseModel):
    """What one ship of one device did."""

    model_config = ConfigDict(extra="forbid")

    device_id: str = Field(description="The device shipped.")
    run_id: str = Field(description="The device's MLflow run in the edgeflow-access-logs experiment.")
    log: str = Field(description="The access log whose segments were shipped (on the device).")
    uploaded: list[SegmentEntry] = Field(default_factory=list, description="Segments uploaded by this ship.")
    already_stored: list[str] = Field(
        default_factory=list, description="Segments the manifest already held (an earlier ship stopped before marking): only marked.",
    )
    lines: int = Field(default=0, description="Lines this ship added to the store (the uploaded segments' lines).")
    removed: list[str] = Field(default_factory=list, description="Shipped segments deleted from the device.")
    problems: list[str] = Field(
        default_factory=list, description="Segments not shipped or shipped with a caveat, each with the reason.",
    )


class DeviceSegments(BaseModel):
    """One device's segments of a window, fetched and verified."""

    model_config = ConfigDict(extra="forbid")

    device_id: str = Field(description="The device that shipped them.")
    paths: list[str] = Field(description="The verified local copies, oldest first.")
    lines: int = Field(description="Lines in them (every line; ingestion decides which fall in the window).")
    segments: list[SegmentEntry] = Field(description="Their manifest entries, in the order of `paths`.")


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def describe(segment: Path) -> SegmentEntry:
    """The manifest entry of one segment: its sha256, line count and first/last record time."""
    times: list[datetime] = []
    lines = _lines(segment)
    for raw in lines:
        try:
            rec = json.loads(raw)
            t = _parse_ts(rec["ts"]) if isinstance(rec, dict) and isinstance(rec.get("ts"), str) else None
        except (ValueError, RecursionError):
            t = None
        if t is not None and t.tzinfo is not None:
            times.append(t)
    return SegmentEntry(file=segment.name, sha256=sha256_file(segment), first_ts=_iso(min(times)) if times else None,
                        last_ts=_iso(max(times)) if times else None, lines=len(lines), untimed=len(lines) - len(times))


def device_run(client: Any, device_id: str, create: bool = True) -> str | None:
    """The device's run in the edgeflow-access-logs experiment (the oldest, should two exist), created if missing."""
    from edgeflow.tracking.runs import experiment_id, find_experiment_id

    exp = experiment_id(client, EXPERIMENT) if create else find_experiment_id(client, EXPERIMENT)
    if exp is None:
        return None
    found = client.search_runs([exp], f"tags.`{DEVICE_TAG}` = '{device_id}'", max_results=1, order_by=["attributes.start_time ASC"])
    if found:
        return found[0].info.run_id
    if not create:
        return None
    run = client.create_run(exp, run_name=f"access logs {device_id}", tags={DEVICE_TAG: device_id})
    client.set_terminated(run.info.run_id, "FINISHED")  # a ledger, not a running job: artifacts are still logged to it
    return run.info.run_id


def read_manifest(client: Any, run_id: str) -> dict[str, SegmentEntry]:
    """The run's manifest, keyed by sha256 ({} before the first ship)."""
    if not any(f.path == MANIFEST for f in client.list_artifacts(run_id)):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        data = json.loads(Path(client.download_artifacts(run_id, MANIFEST, tmp)).read_text())
    return {e["sha256"]: SegmentEntry.model_validate(e) for e in data["segments"]}


def upload_segments(client: Any, run_id: str, device_id: str, batch: list[tuple[Path, SegmentEntry]],
                    manifest: dict[str, SegmentEntry]) -> list[SegmentEntry]:
    """Upload each segment as segments/<sha256>.jsonl, then the manifest with their entries added; marks nothing.
    Returns the entries added (those whose sha256 the manifest did not hold)."""
    from edgeflow.tracking.store import link_or_copy

    added: dict[str, SegmentEntry] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seg, entry in batch:
            if entry.sha256 in manifest or entry.sha256 in added:
                continue
            staged = Path(tmp) / f"{entry.sha256}.jsonl"
            link_or_copy(seg, staged)
            client.log_artifact(run_id, str(staged), SEGMENTS_DIR)
            staged.unlink()
            added[entry.sha256] = entry
    if added:
        merged = list(manifest.values()) + list(added.values())
        client.log_dict(run_id, {"device_id": device_id, "segments": [e.model_dump() for e in merged]}, MANIFEST)
    return list(added.values())


@contextmanager
def _one_shipper(log: Path) -> Iterator[None]:
    """One ship at a time per device (two would each rewrite the manifest from what they read)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.with_name(".ship.lock"), "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ship_segments(profile: Profile, device: DeviceConfig) -> ShipReport:
    """Ship every rotated, unshipped segment of this device's access log; mark and delete what the store holds.

    `profile` is the shared profile or the device's own (device_profile is applied; applying it twice changes nothing).
    Raises ConnectionError before touching anything when the tracking server does not answer.
    """
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import tracking_uri
    from edgeflow.tracking.store import check_reachable

    log = access_log_path(device_profile(profile, device))
    check_reachable(tracking_uri())
    client = MlflowClient(tracking_uri())
    with _one_shipper(log):
        run_id = device_run(client, device.id)
        report = ShipReport(device_id=device.id, run_id=run_id, log=str(log))
        manifest = read_manifest(client, run_id)
        todo: list[tuple[Path, tuple[int, int, int], SegmentEntry]] = []
        for seg in segments(log):
            try:
                ident = identity(seg)
                entry = describe(seg)
            except FileNotFoundError:
                report.problems.append(f"{seg.name}: deleted by the access log's retention budget before it shipped "
                                       "(access_log_backups x access_log_max_bytes); its lines are lost")
                continue
            if entry.untimed:
                report.problems.append(f"{seg.name}: {entry.untimed} of {entry.lines} lines have no readable `ts`; shipped "
                                       "as they are (ingestion counts them malformed)")
            if entry.first_ts is None:
                report.problems.append(f"{seg.name}: no line has a readable `ts`, so no night's window selects it")
            todo.append((seg, ident, entry))
        report.uploaded = upload_segments(client, run_id, device.id, [(s, e) for s, _, e in todo], manifest)
        report.lines = sum(e.lines for e in report.uploaded)
        for seg, ident, entry in todo:
            if entry.sha256 in manifest:
                report.already_stored.append(seg.name)
            if not mark_shipped(seg, entry.sha256, ident):
                report.problems.append(f"{seg.name}: changed or deleted on the device after it was hashed; not marked, "
                                       "the next ship takes what is there now")
        report.removed = remove_shipped(log)
    return report


def _overlaps(entry: SegmentEntry, start: datetime, end: datetime) -> bool:
    if entry.first_ts is None or entry.last_ts is None:
        return False
    return _parse_ts(entry.first_ts) < end and _parse_ts(entry.last_ts) >= start


def _hashes(e: ChecksumError) -> str:
    """The two hashes of edgeflow.tracking.store.materialize's message ("downloaded sha256 … does not match …")."""
    first = str(e).split("; ")[0]
    return first[first.find("downloaded sha256"):].replace("the reference's", "the manifest's")


def fetch_segments(window_start: datetime, window_end: datetime, dest: Path) -> list[DeviceSegments]:
    """Every device's shipped segments that overlap [window_start, window_end), downloaded to dest/<device id>/ and each
    checked against the sha256 of its manifest entry (ChecksumError names the device, the segment and both hashes)."""
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import find_experiment_id, tracking_uri
    from edgeflow.tracking.store import link_or_copy, materialize

    client = MlflowClient(tracking_uri())
    exp = find_experiment_id(client, EXPERIMENT)
    if exp is None:
        return []
    by_device: dict[str, dict[str, tuple[str, SegmentEntry]]] = {}
    for run in client.search_runs([exp], f"tags.`{DEVICE_TAG}` != ''", max_results=10000, order_by=["attributes.start_time ASC"]):
        device_id = run.data.tags[DEVICE_TAG]
        for sha, entry in read_manifest(client, run.info.run_id).items():
            if _overlaps(entry, window_start, window_end):
                by_device.setdefault(device_id, {}).setdefault(sha, (run.info.artifact_uri.rstrip("/"), entry))
    out = []
    for device_id, found in sorted(by_device.items()):
        entries = sorted(found.values(), key=lambda v: (v[1].first_ts, v[1].file))
        paths = []
        for base, entry in entries:
            ref = ArtifactRef(kind=SEGMENT_KIND, uri=f"{base}/{SEGMENTS_DIR}/{entry.sha256}.jsonl", sha256=entry.sha256,
                              meta={"device_id": device_id, "file": entry.file})
            try:
                local = materialize(ref)
            except ChecksumError as e:
                raise ChecksumError(
                    f"device {device_id}: access-log segment {entry.file} ({ref.uri}) fails its sha256 check against "
                    f"{MANIFEST}: {_hashes(e)}. The store's copy was changed or damaged after "
                    "the device shipped it, and the device deleted its own once shipped: restore the file from a backup of "
                    f"the artifact store, or remove its entry from {MANIFEST} of that device's run to read the window without it."
                ) from None
            target = Path(dest) / device_id / entry.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            link_or_copy(local, target)
            paths.append(str(target))
        out.append(DeviceSegments(device_id=device_id, paths=paths, lines=sum(e.lines for _, e in entries),
                                  segments=[e for _, e in entries]))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ship", help="ship this device's rotated segments")
    s.add_argument("--profile", default="configs/demo-cpu.yaml")
    f = sub.add_parser("fetch", help="download and verify every device's segments of a window")
    f.add_argument("--since", required=True)
    f.add_argument("--until", required=True)
    f.add_argument("--dest", type=Path, required=True)
    a = ap.parse_args()
    if a.cmd == "ship":
        from edgeflow.preflight import load_profile
        from edgeflow.device.identity import load_device

        print(ship_segments(load_profile(a.profile), load_device(required=True)).model_dump_json(indent=1))
    else:
        got = fetch_segments(_parse_ts(a.since), _parse_ts(a.until), a.dest)
        print(json.dumps([d.model_dump() for d in got], indent=1))
