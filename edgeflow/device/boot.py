"""Bring this device's current version back after a reboot: the model server, behind the stable port.

    python -m edgeflow.device.boot --profile configs/production-a100-orin.yaml      # what edgeflow-edge-server.service runs

systemd supervises the proxy (edgeflow-edge-proxy.service) and the worker (edgeflow-orin-worker.service), but the
edge servers deploy-edge starts are detached processes: after a reboot nothing starts them again. This replays
state.json: it reads the device's current deployment (version, side port, engine, package), verifies the
package's files against its manifest, starts the proxy unless one answers, starts the version's server on its
recorded side port under edgeflow/serving/supervisor.py, waits for a healthy deep probe, points the proxy at it, sends one
smoke chat through the stable port and records the new server's pid in state.json.

A power cut between a deploy's blue/green switch and its state write leaves the proxy's own state (proxy.json)
pointing at the candidate's port while state.json still names the old version, which is also the one the registry's
deployment record names (deploy-edge records a deployment only after the state write). Boot serves state.json's
version, points the proxy back at it, says so, and records it in state.json (`last_boot`).

The device's deploy settings are the profile's `deploy` block overridden by the device config
(edgeflow/device/identity.py: $EDGEFLOW_DEVICE_CONFIG, else $EDGEFLOW_HOME/device.yaml); without a device config, the
profile's block as written.

Idempotent: when the current version already serves, healthy, behind the proxy, nothing is touched.

Exit status and what it says:
  0  serving: "started version V on port P" or "version V already serves on port P (healthy); nothing to do";
     or "nothing to serve yet": state.json records no current version (the device was never deployed to).
  1  the server or the proxy did not come up (health timeout, the supervisor gave up, the stable port is held by
     something else); the message names the log. Nothing is left serving on the recorded side port.
  2  bad arguments, or a profile or device config that does not validate (the message names the field).
  3  the current version cannot be served from this device's files: its package is gone, fails verification, or
     its engine is gone or no longer runs here, or state.json is damaged (the message names the version, the path and the fix: deploy the
     version again with deploy-edge, which downloads, verifies and binds it anew).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import yaml

from edgeflow.profile import Profile
from edgeflow.device.identity import DeviceConfig, load_for_device

EXIT_SERVING, EXIT_FAILED, EXIT_CONFIG, EXIT_PACKAGE = 0, 1, 2, 3


class BootError(RuntimeError):
    """The current version could not be brought back; `code` is the exit status (module docstring)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def boot_time() -> float | None:
    """When this machine booted (epoch seconds, /proc/stat btime), or None where unknown."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def forget_stale_pidfiles(profile: Profile) -> list[str]:
    """Remove the device's pid files whose process is gone or that were written before this boot.

    After a reboot a recorded pid may belong to an unrelated process; start_server (and stop_device) signal a pid
    file's process group, so a pid file from before the boot must not survive it. Returns what was removed.
    """
    from edgeflow.device.state import run_dir
    from edgeflow.ops.processes import alive, read_pid

    run = run_dir(profile)
    booted = boot_time()
    removed = []
    for pf in sorted(run.glob("edge-*.pid")) if run.exists() else []:
        try:
            pid = read_pid(pf)
            before_boot = booted is not None and pf.stat().st_mtime < booted
        except (OSError, ValueError, IndexError):
            pid, before_boot = None, True  # unreadable: never signal what it names
        if before_boot or pid is None or not alive(pid):
            pf.unlink(missing_ok=True)
            removed.append(pf.name)
    return removed


def redeploy_fix(version: str) -> str:
    return (f"deploy it again with deploy-edge (python -m edgeflow.pipeline.deploy_edge --profile <profile> --alias <alias>, or a "
            f"deploy-edge run on this device's queue): it downloads, verifies and binds version {version} anew")


def check_files(profile: Profile, current: dict) -> tuple[Path, Path]:
    """The current deployment's package (verified against its manifest) and engine (present, runs on this device);
    BootError(EXIT_PACKAGE) naming the version, the path and the fix otherwise."""
    from edgeflow.tracking.artifacts import ChecksumError, verify_manifest
    from edgeflow.device.fetch import package_sha256
    from edgeflow.engines import EngineIncompatibleError, get_backend

    version = current["version"]
    fix = redeploy_fix(version)
    package, engine = Path(current["package"]), Path(current["engine"])
    if not package.is_dir():
        raise BootError(f"version {version}: its package {package} (state.json current.package) is gone; {fix}", EXIT_PACKAGE)
    try:
        verify_manifest(package)
        # fetch_version names the directory v<version>-<first 12 hex of the registered tree hash>
        tag = package.name.rpartition("-")[2]
        sha = package_sha256(package)
        if len(tag) == 12 and all(c in "0123456789abcdef" for c in tag) and sha and not sha.startswith(tag):
            raise ChecksumError(f"{package}: manifest hash {sha[:12]}… differs from the {tag}… its directory was installed as")
    except ChecksumError as e:
        raise BootError(f"version {version}: its package {package} fails verification ({e}); {fix}", EXIT_PACKAGE) from None
    if not engine.is_dir():
        raise BootError(f"version {version}: its engine {engine} (state.json current.engine) is gone; {fix}", EXIT_PACKAGE)
    try:
        get_backend(profile.engine.backend).check_compatible(engine)
    except (EngineIncompatibleError, OSError, ValueError) as e:
        raise BootError(f"version {version}: its engine {engine} no longer runs on this device ({e}); {fix}",
                        EXIT_PACKAGE) from None
    return package, engine


def _wait_for_proxy(profile: Profile, seconds: float) -> None:
    """Give a proxy another supervisor starts (systemd's edgeflow-edge-proxy) up to `seconds` to answer."""
    from edgeflow.device.proxy import control_url

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            httpx.get(control_url(profile), timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.5)


def boot(profile: Profile, device: DeviceConfig | None, wait_proxy_s: float = 0) -> str:
    """Serve state.json's current version again (module docstring); returns what was done, raises BootError."""
    from edgeflow.device.health import smoke_chat, wait_healthy
    from edgeflow.device.keys import client_headers
    from edgeflow.device.proxy import already_serving, ensure_proxy, point_proxy, public_url
    from edgeflow.device.spawn import start_server
    from edgeflow.device.state import device_dir, read_state, run_dir, write_state
    from edgeflow.ops.processes import stop_group

    try:
        current = read_state(profile).get("current")
    except ValueError as e:  # written atomically by the deploy; unreadable only if damaged
        raise BootError(f"{device_dir(profile) / 'state.json'} does not parse ({e}); deploy the device's version again "
                        "with deploy-edge", EXIT_PACKAGE) from None
    if not current or not current.get("version"):
        return (f"nothing to serve yet: {device_dir(profile) / 'state.json'} records no current version "
                "(deploy one with deploy-edge)")
    version = current["version"]
    if not current.get("package") or not current.get("engine") or not current.get("port"):
        raise BootError(f"{device_dir(profile) / 'state.json'}: current deployment {current} lacks package, engine or "
                        f"port; {redeploy_fix(version)}", EXIT_PACKAGE)
    port = int(current["port"])
    if wait_proxy_s > 0:
        _wait_for_proxy(profile, wait_proxy_s)
    if already_serving(profile, version, Path(current["package"])):
        return f"version {version} already serves on port {port} (healthy, behind the proxy); nothing to do"
    package, engine = check_files(profile, current)

    removed = forget_stale_pidfiles(profile)
    if removed:
        print(f"removed stale pid files: {', '.join(removed)}")
    interrupted = interrupted_switch(profile, port)
    if interrupted is not None:  # the power went between a deploy's switch and its state write
        print(f"an interrupted switch: the proxy last pointed at port {interrupted}, but state.json records version "
              f"{version} on port {port}; serving version {version} (the version the registry's deployment record names)")
    try:
        ensure_proxy(profile)
    except ValueError as e:  # check_exposure: a public bind without a key
        raise BootError(str(e), EXIT_CONFIG) from None
    except RuntimeError as e:
        raise BootError(f"the proxy on port {profile.deploy.port} did not come up: {e}", EXIT_FAILED) from None
    pid = start_server(profile, engine, version, port, device)
    log = profile.work / "logs" / f"edge-server-{port}.log"
    headers = client_headers(profile)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", profile.deploy.health_timeout_s, pid, headers)
        point_proxy(profile, port)
        smoke_chat(public_url(profile), profile.registry.model_name, profile.deploy.smoke_prompt, headers=headers)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        stop_group(pid)
        (run_dir(profile) / f"edge-server-{port}.pid").unlink(missing_ok=True)
        raise BootError(f"version {version} did not come back on port {port}: {e}; see {log}", EXIT_FAILED) from None
    state = read_state(profile)  # as written by the deploy; only the pid changed
    state["current"] = state["current"] | {"pid": pid}
    state["last_boot"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "version": version, "port": port,
                          "interrupted_switch_port": interrupted}
    write_state(profile, state)
    return (f"started version {version} on port {port} (pid {pid}), behind {public_url(profile)}"
            + (f"; the switch to port {interrupted} that a power cut interrupted was undone" if interrupted else ""))


def interrupted_switch(profile: Profile, port: int) -> int | None:
    """The side port the proxy's own state (proxy.json) points at when it is not state.json's: a deploy switched
    the proxy and did not live to write state.json. None when they agree (or the proxy never ran)."""
    import json

    from edgeflow.device.state import device_dir

    try:
        upstream = json.loads((device_dir(profile) / "proxy.json").read_text()).get("upstream")
    except (OSError, ValueError, AttributeError):
        return None
    return int(upstream) if upstream is not None and int(upstream) != port else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="the profile deploy-edge deploys this device with")
    ap.add_argument("--wait-proxy-s", type=float, default=0,
                    help="wait this long for a proxy another supervisor starts (systemd) before starting one")
    a = ap.parse_args(argv)
    try:
        profile, device = load_for_device(a.profile)
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"boot: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        print(f"boot: {boot(profile, device, a.wait_proxy_s)}")
    except BootError as e:
        print(f"boot: {e}", file=sys.stderr)
        return e.code
    return EXIT_SERVING


if __name__ == "__main__":
    sys.exit(main())
