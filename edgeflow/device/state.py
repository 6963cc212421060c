"""What this device serves and where its files are: state.json (current and previous), the install and run
directories, the access log's path; whether a version already serves here, and the previous one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from edgeflow.profile import Profile


def run_dir(profile: Profile) -> Path:
    return profile.work / "run"


def device_dir(profile: Profile) -> Path:
    return profile.resolve(profile.deploy.install_dir)


def access_log_path(profile: Profile) -> Path:
    """The access log the device's edge servers write (and ship-logs ships): <install_dir>/access_logs/access.jsonl."""
    return device_dir(profile) / "access_logs" / "access.jsonl"


def read_state(profile: Profile) -> dict:
    """What this device serves: {"current": {...}, "previous": {...}} (version, port, pid, engine, package)."""
    path = device_dir(profile) / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(profile: Profile, state: dict) -> None:
    path = device_dir(profile) / "state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def previous_deployment(profile: Profile) -> dict:
    """The version this device served before the current one, or a clear error if there is none."""
    prev = read_state(profile).get("previous")
    if not prev:
        raise RuntimeError(
            f"nothing to roll back to: {device_dir(profile) / 'state.json'} records no previous deployment on this device"
        )
    if not Path(prev["package"]).exists():
        raise RuntimeError(f"previous version {prev['version']} is gone from {prev['package']}; redeploy it from the registry instead")
    return prev


def side_port(profile: Profile) -> int:
    """The side port not serving now (blue/green between deploy.side_ports)."""
    current = (read_state(profile).get("current") or {}).get("port")
    free = [p for p in profile.deploy.side_ports if p != current]
    return free[0]
