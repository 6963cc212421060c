"""What one app's handlers share: the engine runtime, settings, metrics, admission, the access log
(PII scrubbed before a record is written) and the generations still open.

    state = AppState(runtime, settings); state.log({"ts": utc_now(), "kind": "feedback", ...})
"""
from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from edgeflow.serving.access_log import AccessLog
from edgeflow.serving.admission import Admission
from edgeflow.serving.metrics import Metrics
from edgeflow.pii import scrub_value

log = logging.getLogger("edgeflow.serving")

if TYPE_CHECKING:
    from edgeflow.serving.settings import ServerSettings
    from edgeflow.serving.runtime import Generation, Runtime


def utc_now() -> str:
    """The `ts` of an access-log record: UTC, milliseconds, Z."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AppState:
    """One app's shared state; its handlers get it passed in (create_app builds one per engine)."""

    def __init__(self, runtime: Runtime, settings: ServerSettings) -> None:
        self._access_log_warned = float("-inf")
        self.runtime = runtime
        self.settings = settings
        self.metrics = Metrics()
        self.admission = Admission(settings.max_concurrency, settings.max_queue)
        self.access_log = (
            AccessLog(settings.access_log, settings.access_log_max_bytes, settings.access_log_backups,
                      settings.access_log_rotate_s)
            if settings.access_log
            else None
        )
        self.generations: set[Generation] = set()
        self.metrics.in_flight.set_function(lambda: self.admission.active)
        self.metrics.queue_depth.set_function(lambda: self.admission.waiting)
        self.metrics.device_memory.set_function(runtime.device_memory_used)
        self.metrics.engine.info(
            {"backend": runtime.meta["backend"], "engine_version": runtime.engine_version, "model": settings.model_name or ""}
        )
        restarts = os.environ.get("EDGEFLOW_SERVER_RESTARTS", "0")
        self.metrics.restarts.set(int(restarts) if restarts.isdigit() else 0)

    # The fields of a record that carry client or model text (ids, timings and versions carry none).
    TEXT_FIELDS = ("messages", "prompt", "response", "error", "comment")

    def log(self, record: dict[str, Any]) -> None:
        """Write one access-log record, PII and secrets scrubbed first (edgeflow.pii) unless scrub_access_log
        is off: raw prompts never rest on the device. What was replaced is counted in `pii_scrubbed`."""
        if self.access_log is None:
            return
        if self.settings.scrub_access_log:
            found: dict[str, int] = {}
            for key in self.TEXT_FIELDS:
                if record.get(key) is not None:
                    record[key], hits = scrub_value(record[key])
                    for kind, n in hits.items():
                        found[kind] = found.get(kind, 0) + n
            record["pii_scrubbed"] = found
        try:
            self.access_log.write(record)
        except OSError as e:  # a full disk must not fail the request that was already served
            self.metrics.access_log_dropped.inc()
            self.metrics.access_log_writable.set(0)
            now = time.monotonic()
            if now - self._access_log_warned > 60:  # once a minute, not once a request
                self._access_log_warned = now
                log.error("access log %s: record not written (%s); serving continues, and the records are counted in "
                          "edgeflow_access_log_dropped_records_total: free space on that disk or ship the log "
                          "(edgeflow/pipeline/ship_logs.py)", self.access_log.path, e)
            return
        self.metrics.access_log_writable.set(1)

    def engine_stalled(self, reason: str) -> None:
        """The watchdog fired: fail the probes and end every open generation with the reason."""
        self.runtime.state, self.runtime.reason = "failed", reason
        for gen in list(self.generations):
            gen.fail(reason)
