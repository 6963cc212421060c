"""The fleet inventory's store: each device's record as a Prefect Variable, its work queue, its own scheduled
deployments, and its worker's heartbeat, in the Prefect API every host shares (the records: edgeflow/fleet/inventory.py).

The record is a Prefect Variable `edgeflow-device-<id>` (JSON, tagged `edgeflow-device`), so the Prefect UI shows it,
a flow reads it with read_inventory(), and no host needs another host's files. Whether the device is reachable now is
its worker's heartbeat, read from the pool.
"""
from __future__ import annotations

import time

from edgeflow.device.identity import QUEUE_PREFIX, DeviceConfig
from edgeflow.fleet.inventory import VARIABLE_PREFIX, VARIABLE_TAG, DeviceRecord, device_record, serving_status, variable_name
from edgeflow.profile import Profile


def register(target: Profile, device: DeviceConfig) -> DeviceRecord:
    """Write (or refresh) this device's record and make sure its work queue exists in its pool. `target`: the profile
    as this device applies it (device_profile)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.variables import Variable

    record = device_record(target, device)
    with get_client(sync_client=True) as client:
        try:
            client.create_work_queue(name=device.queue, work_pool_name=device.pool,
                                     description=f"edgeflow device {device.id}: deploy-edge, probe-edge and ship-logs runs for it")
        except ObjectAlreadyExists:
            pass
    Variable.set(record.variable, record.model_dump(mode="json"), tags=[VARIABLE_TAG, device.pool], overwrite=True)
    return record


SHIP_LOGS_TEMPLATE = "ship-logs/ship-logs"
RECONCILE_TEMPLATE = "reconcile-edge/reconcile-edge"


def ensure_ship_logs(device: DeviceConfig, profile_path: str) -> str:
    """This device's own scheduled ship-logs deployment (ship-logs-<id>, on its queue), copied from the
    `ship-logs` deployment of prefect.yaml; returns what was done. Without the template (prefect.yaml not deployed
    yet) nothing is created, and it says so."""
    return _ensure_device_deployment(device, profile_path, SHIP_LOGS_TEMPLATE, "ship-logs", device.ship_logs_cron,
                                     "logs are not shipped on a schedule")


def ensure_reconcile(device: DeviceConfig, profile_path: str) -> str:
    """This device's own scheduled reconcile deployment (reconcile-<id>, on its queue; edgeflow/device/reconcile.py)."""
    return _ensure_device_deployment(device, profile_path, RECONCILE_TEMPLATE, "reconcile", device.reconcile_cron,
                                     "the device does not catch up with production by itself")


def _ensure_device_deployment(device: DeviceConfig, profile_path: str, template: str, prefix: str, cron: str | None,
                              without: str) -> str:
    """A copy of `template` named <prefix>-<device id>, on the device's queue, on `cron` (UTC)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            base = client.read_deployment_by_name(template)
        except ObjectNotFound:
            return f"no {template} deployment to copy (run `prefect deploy --all`); {without}"
        flow_name = template.partition("/")[0]
        name = f"{prefix}-{device.id}"
        client.create_deployment(  # an upsert: the same name again updates it
            flow_id=base.flow_id, name=name, work_pool_name=device.pool, work_queue_name=device.queue,
            entrypoint=base.entrypoint, path=base.path, pull_steps=base.pull_steps, job_variables=base.job_variables,
            parameters=base.parameters | {"profile": profile_path}, parameter_openapi_schema=base.parameter_openapi_schema,
            enforce_parameter_schema=True, description=f"{base.description} (device {device.id})",
            schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone="UTC"), active=True)]
            if cron else [],
        )
    return f"{flow_name}/{name} on {device.queue}, " + (f"cron {cron!r} UTC" if cron else "no schedule")


def update_serving(target: Profile, device: DeviceConfig) -> DeviceRecord | None:
    """Refresh what a registered device serves (deploy-edge calls it after every attempt); None if not registered."""
    from prefect.variables import Variable

    current = Variable.get(variable_name(device.id))
    if not current:
        return None
    record = DeviceRecord.model_validate(current)
    record.serving = serving_status(target)
    Variable.set(record.variable, record.model_dump(mode="json"), tags=[VARIABLE_TAG, record.pool], overwrite=True)
    return record


def read_inventory(pool: str | None = None) -> list[DeviceRecord]:
    """Every registered device (of `pool`, if given), by id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        variables = client.read_variables()
    records = [DeviceRecord.model_validate(v.value) for v in variables if v.name.startswith(VARIABLE_PREFIX)]
    return sorted((r for r in records if pool is None or r.pool == pool), key=lambda r: r.id)


def worker_status(pool: str, stale_s: float = 90) -> dict[str, str]:
    """{device id: "online" | "offline (last seen ...)"} from the pool's worker heartbeats (worker name = device queue)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    out = {}
    for w in workers:
        if not w.name.startswith(QUEUE_PREFIX):
            continue
        seen = w.last_heartbeat_time
        age = time.time() - seen.timestamp() if seen else float("inf")
        out[w.name.removeprefix(QUEUE_PREFIX)] = "online" if age < stale_s else f"offline ({age:.0f} s since heartbeat)"
    return out
