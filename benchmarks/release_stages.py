"""Per-stage wall time and peak RSS of a release (from its MLflow stage runs), and the edge server's RSS.

    python benchmarks/release_stages.py reports/<release_id>.json [--server-pidfile .edgeflow/run/edge-server.pid]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil
from mlflow import MlflowClient

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.runs import tracking_uri  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("report")
    ap.add_argument("--server-pidfile", default=".edgeflow/run/edge-server.pid")
    a = ap.parse_args()
    report = json.loads(Path(a.report).read_text())
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
    pf = Path(a.server_pidfile)
    if pf.exists():
        pid = int(pf.read_text().split()[0])
        rss = sum(p.memory_info().rss for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)])
        print(f"\nedge server pid {pid}: RSS {rss / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
