"""The blue/green switch: wait for the serving server's update lock, point the proxy at the candidate, record the
new state, stop the old server.
"""
from __future__ import annotations

import time

import httpx

from edgeflow.device.failpoint import failpoint
from edgeflow.device.proxy import control_url, ensure_proxy, point_proxy
from edgeflow.device.state import read_state, run_dir, write_state
from edgeflow.ops.processes import stop_group
from edgeflow.profile import Profile


def wait_update_lock(profile: Profile, port: int) -> float:
    """The device's update lock: wait while the server on `port` has more requests in flight than
    deploy.update_lock_max_in_flight; returns the seconds waited, or raises once deploy.update_lock_timeout_s passed."""
    limit, start = profile.deploy.update_lock_max_in_flight, time.monotonic()
    while True:
        busy = httpx.get(control_url(profile), timeout=5).json()["in_flight"].get(str(port), 0)
        if busy <= limit:
            return time.monotonic() - start
        if time.monotonic() - start > profile.deploy.update_lock_timeout_s:
            raise TimeoutError(
                f"update lock held: the serving server on port {port} still had {busy} requests in flight (> "
                f"deploy.update_lock_max_in_flight={limit}) after {profile.deploy.update_lock_timeout_s:.0f} s "
                "(deploy.update_lock_timeout_s); the old version keeps serving. Retry when traffic is lower, or raise the limit"
            )
        time.sleep(0.5)


def switch_to(profile: Profile, candidate: dict) -> dict:
    """Point the stable port at the candidate, let the old server finish its requests, then stop it.

    The update lock comes first: while the serving version is busier than deploy.update_lock_max_in_flight, the
    switch waits; if it is still busy after deploy.update_lock_timeout_s, the candidate is stopped, the old
    version keeps serving and the deploy fails saying so."""
    state = read_state(profile)
    old = state.get("current")
    ensure_proxy(profile)
    waited = 0.0
    if old and old.get("port") != candidate["port"]:
        try:
            waited = wait_update_lock(profile, old["port"])
        except BaseException:
            stop_group(candidate["pid"])
            (run_dir(profile) / f"edge-server-{candidate['port']}.pid").unlink(missing_ok=True)
            raise
    failpoint("switch:locked")
    point_proxy(profile, candidate["port"])
    failpoint("switch:proxy-pointed")  # a power cut here: boot undoes the switch (edgeflow/device/boot.py)
    drained = True
    if old and old.get("port") != candidate["port"]:
        deadline = time.time() + profile.deploy.drain_timeout_s
        while time.time() < deadline:
            left = httpx.get(control_url(profile), timeout=5).json()["in_flight"].get(str(old["port"]), 0)
            if not left:
                break
            time.sleep(0.2)
        else:
            drained = False
        stop_group(old["pid"])
        (run_dir(profile) / f"edge-server-{old['port']}.pid").unlink(missing_ok=True)
    failpoint("switch:old-stopped")
    keep = {k: candidate[k] for k in ("version", "port", "pid", "engine", "package")}
    write_state(profile, {"current": keep, "previous": old and {k: old[k] for k in keep if k in old}})
    failpoint("switch:state-written")
    return {"switched_from": old and old.get("version"), "drained": drained, "update_lock_waited_s": round(waited, 1)}
