"""scripts/services.py down: what it stops."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from edgeflow.ops.processes import alive, spawn_detached

REPO = Path(__file__).resolve().parents[2]


def test_down_stops_the_edge_servers_of_a_profile_whose_workdir_is_inside_the_home(tmp_path: Path) -> None:
    """A second demo profile (workdir .edgeflow/demo-gemma3) keeps its edge server's pid file in its own run directory:
    `make down` stops it with the home's own processes, and leaves a pid file that is not an edge server's alone."""
    home = tmp_path / "home"
    pids = {}
    for name, pidfile in (("service", home / "run" / "worker-x.pid"), ("edge", home / "demo-x" / "run" / "edge-server-9.pid"),
                          ("other", home / "demo-x" / "run" / "something-else.pid")):
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        pids[name] = spawn_detached([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / f"{name}.log",
                                    pidfile, tmp_path)
    try:
        r = subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, capture_output=True, text=True,
                           env=os.environ | {"EDGEFLOW_HOME": str(home)}, timeout=120)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(pids["service"]) or alive(pids["edge"])):
            time.sleep(0.1)
        assert not alive(pids["service"]) and not alive(pids["edge"])
        assert "stopped edge-server-9" in r.stdout and "stopped worker-x" in r.stdout
        assert not (home / "demo-x" / "run" / "edge-server-9.pid").exists()
        assert alive(pids["other"]) and (home / "demo-x" / "run" / "something-else.pid").exists()
    finally:
        for pid in pids.values():
            try:
                os.killpg(pid, 9)
            except ProcessLookupError:
                pass
