"""Progress of a running release, on both sides of the Prefect API.

    python -m edgeflow.pipeline.progress FLOW_RUN_ID        # follow a run that is already going (the view `make demo` shows)

* Inside a stage, a long loop reports through `edgeflow.tracking.progress.LoopProgress`; `PrefectSink`, installed in
  every stage process (`install`, from edgeflow/pipeline/__init__.py), makes its bar a Prefect progress artifact (the
  bar the UI shows on the run's Artifacts tab) and its tenth lines the run's log.
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
import sys
import time
from typing import Any
from uuid import UUID

from edgeflow.tracking.progress import duration as _duration, install_sink


class PrefectSink:
    """LoopProgress's bar as a Prefect progress artifact of the current flow or task run, its lines in the run's log."""

    def __init__(self) -> None:
        from prefect.logging import get_run_logger

        self.logger = get_run_logger()

    @staticmethod
    def current() -> "PrefectSink | None":
        """A sink for the run this code runs in, or None outside any Prefect run."""
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            return None
        return PrefectSink()

    def create(self, percent: float, description: str) -> UUID:
        from prefect.artifacts import create_progress_artifact

        return create_progress_artifact(percent, description=description)

    def update(self, handle: UUID, percent: float, description: str) -> None:
        from prefect.artifacts import update_progress_artifact

        update_progress_artifact(handle, percent, description=description)


def install() -> None:
    """Every LoopProgress in this process reports through Prefect (edgeflow/pipeline/__init__.py calls it)."""
    install_sink(PrefectSink.current)


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

    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.pipeline.progress"), description=__doc__.split("\n")[0])
    ap.add_argument("flow_run_id", type=UUID, help="the flow run to follow (the Prefect UI's run page shows its id)")
    ap.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the Prefect API (default 1)")
    a = ap.parse_args(argv)
    run = follow(a.flow_run_id, a.poll_s)
    print(f"{run.name}: {run.state.name if run.state else 'unknown'}")
    return 0 if run.state is not None and run.state.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
