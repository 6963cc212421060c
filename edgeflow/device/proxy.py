"""The stable-port proxy: started unless one listens, pointed at a side port, its public and control URLs, and
whether a version already serves behind it.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import httpx

from edgeflow.device.keys import check_exposure, client_headers
from edgeflow.device.spawn import start_detached
from edgeflow.device.state import device_dir, read_state
from edgeflow.profile import Profile


def public_url(profile: Profile) -> str:
    """The stable URL clients use on this device."""
    host = "127.0.0.1" if profile.deploy.host in ("0.0.0.0", "::") else profile.deploy.host
    return f"http://{host}:{profile.deploy.port}"


def control_url(profile: Profile) -> str:
    return f"{public_url(profile)}/_edgeflow/proxy"


def ensure_proxy(profile: Profile, timeout: float = 30) -> dict:
    """Start the stable-port proxy unless one listens; returns its control state.

    Only a refused connection starts one: a proxy slow to answer on a busy device is waited for (up to `timeout`),
    never replaced, since a second proxy could not bind the port and its pid file would hide the first."""
    deadline = time.time() + timeout
    r = None
    while r is None:
        try:
            r = httpx.get(control_url(profile), timeout=5)
        except httpx.ConnectError:
            break
        except httpx.HTTPError as e:
            if time.time() > deadline:
                raise RuntimeError(f"port {profile.deploy.port} (deploy.port) accepts connections but its proxy did not answer "
                                   f"within {timeout:.0f} s ({e!r}); see {profile.work / 'logs' / 'edge-proxy.log'}") from e
            time.sleep(0.5)
    if r is not None:
        if r.status_code == 200 and "upstream" in r.json():
            return r.json()
        raise RuntimeError(
            f"port {profile.deploy.port} (deploy.port) answers but is not the edgeflow proxy ({r.status_code} on "
            f"{control_url(profile)}); stop what listens there (make down) or choose another deploy.port"
        )
    check_exposure(profile)
    start_detached(profile, "edge-proxy", [
        sys.executable, "-m", "edgeflow.serving.proxy", "--host", profile.deploy.host, "--port", str(profile.deploy.port),
        "--state", str(device_dir(profile) / "proxy.json"),
    ])
    deadline = time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(control_url(profile), timeout=2).json()
        time.sleep(0.2)
    raise RuntimeError(f"proxy on port {profile.deploy.port} did not start; see {profile.work / 'logs' / 'edge-proxy.log'}")


def point_proxy(profile: Profile, port: int) -> None:
    """Point the stable port's proxy at the server on side port `port` (the proxy persists it across restarts)."""
    r = httpx.put(control_url(profile), json={"upstream": port}, timeout=5)
    r.raise_for_status()


def already_serving(profile: Profile, version: str, package: Path) -> dict | None:
    """The current deployment if it is this version from this package, behind the proxy, and healthy now; else None.

    A re-run release or nightly that changed nothing asks for the version the device already serves;
    a second blue/green switch would only cost a cold start. Anything short of "same package, proxied,
    deep probe passes" (a crashed server, a proxy pointing elsewhere) is a real deploy.
    """
    current = read_state(profile).get("current") or {}
    if current.get("version") != version or Path(current.get("package", "")) != Path(package):
        return None
    try:
        upstream = httpx.get(control_url(profile), timeout=2).json().get("upstream")
        if upstream != current.get("port"):
            return None
        health = httpx.get(f"http://127.0.0.1:{current['port']}/health", timeout=profile.deploy.health_timeout_s,
                           headers=client_headers(profile))
    except (httpx.HTTPError, ValueError):
        return None
    return current | {"health": health.json()} if health.status_code == 200 else None
