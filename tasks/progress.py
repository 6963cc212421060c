"""Progress of a running release, on both sides of the Prefect API.

    python -m tasks.progress FLOW_RUN_ID        # follow a run that is already going (the view `make demo` shows)

* Inside a stage, `LoopProgress(what, total)` reports a long loop (distillation steps, gate sequences, reference
  sequences): a Prefect progress artifact (the bar the UI shows on the run's Artifacts tab), updated at most every
  `every_s` seconds, and a log line at every tenth with the elapsed time and the ETA (the run's log inside a
  Prefect run, the `edgeflow.progress` logger outside one). A failure to report is logged once and never fails the
  stage.
* `follow(flow_run_id)` is the terminal view: every flow run under the release (inline stages, pool-placed stages,
  at any depth) printed as it starts and ends with its wall time, and every progress artifact under them as a rich
  progress bar, all read from the Prefect API, so stages on other hosts show the same way. It returns the root run
  once it is final.

Why artifacts and the API (not stdout): pool-placed stages run in other processes on other hosts; the API is the
one thing every host and the UI share. The cost: one artifact update every 2 s of a long loop, and the watcher's
three small reads a second (against a release of minutes).
"""
from __future__ import annotations

import os
import logging
import sys
import time
from typing import Any
from uuid import UUID

logger = logging.getLogger("edgeflow.progress")


def _duration(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class LoopProgress:
    """A long loop's progress as a Prefect progress artifact and tenth-by-tenth run-log lines (see the module doc)."""

    def __init__(self, what: str, total: int, unit: str = "steps", every_s: float = 2.0, start: int = 0):
        self.what, self.unit, self.total, self.every_s = what, unit, max(int(total), 1), every_s
        self.start = start  # items already done before this process began (a resumed run): not in the ETA's rate
        self.t0 = time.monotonic()
        self._sent = float("-inf")
        self._tenth = 10 * start // self.total
        self._artifact: UUID | None = None
        self._log: Any = logger
        try:
            from prefect.context import FlowRunContext, TaskRunContext

            if FlowRunContext.get() is None and TaskRunContext.get() is None:
                return
            from prefect.artifacts import create_progress_artifact
            from prefect.logging import get_run_logger

            self._log = get_run_logger()
            self._artifact = create_progress_artifact(100.0 * start / self.total, description=self.describe(start))
            self._sent = time.monotonic()
        except Exception as e:  # progress is a view: never the reason a stage fails
            logger.warning("progress for %s not reported: %s", what, e)
            self._artifact = None

    def describe(self, done: int) -> str:
        elapsed = time.monotonic() - self.t0
        text = f"{self.what}: {done}/{self.total} {self.unit}, {_duration(elapsed)}"
        if self.start < done < self.total:
            text += f", about {_duration(elapsed / (done - self.start) * (self.total - done))} left"
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
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self._artifact, min(100.0, 100.0 * done / self.total), description=self.describe(done))
            self._sent = now
        except Exception as e:
            logger.warning("progress for %s not reported: %s", self.what, e)
            self._artifact = None

    def _tenth_mark(self, k: int) -> int:
        return -(-self.total * k // 10)  # ceil(total * k / 10)


# ------------------------------------------------------------------------------------------ the terminal view


def _descendants(client: Any, root: UUID, known: dict[UUID, Any]) -> dict[UUID, Any]:
    """Every flow run under `root` (subflows at any depth), by id."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    frontier = [root]
    while frontier:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)), limit=200)
        frontier = [r.id for r in children if r.id not in known]
        known.update({r.id: r for r in children})
    return known


def follow(flow_run_id: UUID | str, poll_s: float = 1.0, out: Any = None) -> Any:
    """Print the release's stages as they start and end and draw its progress artifacts, until the run is final."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    root = UUID(str(flow_run_id))
    console = Console(file=out or sys.stdout, highlight=False)
    flows: dict[UUID, str] = {}
    started: set[UUID] = set()
    ended: set[UUID] = set()
    bars: dict[UUID, Any] = {}
    with get_client(sync_client=True) as client, Progress(
        TextColumn("  {task.description}"), BarColumn(), TaskProgressColumn(), console=console, transient=False,
    ) as view:
        while True:
            runs = _descendants(client, root, {})
            for run in sorted(runs.values(), key=lambda r: r.start_time or r.expected_start_time or r.created):
                if run.flow_id not in flows:
                    flows[run.flow_id] = client.read_flow(run.flow_id).name
                name = flows[run.flow_id]
                if run.id not in started and run.start_time is not None:
                    started.add(run.id)
                    view.console.print(f"▶ {name} started" + (f" on pool {run.work_pool_name}" if run.work_pool_name else ""))
                if run.id not in ended and run.state is not None and run.state.is_final():
                    ended.add(run.id)
                    took = run.total_run_time.total_seconds() if run.total_run_time else 0.0
                    view.console.print(f"{'✓' if run.state.is_completed() else '✗'} {name} {run.state.name.lower()} "
                                       f"in {_duration(took)}")
            ids = [root, *runs]
            for art in client.read_artifacts(artifact_filter=ArtifactFilter(
                    type=ArtifactFilterType(any_=["progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=ids)), limit=200):
                if art.id not in bars:
                    bars[art.id] = view.add_task(art.description or "", total=100)
                view.update(bars[art.id], completed=float(art.data or 0), description=art.description or "")
            top = client.read_flow_run(root)
            if top.state is not None and top.state.is_final():
                return top
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m tasks.progress"), description=__doc__.split("\n")[0])
    ap.add_argument("flow_run_id", type=UUID, help="the flow run to follow (the Prefect UI's run page shows its id)")
    ap.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the Prefect API (default 1)")
    a = ap.parse_args(argv)
    run = follow(a.flow_run_id, a.poll_s)
    print(f"{run.name}: {run.state.name if run.state else 'unknown'}")
    return 0 if run.state is not None and run.state.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
