"""nightly: recalibration from the edge devices' access logs.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from edgeflow.profile.base import _Strict


class NightlyConfig(_Strict):
    """Nightly recalibration from the edge devices' access logs."""

    logs_source: Literal["store", "dir"] = Field(
        default="store",
        description="Where the window's access logs come from: `store`, the segments each device ships to the artifact "
        "store (the ship-logs flow, edgeflow/device/logship.py); `dir`, the folder `logs_dir` (a single box, the demo).",
    )
    logs_dir: str = Field(
        default="data/access_logs",
        description="Folder of access logs read when logs_source is `dir` (or a flow run names one).",
    )
    window_hours: float = Field(default=24, gt=0, description="Read the requests of this many hours before the run's `until`.")
    domain: str = Field(default="chat", description="Calibration domain the cleaned traffic replaces (the other domains keep their sources).")
    min_records: int = Field(
        default=32, ge=1, description="Fewer clean requests than this in the window: the night is skipped, not failed.",
    )
    base_alias: str = Field(
        default="production",
        description="Registry alias whose student is re-quantized; falls back to `staging` when it is not set yet.",
    )
    max_late_h: float | None = Field(
        default=2, gt=0,
        description="A scheduled night that starts more than this many hours after its scheduled time is skipped, with "
        "the reason, not run: a host that was off overnight (its workers down) runs the 02:30 night when they start, "
        "hours late, where it held the model's release lock against the release started by hand (`make demo` refused "
        "after a 2.5 h late start, 2-core AMD EPYC). None: run however late. A run created by hand is late only if it "
        "waited that long for a worker.",
    )
    auto_promote: bool = Field(
        default=False,
        description="Deploy and move `production` when the new version beats the current production one on the gate "
        "(higher top-1 agreement, no higher KL); otherwise only `staging` moves.",
    )
