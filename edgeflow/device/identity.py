"""Who this device is: its id, pool, work queue, operator tags and its own deploy settings.

    python -m edgeflow.fleet show          # this host's device config and detected facts

A device is a host of the `orin` pool that serves a model. Its identity lives on the device, in
`device.yaml` ($EDGEFLOW_DEVICE_CONFIG, else $EDGEFLOW_HOME/device.yaml): the shared profile says *what*
to serve and how the fleet rolls out, the device file says *where* on this device (ports, install_dir,
key file), so one profile serves a fleet whose devices differ. Each device's worker polls its own work
queue, `device-<id>`, in its pool; a targeted deploy is a run sent to that queue.

    id: orin-a                      # unique in the fleet: [a-z0-9-], 1-48 characters
    pool: orin
    tags: {sku: agx-orin-64gb, site: berlin}
    deploy: {port: 8000, side_ports: [8001, 8002], install_dir: /var/lib/edgeflow/device}
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edgeflow.profile import DeployConfig, Profile

DEVICE_CONFIG_ENV = "EDGEFLOW_DEVICE_CONFIG"
ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,47}$")
QUEUE_PREFIX = "device-"


class DeviceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="Device id, unique in the fleet ([a-z0-9-], 1-48 characters); its work queue is device-<id>.")
    pool: str = Field(default="orin", description="Prefect work pool this device's worker polls (the `orin` kind).")
    tags: dict[str, str] = Field(
        default_factory=dict,
        description="Operator tags (site, ring, customer ...) that rollout targets match; detected facts (sku, l4t, "
        "sm, tensorrt ...) are added at registration and win over a tag of the same name.",
    )
    build_queue: bool = Field(
        default=False, description="Also poll the pool's default queue, taking build-engine and consistency runs "
        "(a device that builds and gates engines for the fleet).",
    )
    metrics_target: str | None = Field(
        default=None, description="host:port Prometheus scrapes for this device's /metrics (the stable port); default "
        "<deploy.host, or this hostname when it binds all interfaces>:<deploy.port>.",
    )
    faults: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="Chaos testing only: edge-server fault flags per served version on this device, e.g. "
        "{'7': {fault_corrupt_every: 2}} (edgeflow/serving/app.py ServerSettings fault_*). Never set in production.",
    )
    ship_logs_cron: str | None = Field(
        default="15 * * * *", description="When this device ships its access-log segments (cron, UTC; its own "
        "ship-logs-<id> deployment). Hourly at :15: the nightly at 02:30 sees every segment cut before 02:15. "
        "None: the deployment has no schedule (run it by hand or from a flow).",
    )
    reconcile_cron: str | None = Field(
        default="*/10 * * * *", description="When this device checks that it serves the fleet's production version and "
        "deploys it if not (cron, UTC; its own reconcile-<id> deployment, edgeflow/device/reconcile.py): a device cut off "
        "during a rollout catches up within 10 minutes of its return. None: no schedule.",
    )
    deploy: dict = Field(
        default_factory=dict,
        description="Overrides of the profile's `deploy` block on this device (port, side_ports, install_dir, host, "
        "api_key_file ...), checked against DeployConfig.",
    )

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not ID_PATTERN.match(v):
            raise ValueError(f"id={v!r}: use 1-48 characters of a-z, 0-9 and '-', starting with a letter or digit "
                             "(it names the device's work queue and Prometheus label)")
        return v

    @field_validator("deploy")
    @classmethod
    def _deploy(cls, v: dict) -> dict:
        unknown = sorted(set(v) - set(DeployConfig.model_fields))
        if unknown:
            raise ValueError(f"deploy: unknown keys {unknown}; known: {sorted(DeployConfig.model_fields)}")
        return v

    @field_validator("faults")
    @classmethod
    def _faults(cls, v: dict) -> dict:
        bad = sorted({k for flags in v.values() for k in flags if not k.startswith("fault_")})
        if bad:
            raise ValueError(f"faults: {bad} are not fault flags; only serving ServerSettings fault_* fields may be set here")
        return v

    @property
    def queue(self) -> str:
        return queue_name(self.id)


def queue_name(device_id: str) -> str:
    """The work queue of one device, in its pool."""
    return f"{QUEUE_PREFIX}{device_id}"


def config_path() -> Path:
    env = os.environ.get(DEVICE_CONFIG_ENV)
    if env:
        return Path(env)
    from edgeflow.paths import REPO_ROOT

    return Path(os.environ.get("EDGEFLOW_HOME", REPO_ROOT / ".edgeflow")) / "device.yaml"


def load_device(path: Path | None = None, required: bool = False) -> DeviceConfig | None:
    """This host's device config, or None when it has none (a single-device setup: the profile's deploy block)."""
    path = Path(path) if path else config_path()
    if not path.exists():
        if required:
            raise FileNotFoundError(
                f"no device config at {path}; write one (id, pool, tags, deploy) or point ${DEVICE_CONFIG_ENV} at it "
                "(docs/how-to/fleet.md)"
            )
        return None
    try:
        return DeviceConfig.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'device'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"device config {path}: {problems} (fields: {sorted(DeviceConfig.model_fields)})") from None


def device_profile(profile: Profile, device: DeviceConfig | None) -> Profile:
    """The profile as this device applies it: its `deploy` block overridden by the device's own settings (`device`:
    this host's config, None on a host without one)."""
    if device is None or not device.deploy:
        return profile
    merged = profile.deploy.model_dump(exclude_unset=True) | device.deploy
    try:
        deploy = DeployConfig.model_validate(merged)
    except ValueError as e:
        raise ValueError(f"device {device.id}: its deploy overrides do not validate: {e}") from None
    return profile.model_copy(update={"deploy": deploy})


def load_for_device(path: str | Path) -> tuple[Profile, DeviceConfig | None]:
    """An entry point's one read on a device: the profile at `path` (load_profile: read, validated, preflighted) as this
    host's device applies it, and this host's device config (None without one). The device agent's modules are handed
    both and read neither again."""
    from edgeflow.preflight import load_profile

    device = load_device()
    return device_profile(load_profile(path), device), device
