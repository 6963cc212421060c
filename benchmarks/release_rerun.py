"""Re-run cost of a release: nothing changed (everything cached), then only the calibration mix changed.

    make demo                                   # the cold release (first run)
    .venv/bin/python benchmarks/release_rerun.py --profile configs/demo-cpu.yaml

Needs the demo services (`make demo` leaves them up) and their environment:
`set -a; eval "$(.venv/bin/python scripts/services.py env | sed 's/^export //')"; set +a`.
Wall times are the Prefect flow runs' own start/end times; which stages really ran is counted from the
MLflow runs each stage writes (a cached stage writes none), not from Prefect's say-so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stage_runs(c, experiment: str) -> Counter:
    exp = c.get_experiment_by_name(experiment)
    return Counter(r.data.tags["edgeflow.stage"] for r in c.search_runs([exp.experiment_id], "tags.`edgeflow.stage` != ''", max_results=5000))


async def last_completed_release(profile: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.sorting import FlowRunSort

    async with get_client() as client:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["release"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["COMPLETED"]))),
            sort=FlowRunSort.START_TIME_DESC, limit=20,
        )
    runs = [r for r in runs if r.parameters.get("profile") == profile]
    if not runs:
        raise SystemExit(f"no completed release of {profile} on this Prefect server: run `make demo` first")
    return runs[0]


def wall(run) -> float:
    return (run.end_time - run.start_time).total_seconds()


def run_release(profile: str):
    from prefect.deployments import run_deployment

    fr = run_deployment("release/release", parameters={"profile": profile, "deploy": "pool"}, timeout=None)
    if not fr.state.is_completed():
        raise SystemExit(f"release {fr.id} ended {fr.state.type}: {fr.state.message}")
    return fr


def main() -> None:
    from mlflow import MlflowClient

    from edgeflow.paths import REPO_ROOT
    from edgeflow.preflight import load_profile
    from edgeflow.tracking.runs import tracking_uri

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--mix", default="chat=4,wiki=4,math=2", help="Calibration ratios for a third, changed-mix run ('' skips it).")
    a = ap.parse_args()
    p = load_profile(a.profile)
    c = MlflowClient(tracking_uri())

    first = asyncio.run(last_completed_release(a.profile))
    before = stage_runs(c, p.registry.experiment)
    second = run_release(a.profile)
    after_same = stage_runs(c, p.registry.experiment)

    rows = [
        ("first (cold, `make demo`)", wall(first), "all"),
        ("second, nothing changed", wall(second), ", ".join(sorted((after_same - before).elements())) or "none"),
    ]
    ids = {"first": str(first.id), "second": str(second.id)}
    if a.mix:
        data = yaml.safe_load(Path(REPO_ROOT, a.profile).read_text())
        data.setdefault("calibration", {})["ratios"] = {k: float(v) for k, v in (x.split("=") for x in a.mix.split(","))}
        mix_path = p.work / "bench" / "mix.yaml"
        mix_path.parent.mkdir(parents=True, exist_ok=True)
        mix_path.write_text(yaml.safe_dump(data))
        third = run_release(str(mix_path))
        after_mix = stage_runs(c, p.registry.experiment)
        rows.append((f"third, calibration mix {a.mix}", wall(third), ", ".join(sorted((after_mix - after_same).elements())) or "none"))
        ids["third"] = str(third.id)
    print("| run | wall s | % of first | stages that ran (MLflow stage runs written) |\n|---|---|---|---|")
    for name, t, ran in rows:
        print(f"| {name} | {t:.1f} | {100 * t / rows[0][1]:.1f} % | {ran} |")
    print(json.dumps(ids))


if __name__ == "__main__":
    main()
