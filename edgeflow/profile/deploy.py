"""deploy: the edge deployment on a device (ports, keys, install directory, health).
"""
from __future__ import annotations

from pydantic import Field

from edgeflow.profile.base import _Strict


class DeployConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="Address the edge server binds; anything but loopback needs an API key "
                      "(api_key_file, or EDGEFLOW_API_KEY in the device's environment).")
    api_key_file: str | None = Field(
        default=None, description="File on the device with the keys clients must send (one per line, # comments); the "
        "edge servers read it at start, so editing it and redeploying rotates keys. None: $EDGEFLOW_API_KEY, else no key.",
    )
    auth_probes: bool = Field(
        default=False, description="With a key: /health, /ready and /metrics need it too (Prometheus then sends it: "
        "infra/prometheus/prometheus-auth.yml).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Stable port clients use (the device's proxy).")
    side_ports: list[int] = Field(
        default=[8001, 8002], min_length=2, max_length=2,
        description="Two loopback ports the edge servers alternate on (blue/green); the proxy on `port` forwards to one.",
    )
    drain_timeout_s: float = Field(default=120, gt=0, description="After a switch, wait this long for the old server's requests to finish.")
    build_on_device: bool = Field(
        default=True,
        description="If the shipped engine cannot run on this device: build one here from the checkpoint (true) or refuse the deploy (false).",
    )
    alias: str = Field(default="staging", description="Registry alias to deploy.")
    install_dir: str = Field(default=".edgeflow/device", description="Versioned model directories and logs on the device.")
    health_timeout_s: float = Field(default=180, gt=0, description="Give up waiting for /health after this long.")
    smoke_prompt: str = Field(default="What is the capital of France?", description="Chat request sent after the deploy.")
    access_log_rotate_s: float = Field(
        default=3600, ge=0, description="The edge servers cut their access log into a segment this often (and at "
        "64 MiB), so ship-logs has hourly segments to take home even from a quiet device; 0: on size only.",
    )
    update_lock_max_in_flight: int = Field(
        default=4, ge=0,
        description="Update lock: a switch waits while the serving version has more requests in flight than this (a "
        "device in a burst finishes it on the old version first).",
    )
    update_lock_timeout_s: float = Field(
        default=300, gt=0, description="Give up (the deploy fails, the old version keeps serving) if the update lock "
        "is still held after this long.",
    )
