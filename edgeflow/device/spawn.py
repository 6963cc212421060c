"""The device's processes: edge servers on the side ports started detached (edgeflow/ops/processes.py), a candidate
started and checked before it takes traffic, and everything this device started stopped.
"""
from __future__ import annotations

import sys
from pathlib import Path

from edgeflow.device.health import smoke_chat, wait_healthy
from edgeflow.device.identity import DeviceConfig
from edgeflow.device.keys import client_headers
from edgeflow.device.state import access_log_path, run_dir, side_port
from edgeflow.ops.processes import read_pid, spawn_detached, stop_group, stop_groups
from edgeflow.paths import REPO_ROOT
from edgeflow.profile import Profile


def start_detached(profile: Profile, name: str, cmd: list[str]) -> int:
    """Start a process detached in its own session (it outlives this flow run and its worker); pid file run/<name>.pid."""
    return spawn_detached(cmd, profile.work / "logs" / f"{name}.log", run_dir(profile) / f"{name}.pid", REPO_ROOT)


def stop_device(profile: Profile) -> list[str]:
    """Stop the proxy and every edge server this device started (by pid file); returns what was stopped."""
    stopped = []
    run = run_dir(profile)
    pids = {pf: read_pid(pf) for pf in (sorted(run.glob("edge-*.pid")) if run.exists() else [])}
    stop_groups(list(pids.values()))  # the proxy and every server at once
    for pf, pid in pids.items():
        pf.unlink(missing_ok=True)
        stopped.append(f"{pf.stem} (pid {pid})")
    return stopped


def start_server(profile: Profile, engine_dir: Path, version: str, port: int, device: DeviceConfig | None) -> int:
    """Start an edge server on `port`, detached; a stale server of ours on that port is stopped first. `device`: this
    host's config, whose chaos-test `faults` for `version` the server is started with."""
    name = f"edge-server-{port}"
    stale = run_dir(profile) / f"{name}.pid"
    if stale.exists():
        stop_group(read_pid(stale))
    access_log = access_log_path(profile)
    access_log.parent.mkdir(parents=True, exist_ok=True)
    faults = (device.faults.get(str(version), {}) if device else {})  # chaos testing only (device.yaml `faults`)
    # Under the supervisor: a server its watchdog ends (engine stalled) or that crashes comes back on
    # the same port; a bad engine or bad settings (exit 2) ends the supervisor at once, failing the deploy.
    return start_detached(profile, name, [
        sys.executable, "-m", "edgeflow.serving.supervisor", "--liveness-url", f"http://127.0.0.1:{port}/ready", "--",
        sys.executable, "-m", "edgeflow.serving.server",
        "--engine", str(engine_dir),
        "--backend", profile.engine.backend,
        "--host", "127.0.0.1",  # side ports are reached through the proxy only
        "--port", str(port),
        "--model-name", profile.registry.model_name,
        "--engine-version", version,
        "--access-log", str(access_log),
        "--access-log-rotate-s", str(profile.deploy.access_log_rotate_s),
        *(["--api-key-file", str(Path(profile.deploy.api_key_file).resolve())] if profile.deploy.api_key_file else []),
        "--auth-probes", "true" if profile.deploy.auth_probes else "false",
        *[arg for flag, value in sorted(faults.items()) for arg in ("--" + flag.replace("_", "-"), str(value))],
    ])


def start_candidate(profile: Profile, engine_dir: Path, version: str, package: Path,
                    device: DeviceConfig | None) -> dict:
    """Start the new version on the free side port, wait for a healthy deep probe, send a smoke chat.

    On any failure the candidate is stopped and the error re-raised: the serving version is untouched.
    """
    port = side_port(profile)
    pid = start_server(profile, engine_dir, version, port, device)
    url = f"http://127.0.0.1:{port}"
    try:
        headers = client_headers(profile)
        health = wait_healthy(url, profile.deploy.health_timeout_s, pid, headers)
        answer = smoke_chat(url, profile.registry.model_name, profile.deploy.smoke_prompt, headers=headers)
    except BaseException:
        stop_group(pid)
        (run_dir(profile) / f"edge-server-{port}.pid").unlink(missing_ok=True)
        raise
    return {"version": version, "port": port, "pid": pid, "engine": str(engine_dir), "package": str(package),
            "health": health, "smoke_answer": answer}
