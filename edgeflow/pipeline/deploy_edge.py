"""Deploy-edge stage (runs on the `orin` pool): a blue/green rollout that never breaks the serving version.

Tiny CPU run (with services up and a `staging` version registered): python -m edgeflow.pipeline.deploy_edge --profile configs/demo-cpu.yaml

fetch + verify checksums → bind the engine to this device (check, reuse or build) → start the new
server on the free side port → /ready, deep /health, smoke chat → switch the stable port's proxy to it
→ drain and stop the old server. Any failure before the switch leaves the old server serving and the
alias where it was; the failed deployment is recorded in MLflow either way.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from prefect import flow, task

from edgeflow.device.identity import DeviceConfig, load_for_device  # the profile as this device applies it, and its config
from edgeflow.profile import Profile


@task
def fetch(target: Profile, alias: str, version: str | None = None) -> tuple[str, str]:
    """Download the aliased (or the given) version into its own versioned directory and verify every sha256."""
    from edgeflow.device.fetch import fetch_version

    version, path = fetch_version(target, alias, version)
    return version, str(path)


@task
def check_serving(target: Profile, version: str, package: str) -> dict | None:
    """Is this exact version already serving here, proxied and healthy? (then there is nothing to roll out)"""
    from edgeflow.device.health import smoke_chat
    from edgeflow.device.keys import client_headers
    from edgeflow.device.proxy import already_serving, public_url

    serving = already_serving(target, version, Path(package))
    # still prove the stable port answers a chat, as a real rollout would
    return serving and serving | {"smoke_answer": smoke_chat(public_url(target), target.registry.model_name,
                                                             target.deploy.smoke_prompt, headers=client_headers(target))}


@task
def bind_engine(target: Profile, package: str) -> tuple[str, str]:
    """Check the shipped engine against this device, or build one here from the checkpoint."""
    from edgeflow.device.bind import engine_for_device

    engine, how = engine_for_device(target, Path(package))
    print(how)
    return str(engine), how


@task
def start_candidate(target: Profile, device: DeviceConfig | None, engine: str, version: str, package: str) -> dict:
    """Start the new version on the free side port and health-gate it (deep /health + a smoke chat)."""
    from edgeflow.device.spawn import start_candidate as start

    return start(target, Path(engine), version, Path(package), device)


@task
def switch_traffic(target: Profile, candidate: dict) -> dict:
    """Point the stable port at the candidate; the old server finishes its requests, then stops."""
    from edgeflow.device.proxy import ensure_proxy
    from edgeflow.device.switch import switch_to

    ensure_proxy(target)
    return switch_to(target, candidate)


@task
def record(target: Profile, device: DeviceConfig | None, alias: str, outcome: dict, package: str | None = None) -> None:
    """Log the deployment (succeeded or failed, and why) as a run of the MLflow `edgeflow-deployments` experiment,
    tagged with the hash of the package it installed (`package`, once fetched)."""
    from edgeflow.device.record import record_deployment

    record_deployment(target, alias, outcome, Path(package) if package else None, device)
    refresh_inventory(target, device)


def refresh_inventory(target: Profile, device: DeviceConfig | None) -> None:
    """A registered device's inventory record says what it serves now (python -m edgeflow.fleet list). A record that
    cannot be written leaves the deploy's outcome as it is (the device serves what it serves); it says so instead."""
    from edgeflow.pipeline.inventory_store import update_serving

    if device is None:
        return
    try:
        update_serving(target, device)
    except Exception as e:  # noqa: BLE001 - the inventory is a view; the deployment record above is the record
        print(f"inventory record of {device.id} not refreshed ({type(e).__name__}: {e}); the next registration or deploy refreshes it")


@flow(name="deploy-edge", log_prints=True)
def deploy_edge(profile: str, alias: str = "staging", force: bool = False, version: str | None = None,
                reason: str = "") -> dict:
    """Registered version in (the alias's, or `version`), a healthy server behind the stable port out (or the old
    one, untouched). `reason` is recorded with the deployment (a rollout names its wave, a rollback its breach)."""
    target, device = load_for_device(profile)  # once: handed to each step
    return deploy_on_device(target, device, alias, force, version, reason)


def deploy_on_device(target: Profile, device: DeviceConfig | None, alias: str, force: bool = False,
                     version: str | None = None, reason: str = "") -> dict:
    """deploy-edge's steps, on the profile as this device applies it (`target`) and this host's config (`device`)."""
    from prefect.runtime import flow_run

    from edgeflow.device.keys import check_exposure
    from edgeflow.device.proxy import public_url

    outcome: dict = {"alias": alias, "prefect_flow_run_id": flow_run.get_id(), "reason": reason}
    package = None
    try:
        check_exposure(target)  # before anything is fetched or started
        version, package = fetch(target, alias, version)
        outcome["version"] = version
        serving = None if force else check_serving(target, version, package)
        if serving:
            # Nothing to roll out: record the (successful, unchanged) deployment and leave the device alone.
            result = {"url": public_url(target), "version": version, "unchanged": True,
                      "engine_binding": f"already serving version {version} on port {serving['port']} (healthy)",
                      "smoke_answer": serving["smoke_answer"], "health": serving["health"], "side_port": serving["port"]}
            record(target, device, alias, outcome | {"status": "FINISHED"} | result, package)
            return result | {"alias": alias}
        engine, how = bind_engine(target, package)
        candidate = start_candidate(target, device, engine, version, package)
        switched = switch_traffic(target, candidate)
    except Exception as e:
        record(target, device, alias, outcome | {"status": "FAILED", "error": f"{type(e).__name__}: {e}"}, package)
        raise
    result = {
        "url": public_url(target), "version": version, "engine_binding": how,
        "smoke_answer": candidate["smoke_answer"], "health": candidate["health"], "side_port": candidate["port"],
    } | switched
    record(target, device, alias, outcome | {"status": "FINISHED"} | result, package)
    return result | {"alias": alias}


@flow(name="rollback-edge", log_prints=True)
def rollback_edge(profile: str) -> dict:
    """Serve the version this device ran before, by the same health-gated switch (no registry call needed)."""
    from edgeflow.tracking.artifacts import verify_manifest
    from edgeflow.device.proxy import public_url
    from edgeflow.device.state import previous_deployment

    target, device = load_for_device(profile)
    prev = previous_deployment(target)
    verify_manifest(Path(prev["package"]))  # the old files are still what was verified at the time
    candidate = start_candidate(target, device, prev["engine"], prev["version"], prev["package"])
    switched = switch_traffic(target, candidate)
    result = {"url": public_url(target), "version": prev["version"], "smoke_answer": candidate["smoke_answer"]} | switched
    record(target, device, "rollback", {"status": "FINISHED"} | result, prev["package"])
    return result


@flow(name="reconcile-edge", log_prints=True)
def reconcile_edge(profile: str) -> dict:
    """On the device: serve the fleet's `production` version if it serves another, unless a rollout is at work
    (edgeflow/device/reconcile.py); its own `reconcile-<id>` deployment runs it on a schedule."""
    from edgeflow.device.reconcile import decide
    from edgeflow.pipeline.locks import active_rollouts

    target, device = load_for_device(profile)
    decision = decide(target, active_rollouts())
    print(f"reconcile: {decision.action}: {decision.reason}")
    out = decision.model_dump()
    if decision.action == "deploy":
        out["deployed"] = deploy_on_device(target, device, "production", version=decision.intended,
                                           reason=f"reconcile: {decision.reason}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--alias", default="staging")
    ap.add_argument("--rollback", action="store_true", help="serve the previous version instead")
    ap.add_argument("--force", action="store_true", help="roll out even if this version already serves here")
    ap.add_argument("--reconcile", action="store_true", help="serve the fleet's production version if this device "
                    "serves another (and no rollout is at work)")
    a = ap.parse_args()
    if a.reconcile:
        print(reconcile_edge(a.profile))
    else:
        print(rollback_edge(a.profile) if a.rollback else deploy_edge(a.profile, a.alias, a.force))
