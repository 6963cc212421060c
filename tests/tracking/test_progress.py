"""LoopProgress outside a Prefect run: log lines at each tenth with the ETA (inside a run the same lines go to the run's
log and a progress artifact follows the loop; the release e2e test reads those back through the API)."""
from __future__ import annotations

import logging

from edgeflow.tracking.progress import LoopProgress, duration as _duration


def test_a_line_at_every_tenth_with_counts_and_an_eta(caplog, monkeypatch) -> None:
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("edgeflow.tracking.progress.time.monotonic", lambda: next(clock))
    caplog.set_level(logging.INFO, logger="edgeflow.progress")
    p = LoopProgress("distillation", 25, "steps")
    for done in range(1, 26):
        p.update(done)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10  # 3, 5, 8, 10, 13, 15, 18, 20, 23, 25 of 25
    assert lines[0].startswith("distillation: 3/25 steps, ") and lines[0].endswith("left (12%)")
    assert lines[-1].startswith("distillation: 25/25 steps, ") and "left" not in lines[-1] and lines[-1].endswith("(100%)")


def test_a_resumed_loop_counts_its_rate_from_where_it_resumed(monkeypatch) -> None:
    t = [0.0]
    monkeypatch.setattr("edgeflow.tracking.progress.time.monotonic", lambda: t[0])
    p = LoopProgress("distillation", 100, "steps", start=50)
    t[0] = 10.0  # 10 steps in 10 s since the resume: 40 left take 40 s, not the 80 s a rate over 60 steps would give
    assert p.describe(60) == "distillation: 60/100 steps, 10 s, about 40 s left"


def test_durations_read_as_minutes_and_seconds() -> None:
    assert _duration(59.4) == "59 s" and _duration(61) == "1 min 01 s" and _duration(-3) == "0 s"
