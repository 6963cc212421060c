"""Every deploy attempt recorded in MLflow's `edgeflow-deployments` experiment, FINISHED or FAILED.
"""
from __future__ import annotations

from pathlib import Path

from edgeflow.device.fetch import package_sha256
from edgeflow.device.identity import DeviceConfig
from edgeflow.device.state import device_dir
from edgeflow.profile import Profile


def record_deployment(profile: Profile, alias: str, outcome: dict, package: Path | None = None,
                      device: DeviceConfig | None = None) -> str:
    """One run per deployment attempt in the `edgeflow-deployments` MLflow experiment; FAILED ones say why, and the
    device it was (`device`: this host's config, None on a host without one) tags it.

    `package`: the installed package directory, once fetched and verified; its tree hash (from its manifest) is
    tagged `edgeflow.package_sha256`, the hash the registered version carries, so the promotion check can tell
    this package from another registry's version of the same number (edgeflow/tracking/promotion.py:check_deployed).
    """
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import PACKAGE_SHA256_TAG
    from edgeflow.tracking.runs import DEPLOYMENTS_EXPERIMENT, experiment_id, tracking_uri

    c = MlflowClient(tracking_uri())
    exp_id = experiment_id(c, DEPLOYMENTS_EXPERIMENT)
    tags = {
        "edgeflow.model": profile.registry.model_name,
        "edgeflow.alias": alias,
        "edgeflow.version": str(outcome.get("version", "")),
        "edgeflow.device_dir": str(device_dir(profile)),
        "edgeflow.device_id": device.id if device else "",
        "edgeflow.reason": str(outcome.get("reason", ""))[:4000],
        "edgeflow.prefect_flow_run_id": str(outcome.get("prefect_flow_run_id") or ""),
        "edgeflow.error": str(outcome.get("error", ""))[:4000],
    }
    sha = package_sha256(package) if package is not None else None
    if sha:
        tags[PACKAGE_SHA256_TAG] = sha
    where = f" on {tags['edgeflow.device_id']}" if tags["edgeflow.device_id"] else ""
    run = c.create_run(exp_id, run_name=f"{alias} v{outcome.get('version', '?')}{where} {outcome['status'].lower()}", tags=tags)
    c.log_dict(run.info.run_id, {k: v for k, v in outcome.items() if k != "health"}, "deployment.json")
    c.set_terminated(run.info.run_id, outcome["status"])
    return run.info.run_id
