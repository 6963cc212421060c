"""Cached re-runs of the test-tiny release with Prefect's own process-pool template (its workspace supervisor, then
the engine) and with edgeflow's (the engine directly, edgeflow/pipeline/workers.py), alternated, twice each.

    AB=1 bash benchmarks/release_pair.sh     (needs the services and a cached test-tiny release; the script sets both up)

Result: BENCHMARKS.md#stage-fixed-costs. The pools get edgeflow's template back at the end.
"""
from __future__ import annotations

import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolUpdate
from prefect.deployments import run_deployment
from prefect.workers.process import ProcessWorker

from edgeflow.pipeline.workers import process_pool_template


def set_pools(template: dict) -> None:
    with get_client(sync_client=True) as c:
        for pool in ("cpu", "a100", "orin"):
            c.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def main() -> None:
    try:
        for label, template in [("Prefect's template (workspace supervisor)", ProcessWorker.get_default_base_job_template()),
                                ("edgeflow's template (the engine directly)", process_pool_template())] * 2:
            set_pools(template)
            t = time.time()
            fr = run_deployment("release/release", parameters={"profile": "configs/test-tiny.yaml", "deploy": "pool"},
                                timeout=1800, poll_interval=1)
            print(f"cached re-run, {label}: {time.time() - t:.1f} s ({fr.state.type.value}, flow run {fr.id})", flush=True)
    finally:
        set_pools(process_pool_template())


if __name__ == "__main__":
    main()
