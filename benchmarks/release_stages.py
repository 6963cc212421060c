"""Where a release's time goes, stage by stage, from the release's own timestamps (Prefect's and MLflow's).

    python benchmarks/release_stages.py --flow-run <release flow run id>      (services' environment: `services.py env`)
    python benchmarks/release_stages.py reports/<release_id>.json [--server-pidfile .edgeflow/run/edge-server.pid]

For every stage of the release, in the order it ran, one row of seconds:

- `queued`: the stage's flow run created → a worker took it (Scheduled → Pending); inline stages have none;
- `start`: the worker took it → the flow began (Pending → Running): the stage process starting, its imports,
  the pull step;
- `prep`: the flow began → the stage's MLflow run opened: the stage's own imports, the profile, fetching inputs;
- `work`: the stage's MLflow run (`stage_wall_s`): the computation with its uploads and MLflow calls;
- `close`: the MLflow run's end → the flow run's end (result persisted, state set);
- `handoff`: this stage's end → the next stage's flow run created (the release noticing, then submitting).

A stage whose task was a cache hit has no MLflow run of this release: its `work` is empty and its time is `prep`. A
pool-placed stage the release found cached without submitting it (edgeflow/pipeline/stages.py) is the row `<stage> (look-up)`:
the look-up's task run in the release's process, all `prep`.
The row `open` is the release's first seconds (its MLflow run, the profile's files published); the last stage's
`handoff` holds its report; `(release)` is the whole flow run, with its own process start. The sums say how much of
the release is the stages' work and how much fixed cost.

Beside the seconds, each row's calls to the MLflow server, read from that server's own access log (services.py starts
it logging every request; `--mlflow-log`): `api` the tracking calls (runs, params, metrics, tags, registry), `put` and
`get` the artifact uploads and downloads through it, with their bytes read from the files the server stores
(`--artifacts`). A request belongs to the row whose window (its creation to the next row's) holds its second: the log
has whole seconds, so a call within a second of a boundary may be counted in the row beside. Not split out: hashing,
which falls in `prep` and `work`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgeflow.tracking.runs import tracking_uri  # noqa: E402


def _s(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else (b - a).total_seconds()


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


def flow_runs(release_flow_run_id: str) -> tuple[object, list[tuple[object, str, list]]]:
    """The release's flow run; each stage's subflow run with its flow's name and state history, in start order; and
    the release's stage look-ups (task runs)."""
    import asyncio
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    async def read():
        async with get_client() as client:
            top = await client.read_flow_run(UUID(release_flow_run_id))
            # a pool-placed stage is a subflow of the release (run_deployment(as_subflow=True))
            subs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[top.id])))
            out = []
            for r in subs:
                flow = await client.read_flow(r.flow_id)
                out.append((r, flow.name, await client.read_flow_run_states(r.id)))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[top.id])))
            return top, out, [t for t in tasks if t.name.endswith(LOOK_UP)]

    top, subs, look_ups = asyncio.run(read())
    return top, sorted(subs, key=lambda x: x[0].created), look_ups


# The release's look-up of a stage it may not need to submit (edgeflow/pipeline/stages.py run_stage): a task run of the release.
LOOK_UP = ": cache look-up"


def first_state(states: list, type_name: str) -> datetime | None:
    at = [s.timestamp for s in states if s.type.value == type_name]
    return min(at) if at else None


def breakdown(release_flow_run_id: str) -> list[dict]:
    from mlflow import MlflowClient

    top, subs, look_ups = flow_runs(release_flow_run_id)
    c = MlflowClient(tracking_uri())
    parent = c.search_runs([e.experiment_id for e in c.search_experiments()],
                           f"tags.`edgeflow.prefect_flow_run_id` = '{release_flow_run_id}'", max_results=1)
    mlruns: dict[str, list] = {}  # stage flow run -> its MLflow runs (a mapped stage has one per variant)
    if parent:
        p = parent[0]
        for r in c.search_runs([p.info.experiment_id], f"tags.mlflow.parentRunId = '{p.info.run_id}'"):
            mlruns.setdefault(r.data.tags.get("edgeflow.stage_flow_run_id") or r.info.run_id, []).append(r)
    rows = []
    for r, flow_name, states in subs:
        stage = next((t.split(":", 1)[1] for t in r.tags if t.startswith("edgeflow.stage:")), flow_name)
        pending, running = first_state(states, "PENDING"), first_state(states, "RUNNING")
        ml = mlruns.get(str(r.id))
        tz = running.tzinfo if running else None
        ml_start = datetime.fromtimestamp(min(m.info.start_time for m in ml) / 1000, tz=tz) if ml and running else None
        ends = [m.info.end_time for m in ml or () if m.info.end_time]
        ml_end = datetime.fromtimestamp(max(ends) / 1000, tz=tz) if ml and ends and running else None
        rows.append({
            "stage": stage, "created": r.created, "end": r.end_time,
            "queued": _s(r.created, pending), "start": _s(pending, running),
            "prep": _s(running, ml_start) if ml else _s(running, r.end_time),
            "work": _s(ml_start, ml_end), "close": _s(ml_end, r.end_time) if ml else None,
            "total": _s(r.created, r.end_time),
        })
    for t in look_ups:  # a stage found cached: its whole time is the look-up, in the release's process
        rows.append({"stage": f"{t.name.removesuffix(LOOK_UP)} (look-up)", "created": t.start_time, "end": t.end_time,
                     "prep": _s(t.start_time, t.end_time), "total": _s(t.start_time, t.end_time)})
    rows.sort(key=lambda row: row["created"])
    for i, row in enumerate(rows):
        nxt = rows[i + 1]["created"] if i + 1 < len(rows) else top.end_time
        row["handoff"] = _s(row["end"], nxt)
    head = {"stage": "open", "created": top.start_time, "total": _s(top.start_time, rows[0]["created"]) if rows else None}
    return [head, *rows, {"stage": "(release)", "total": _s(top.created, top.end_time),
                          "start": _s(top.created, top.start_time), "started": top.start_time, "ended": top.end_time}]


# One request in the MLflow server's access log (uvicorn): "2026/12/06 22:40:16 INFO:     127.0.0.1:43088 - "PUT /api/2.0/...
_REQUEST = re.compile(r'^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) .*"(GET|POST|PUT|DELETE|PATCH) (/api/2\.0/[^ ?"]*)')
_ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts/"


def mlflow_requests(log: Path, artifacts: Path) -> list[tuple[datetime, str, int]]:
    """(when, kind, bytes) of each request the MLflow server logged: kind `api` (tracking and registry calls, bytes 0),
    `put` or `get` (an artifact through the server, bytes: the stored file's size; 0 for a listing)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = _REQUEST.match(line)
        if not m or m.group(3) == "/health":
            continue
        when = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S").astimezone()  # the server's local time
        method, path = m.group(2), m.group(3)
        if path.startswith(_ARTIFACTS) and method in ("PUT", "GET"):
            f = artifacts / path.removeprefix(_ARTIFACTS)
            out.append((when, method.lower(), f.stat().st_size if f.is_file() else 0))
        else:
            out.append((when, "api", 0))
    return out


def add_mlflow_calls(rows: list[dict], requests: list[tuple[datetime, str, int]]) -> None:
    """Count each request into the row whose window holds it: a stage's creation to the next row's (its handoff
    included); `open` from the release's start; the release row gets them all."""
    timed = [r for r in rows if r.get("created") is not None]
    for i, row in enumerate(timed):
        lo = row["created"]
        hi = timed[i + 1]["created"] if i + 1 < len(timed) else None
        mine = [q for q in requests if q[0] >= lo.replace(microsecond=0) and (hi is None or q[0] < hi.replace(microsecond=0))]
        row.update(_counts(mine))
    release = rows[-1]
    if release.get("started") is not None:
        release.update(_counts([q for q in requests if release["started"].replace(microsecond=0) <= q[0]
                                and (release["ended"] is None or q[0] <= release["ended"])]))


def _counts(requests: list[tuple[datetime, str, int]]) -> dict:
    return {"api": sum(k == "api" for _, k, _ in requests), "put": sum(k == "put" for _, k, _ in requests),
            "get": sum(k == "get" for _, k, _ in requests),
            "MB": sum(n for *_, n in requests) / 1e6}


def _count(v: float | None, k: str) -> str:
    return "" if v is None else f"{v:.1f}" if k == "MB" else f"{v:.0f}"


def print_breakdown(rows: list[dict]) -> None:
    cols = ("queued", "start", "prep", "work", "close", "handoff", "total")
    calls = ("api", "put", "get", "MB") if any("api" in r for r in rows) else ()
    print("| stage | " + " | ".join(cols + calls) + " |\n|---|" + "---|" * len(cols + calls))
    sums = dict.fromkeys(cols + calls, 0.0)
    for row in rows:
        print(f"| {row['stage']} | " + " | ".join([_fmt(row.get(k)) for k in cols] + [_count(row.get(k), k) for k in calls]) + " |")
        if row["stage"] not in ("open", "(release)"):
            for k in cols + calls:
                sums[k] += row.get(k) or 0.0
    print("| (sum of stages) | " + " | ".join([_fmt(sums[k]) for k in cols] + [_count(sums[k], k) for k in calls]) + " |")
    fixed = sums["queued"] + sums["start"] + sums["prep"] + sums["close"] + sums["handoff"]
    print(f"\nstages' work {sums['work']:.1f} s; fixed cost around it {fixed:.1f} s")


def from_report(report_path: str, pidfile: str) -> None:
    """The older view: wall time and peak RSS per stage from the MLflow stage runs, and the edge server's RSS."""
    import psutil
    from mlflow import MlflowClient

    report = json.loads(Path(report_path).read_text())
    c = MlflowClient(tracking_uri())
    parent = c.get_run(report["mlflow_parent_run_id"])
    runs = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    print("| stage | wall s | peak RSS MB |\n|---|---|---|")
    total = 0.0
    for r in sorted(runs, key=lambda r: r.info.start_time):
        m = r.data.metrics
        total += m.get("stage_wall_s", 0.0)
        print(f"| {r.data.tags.get('edgeflow.stage')} | {m.get('stage_wall_s', float('nan')):.1f} | {m.get('stage_peak_rss_mb', float('nan')):.0f} |")
    print(f"| (sum of stages) | {total:.1f} | |")
    pf = Path(pidfile)
    if pf.exists():
        pid = int(pf.read_text().split()[0])
        rss = sum(p.memory_info().rss for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)])
        print(f"\nedge server pid {pid}: RSS {rss / 2**20:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", help="reports/<release_id>.json: wall time and peak RSS per stage")
    ap.add_argument("--flow-run", help="the release's Prefect flow run id: where each stage's time went")
    ap.add_argument("--json", action="store_true", help="with --flow-run: the rows as JSON")
    ap.add_argument("--server-pidfile", default=".edgeflow/run/edge-server.pid")
    home = Path(os.environ.get("EDGEFLOW_HOME", Path(__file__).resolve().parents[1] / ".edgeflow"))
    ap.add_argument("--mlflow-log", type=Path, default=home / "logs" / "mlflow-server.log",
                    help="the MLflow server's log (services.py: $EDGEFLOW_HOME/logs/mlflow-server.log); none: no call counts")
    ap.add_argument("--artifacts", type=Path, default=home / "mlflow" / "artifacts",
                    help="the MLflow server's --artifacts-destination, for the bytes of each upload and download")
    a = ap.parse_args()
    if a.flow_run:
        rows = breakdown(a.flow_run)
        if a.mlflow_log.is_file():
            add_mlflow_calls(rows, mlflow_requests(a.mlflow_log, a.artifacts))
        if a.json:
            print(json.dumps(rows, default=str, indent=1))
        else:
            print_breakdown(rows)
    elif a.report:
        from_report(a.report, a.server_pidfile)
    else:
        ap.error("give a report or --flow-run")


if __name__ == "__main__":
    main()
