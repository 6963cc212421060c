"""Seconds of each step of `scripts/services.py up` from an empty EDGEFLOW_HOME: the servers' starts and health
waits, the pools and automation, the deploy, the workers' spawns.

    EDGEFLOW_HOME=/tmp/edgeflow-up .venv/bin/python benchmarks/services_up.py   # nothing of edgeflow's running

Wraps services.py's own steps (`_spawn`, `_wait`, `ensure_pools_and_automation`, and the `prefect` commands it runs)
to print when each starts and ends, from the moment `up` is called; then runs `down`. Prints the machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import services  # noqa: E402

from edgeflow.engines.cpu_host import device_fingerprint  # noqa: E402

T0 = time.time()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            label = args[0] if name in ("_spawn", "_wait") else ""
            if name == "run":
                label = " ".join(str(a) for a in args[0][1:4]).replace("\n", " ")[:60]
            print(f"  {name} {label}: {start - T0:6.1f} -> {time.time() - T0:6.1f} s", flush=True)
    return wrapper


def main() -> None:
    home = Path(os.environ.get("EDGEFLOW_HOME", ""))
    if not os.environ.get("EDGEFLOW_HOME") or (home.exists() and any(home.iterdir())):
        raise SystemExit("set EDGEFLOW_HOME to an empty or missing directory: this times `up` from nothing")
    print("machine:", device_fingerprint())
    for name in ("_spawn", "_wait", "ensure_pools_and_automation"):
        setattr(services, name, timed(name, getattr(services, name)))
    services.subprocess.run = timed("run", subprocess.run)
    global T0
    T0 = time.time()
    try:
        services.up()
        print(f"RESULT services.py up from nothing: {time.time() - T0:.1f} s")
    finally:
        services.subprocess.run = subprocess.run
        services.down()


if __name__ == "__main__":
    main()
