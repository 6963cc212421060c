"""The fleet's inventory: what one record per device says, which devices a target selects, and how they are shown.

    python -m edgeflow.fleet list                  # the table (id, queue, worker, sku, L4T, SM, TensorRT, serving ...)
    python -m edgeflow.fleet targets --out f.json  # Prometheus file_sd targets, one per device, labelled `device`

A device's worker registers it when it starts (python -m edgeflow.fleet worker) and deploy-edge refreshes
what it serves after every deploy. Where the records are kept (Prefect Variables in the API every host shares) and
whether a device's worker is online is edgeflow/pipeline/inventory_store.py's: this module owns the records only.
"""
from __future__ import annotations

from datetime import datetime, timezone

import httpx
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import Profile
from edgeflow.device.identity import DeviceConfig

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


def device_record(profile: Profile, device: DeviceConfig) -> DeviceRecord:
    """This device's record as of now: its config, the facts detected here, and what it serves. `profile` is the
    profile as this device applies it (edgeflow/device/identity.py device_profile)."""
    facts = detected_facts()
    return DeviceRecord(
        id=device.id, pool=device.pool, queue=device.queue, tags=device.tags | {k: facts[k] for k in FACT_KEYS if k in facts},
        facts=facts, metrics_target=_metrics_target(profile, device), serving=serving_status(profile), registered_at=_now(),
    )


def _metrics_target(profile: Profile, device: DeviceConfig) -> str:
    if device.metrics_target:
        return device.metrics_target
    import socket

    host = profile.deploy.host
    return f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{profile.deploy.port}"


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
