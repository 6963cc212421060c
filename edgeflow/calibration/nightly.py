"""Nightly recalibration: yesterday's traffic in, a derived profile (and whether it may replace production) out.

    python -m edgeflow.calibration.nightly data/access_logs --until 2026-11-30T00:00:00Z   # what tonight's window would keep

The window's access logs come from the artifact store, where each device ships its rotated segments
(edgeflow/device/logship.py, `nightly.logs_source: store`), or from a folder (`dir`: `nightly.logs_dir`, a single box).
They are cleaned by `edgeflow.calibration.access_logs.ingest` (PII scrubbed, de-duplicated,
bounded), stripped of anything that overlaps the gate's evaluation set (production traffic does ask the
eval questions now and then; calibrating on them would inflate every gate metric), and written as one
JSONL snapshot. The snapshot replaces one calibration domain (`nightly.domain`, chat by default) in a
derived profile; the other domains keep their shipped sources, so the 5:3:2 mix stays a mix.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.calibration.access_logs import _lines, _parse_ts, ingest, log_files
from edgeflow.calibration.mix import find_overlap
from edgeflow.profile import Profile


class DeviceSegments(Protocol):
    """One device's shipped access-log segments of the window, as edgeflow.device.logship.fetch_segments returns
    them (its DeviceSegments): what the traffic is read from here."""

    device_id: str
    paths: list[str]


class Traffic(BaseModel):
    """The window's clean traffic, or why there is not enough of it."""

    model_config = ConfigDict(extra="forbid")

    since: str = Field(description="Window start (ISO 8601, UTC, inclusive).")
    until: str = Field(description="Window end (ISO 8601, UTC, exclusive).")
    source: Literal["store", "dir"] = Field(
        default="dir", description="Where the logs came from: the devices' segments in the artifact store, or a folder.")
    logs_dir: str = Field(description="Where the access logs were read (the folder, or where the store's segments were fetched).")
    files: int = Field(description="Access-log files found.")
    per_device: dict[str, int] = Field(
        default_factory=dict, description="Access-log lines read per device (its files overlapping the window; `ingest` "
        "then drops the lines outside it). From a folder, a device is a file's name less .jsonl and any rotation suffix.",
    )
    kept: int = Field(description="Clean requests kept for calibration.")
    dropped_eval_overlap: int = Field(description="Clean requests dropped because they overlap the gate's eval set.")
    ingest: dict = Field(description="Every count of the cleaning (edgeflow.calibration.access_logs.IngestReport).")
    snapshot: str | None = Field(default=None, description="JSONL of the kept requests; None when skipped.")
    skipped: str | None = Field(default=None, description="Why the night is skipped; None when there is enough traffic.")


def parse_time(value: str | None) -> datetime:
    """ISO 8601 (a trailing Z is UTC); None is now."""
    if value is None:
        return datetime.now(timezone.utc)
    t = _parse_ts(value)  # the access logs' own parser: the window and the records read time alike
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


# A rotated file's suffix: access.jsonl.3 (older servers) or access-20261129T094149Z-2.jsonl (a segment).
_ROTATED = re.compile(r"(-\d{8}T\d{6}Z-\d+)?\.jsonl(\.\d+)?$")


def device_of(path: Path) -> str:
    """The device a log file in a folder is from: its name less `.jsonl` and any rotation suffix."""
    return _ROTATED.sub("", Path(path).name) or Path(path).name


def collect_traffic(
    logs: Path | Sequence[DeviceSegments], until: datetime, hours: float, min_records: int, eval_texts: list[str], out: Path,
    tokenizer, fetched_to: Path | None = None,
) -> Traffic:
    """Clean the window's requests, drop eval overlaps, write the snapshot; `skipped` says why not, if not.

    `logs` is a folder of access logs, or the devices' segments of the window as edgeflow.device.logship.fetch_segments
    returns them (`fetched_to`: where they were downloaded, shown in the report).
    """
    from edgeflow.calibration.textdata import record_text

    since = until - timedelta(hours=hours)
    if isinstance(logs, (str, Path)):
        source, logs_dir = "dir", str(logs)
        files = log_files(Path(logs)) if Path(logs).is_dir() else []
        per_device: dict[str, int] = {}
        for f in files:
            per_device[device_of(f)] = per_device.get(device_of(f), 0) + len(_lines(f))
        empty = f"no access logs under {logs}"
    else:
        source, logs_dir = "store", str(fetched_to or "")
        files = [Path(p) for d in logs for p in d.paths]
        per_device = {d.device_id: sum(len(_lines(Path(p))) for p in d.paths) for d in logs}
        empty = (f"no access-log segments shipped between {_iso(since)} and {_iso(until)} (MLflow experiment "
                 "edgeflow-access-logs); devices ship them with the ship-logs flow (edgeflow/pipeline/ship_logs.py)")
    records, report = ingest(files, since, until)
    texts = [record_text(r, tokenizer) for r in records]
    # An eval item "overlaps" one request's text: drop that request (the eval set is the fixed side).
    overlapping = {i for i, t in enumerate(texts) if find_overlap([t], eval_texts)}
    kept = [r for i, r in enumerate(records) if i not in overlapping]
    base = dict(since=_iso(since), until=_iso(until), source=source, logs_dir=logs_dir, files=len(files),
                per_device=per_device, kept=len(kept), dropped_eval_overlap=len(overlapping), ingest=asdict(report))
    if not files:
        return Traffic(**base, skipped=empty)
    if len(kept) < min_records:
        return Traffic(**base, skipped=(
            f"{len(kept)} clean requests between {base['since']} and {base['until']} (of {report.lines} log lines in "
            f"{len(files)} files); nightly.min_records={min_records}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"messages": r["messages"], "response": r["response"], "id": r["id"]}) + "\n" for r in kept))
    return Traffic(**base, snapshot=str(out))


def derive_profile(profile: Profile, snapshot: Path) -> Profile:
    """The profile with `nightly.domain`'s calibration source replaced by the snapshot: an object the nightly hands
    its release (edgeflow/pipeline/chain.py open_release), never a file written and read back."""
    data = profile.settings()  # the fields as written: a default dumped as if set would trip "both set" checks
    domain = profile.nightly.domain  # a known calibration domain: the profile validator checked it
    data["name"] = f"{profile.name}-nightly"
    sources = data.setdefault("calibration", {}).setdefault("sources", dict(profile.calibration.sources))
    sources[domain] = str(Path(snapshot).resolve())
    return Profile.model_validate(data)


def beats(new: dict[str, float], current: dict[str, float]) -> tuple[bool, str]:
    """Pareto-better on the gate: top-1 agreement not lower, KL not higher, and one of them strictly better."""
    d_top1 = new["top1_agreement"] - current["top1_agreement"]
    d_kl = new["kl"] - current["kl"]
    verdict = d_top1 >= 0 and d_kl <= 0 and (d_top1 > 0 or d_kl < 0)
    why = (f"top-1 agreement {new['top1_agreement']:.4f} vs {current['top1_agreement']:.4f} ({d_top1:+.4f}), "
           f"KL {new['kl']:.4f} vs {current['kl']:.4f} ({d_kl:+.4f})")
    return verdict, ("beats production: " if verdict else "does not beat production: ") + why


if __name__ == "__main__":
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs_dir", type=Path)
    ap.add_argument("--until", help="Window end, ISO 8601 (default now).")
    ap.add_argument("--hours", type=float, default=24)
    ap.add_argument("--min-records", type=int, default=32)
    ap.add_argument("--tokenizer", required=True, help="A model directory whose chat template renders the records.")
    ap.add_argument("--out", type=Path, default=Path("nightly-traffic.jsonl"))
    a = ap.parse_args()
    t = collect_traffic(a.logs_dir, parse_time(a.until), a.hours, a.min_records, [], a.out, AutoTokenizer.from_pretrained(a.tokenizer))
    print(t.model_dump_json(indent=1))
