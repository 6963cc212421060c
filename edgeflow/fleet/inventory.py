"""The fleet's inventory: one record per device, kept in the Prefect API every host shares.

    python -m edgeflow.fleet list                  # the table (id, queue, worker, sku, L4T, SM, TensorRT, serving ...)
    python -m edgeflow.fleet targets --out f.json  # Prometheus file_sd targets, one per device, labelled `device`

A device's worker registers it when it starts (python -m edgeflow.fleet worker) and deploy-edge refreshes
what it serves after every deploy. The record is a Prefect Variable `edgeflow-device-<id>` (JSON, tagged
`edgeflow-device`), so the Prefect UI shows it, a flow reads it with read_inventory(), and no host needs
another host's files. Whether the device is reachable now is its worker's heartbeat, read from the pool.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

import httpx
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import Profile
from edgeflow.device.identity import DeviceConfig, device_profile

VARIABLE_PREFIX = "edgeflow-device-"
VARIABLE_TAG = "edgeflow-device"
FACT_KEYS = ("sku", "l4t", "jetpack", "sm", "tensorrt", "tensorrt_llm")


class Serving(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = Field(default=None, description="Registered model version behind the stable port (state.json).")
    model: str | None = Field(default=None, description="Registered model name it serves.")
    healthy: bool = Field(default=False, description="Deep /health through the stable port answered 200 when checked.")
    detail: str = Field(default="", description="Why not healthy (the last answer), or the port it serves on.")
    checked_at: str = Field(default="", description="When it was checked (UTC, ISO 8601).")


class DeviceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="Device id (device.yaml).")
    pool: str = Field(description="Work pool its worker polls.")
    queue: str = Field(description="Its own work queue in that pool; targeted runs go here.")
    tags: dict[str, str] = Field(description="Operator tags merged with the detected facts (facts win).")
    facts: dict[str, str] = Field(description="Detected facts (edgeflow/device/facts.py): sku, l4t, sm, tensorrt, memory ...")
    metrics_target: str = Field(description="host:port Prometheus scrapes for this device.")
    serving: Serving = Field(description="What it served when last checked.")
    registered_at: str = Field(description="When its worker last registered it (UTC).")

    @property
    def variable(self) -> str:
        return variable_name(self.id)


def variable_name(device_id: str) -> str:
    return f"{VARIABLE_PREFIX}{device_id}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def detected_facts() -> dict[str, str]:
    from edgeflow.device.facts import detect_facts

    return {k: str(v) for k, v in detect_facts().items()}


def serving_status(profile: Profile) -> Serving:
    """What this device serves now: state.json's current version and a deep /health through the stable port."""
    from edgeflow.device.keys import client_headers
    from edgeflow.device.proxy import public_url
    from edgeflow.device.state import read_state

    current = read_state(profile).get("current") or {}
    out = Serving(version=current.get("version"), model=profile.registry.model_name if current else None, checked_at=_now())
    if not current:
        out.detail = "nothing deployed"
        return out
    try:
        r = httpx.get(f"{public_url(profile)}/health", timeout=15, headers=client_headers(profile))
        out.healthy = r.status_code == 200
        out.detail = f"port {current.get('port')}" if out.healthy else f"/health {r.status_code}: {r.text[:120]}"
    except httpx.HTTPError as e:
        out.detail = f"/health did not answer: {type(e).__name__}"
    return out


def _metrics_target(profile: Profile, device: DeviceConfig) -> str:
    if device.metrics_target:
        return device.metrics_target
    import socket

    host = profile.deploy.host
    return f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{profile.deploy.port}"


def register(profile: Profile, device: DeviceConfig) -> DeviceRecord:
    """Write (or refresh) this device's record and make sure its work queue exists in its pool."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.variables import Variable

    p = device_profile(profile, device)
    facts = detected_facts()
    record = DeviceRecord(
        id=device.id, pool=device.pool, queue=device.queue, tags=device.tags | {k: facts[k] for k in FACT_KEYS if k in facts},
        facts=facts, metrics_target=_metrics_target(p, device), serving=serving_status(p), registered_at=_now(),
    )
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


def update_serving(profile: Profile, device: DeviceConfig) -> DeviceRecord | None:
    """Refresh what a registered device serves (deploy-edge calls it after every attempt); None if not registered."""
    from prefect.variables import Variable

    current = Variable.get(variable_name(device.id))
    if not current:
        return None
    record = DeviceRecord.model_validate(current)
    record.serving = serving_status(device_profile(profile, device))
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
        if not w.name.startswith("device-"):
            continue
        seen = w.last_heartbeat_time
        age = time.time() - seen.timestamp() if seen else float("inf")
        out[w.name.removeprefix("device-")] = "online" if age < stale_s else f"offline ({age:.0f} s since heartbeat)"
    return out


def select(records: list[DeviceRecord], target: dict[str, str]) -> list[DeviceRecord]:
    """The devices carrying every tag of `target` (all devices for an empty target)."""
    return [r for r in records if all(r.tags.get(k) == v for k, v in target.items())]


def prometheus_targets(records: list[DeviceRecord]) -> list[dict]:
    """Prometheus file_sd_configs entries: one target per device, labelled with its id, pool and tags."""
    return [{"targets": [r.metrics_target], "labels": {"device": r.id, "pool": r.pool}} for r in records]


COLUMNS = ("id", "queue", "worker", "sku", "l4t", "sm", "tensorrt", "mem_free_mb", "serving", "health", "checked")


def table(records: list[DeviceRecord], status: dict[str, str]) -> str:
    rows = [COLUMNS]
    for r in records:
        s = r.serving
        rows.append((r.id, r.queue, status.get(r.id, "no worker"), r.facts.get("sku", "-"), r.facts.get("l4t", "-"),
                     r.facts.get("sm", "-"), r.facts.get("tensorrt", "-"), r.facts.get("mem_free_mb", "-"),
                     f"{s.model} v{s.version}" if s.version else "-", "healthy" if s.healthy else (s.detail or "-"),
                     s.checked_at or "-"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
