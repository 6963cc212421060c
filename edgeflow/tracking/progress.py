"""Progress of a long loop inside a stage (distillation steps, gate sequences, reference sequences).

`LoopProgress(what, total)` logs a line at every tenth with the elapsed time and the ETA, and, when a sink is
installed and the loop runs inside a run the sink knows (`install_sink`), reports a progress bar through it at most
every `every_s` seconds. The pipeline installs Prefect's (edgeflow/pipeline/progress.py: a progress artifact on the
run's Artifacts tab, lines to the run's log) in every stage process; without one the lines go to the
`edgeflow.progress` logger. A failure to report is logged once and never fails the stage. The domain packages that
report progress (distill, evaluation) thus never import the orchestrator.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

logger = logging.getLogger("edgeflow.progress")


def duration(s: float) -> str:
    """Seconds as a person reads them: `59 s`, `1 min 01 s`."""
    s = max(0, int(round(s)))
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class ProgressSink(Protocol):
    """Where a loop's bar goes: a run's progress artifact (the pipeline's Prefect sink) or anything alike."""

    logger: Any  # what the tenth lines are logged to (the run's logger)

    def create(self, percent: float, description: str) -> Any:
        """A new bar at `percent`; returns its handle."""

    def update(self, handle: Any, percent: float, description: str) -> None:
        """Move the bar `handle` to `percent`."""


_sink_factory: Callable[[], ProgressSink | None] | None = None


def install_sink(factory: Callable[[], ProgressSink | None] | None) -> None:
    """Report every later loop's bar through `factory()` (None: no run to report to, log lines only)."""
    global _sink_factory
    _sink_factory = factory


class LoopProgress:
    """A long loop's progress: tenth-by-tenth log lines with the ETA, and the installed sink's bar (see the module doc)."""

    def __init__(self, what: str, total: int, unit: str = "steps", every_s: float = 2.0, start: int = 0):
        self.what, self.unit, self.total, self.every_s = what, unit, max(int(total), 1), every_s
        self.start = start  # items already done before this process began (a resumed run): not in the ETA's rate
        self.t0 = time.monotonic()
        self._sent = float("-inf")
        self._tenth = 10 * start // self.total
        self._artifact: Any = None
        self._log: Any = logger
        self._sink: ProgressSink | None = None
        try:
            self._sink = _sink_factory() if _sink_factory is not None else None
            if self._sink is None:
                return
            self._log = self._sink.logger
            self._artifact = self._sink.create(100.0 * start / self.total, self.describe(start))
            self._sent = time.monotonic()
        except Exception as e:  # progress is a view: never the reason a stage fails
            logger.warning("progress for %s not reported: %s", what, e)
            self._artifact = None

    def describe(self, done: int) -> str:
        elapsed = time.monotonic() - self.t0
        text = f"{self.what}: {done}/{self.total} {self.unit}, {duration(elapsed)}"
        if self.start < done < self.total:
            text += f", about {duration(elapsed / (done - self.start) * (self.total - done))} left"
        return text

    def update(self, done: int) -> None:
        """`done` items of `total` are finished (call it after each; it sends only every `every_s` and at the end)."""
        if self._tenth < 10 and done >= self._tenth_mark(self._tenth + 1):
            while self._tenth < 10 and done >= self._tenth_mark(self._tenth + 1):
                self._tenth += 1
            self._log.info("%s (%d%%)", self.describe(done), 100 * min(done, self.total) // self.total)
        if self._artifact is None:
            return
        now = time.monotonic()
        if done < self.total and now - self._sent < self.every_s:
            return
        try:
            self._sink.update(self._artifact, min(100.0, 100.0 * done / self.total), self.describe(done))
            self._sent = now
        except Exception as e:
            logger.warning("progress for %s not reported: %s", self.what, e)
            self._artifact = None

    def _tenth_mark(self, k: int) -> int:
        return -(-self.total * k // 10)  # ceil(total * k / 10)
