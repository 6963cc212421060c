"""Promote and rollback-production: checked alias moves in the MLflow registry (logic in edgeflow/tracking/promotion.py).

    python -m edgeflow.pipeline.promote --profile configs/demo-cpu.yaml --to production             (promotes what `staging` holds)
    python -m edgeflow.pipeline.promote --profile configs/demo-cpu.yaml --version 4 --to staging
    python -m edgeflow.pipeline.promote --profile configs/demo-cpu.yaml --rollback --deploy inline
"""
from __future__ import annotations

import argparse
import os
from typing import Literal

from prefect import flow, task

from edgeflow.preflight import load_profile


@task
def move_alias(model_name: str, version: str | None, to: Literal["staging", "production"], reason: str) -> dict:
    """Check the version and move the alias, mirrored to legacy stages and recorded in `edgeflow-promotions`."""
    from edgeflow.tracking.promotion import promote as promote_version
    from edgeflow.tracking.registry import client

    return promote_version(client(), model_name, version, to, reason).model_dump()


@task
def swap_back(model_name: str, reason: str) -> dict:
    """Point `production` at `previous` and `previous` at the version that was production."""
    from edgeflow.tracking.promotion import rollback
    from edgeflow.tracking.registry import client

    return rollback(client(), model_name, reason).model_dump()


@flow(name="promote", log_prints=True)
def promote(
    profile: str, version: str | None = None, to: Literal["staging", "production"] = "staging", reason: str = ""
) -> dict:
    """Move a registered version up one step (staging: gate passed; production: also deployed), or refuse saying why."""
    move = move_alias(load_profile(profile).registry.model_name, version, to, reason)  # the profile read once
    print(f"{move['model_name']}: `{to}` -> version {move['version']} (was {move['from_version'] or 'unset'}); "
          + "; ".join(move["checks"]))
    return move


@flow(name="rollback-production", log_prints=True)
def rollback_production(profile: str, deploy: Literal["pool", "inline", "none"] = "pool", reason: str = "") -> dict:
    """Move `production` back to `previous`, then roll the device to it through deploy-edge (alias production)."""
    from edgeflow.pipeline.deploy_edge import deploy_edge
    from edgeflow.pipeline.chain import run_deploy_on_pool

    move = swap_back(load_profile(profile).registry.model_name, reason)  # read once; deploy-edge reads its own
    print(f"{move['model_name']}: `production` -> version {move['version']} (was {move['from_version']})")
    try:
        # Same choice as the release: the orin pool's worker (pool), this process (inline) or registry only (none).
        deployed = (run_deploy_on_pool(profile, "production") if deploy == "pool"
                    else deploy_edge(profile, "production") if deploy == "inline" else None)
    except Exception as e:
        # The registry keeps the rolled-back state (it is what should serve); deploy-edge left the device as it was.
        raise RuntimeError(
            f"registry rolled back (`production` = version {move['version']}), but deploy-edge failed: {e}; the device still "
            f"serves what it served before; fix the device and run deploy-edge with alias production"
        ) from e
    return move | {"deployed": deployed}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", None), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--version", default=None, help="version number or alias (default for production: the `staging` version)")
    ap.add_argument("--to", default="staging", choices=["staging", "production"])
    ap.add_argument("--rollback", action="store_true", help="roll production back to `previous` instead")
    ap.add_argument("--deploy", default="inline", choices=["pool", "inline", "none"], help="how --rollback redeploys")
    ap.add_argument("--reason", default="", help="recorded with the move")
    a = ap.parse_args()
    print(rollback_production(a.profile, a.deploy, a.reason) if a.rollback else promote(a.profile, a.version, a.to, a.reason))
