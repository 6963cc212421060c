"""Long-lived processes started by pid file: spawn one detached, tell whether it lives, stop its process group.

    python -m edgeflow.ops.processes stop .edgeflow/run/edge-proxy.pid      # SIGTERM the group, SIGKILL after 20 s

Used by the edge deploy (edgeflow/device/spawn.py and proxy.py: edge servers and the proxy) and by the local services
(scripts/services.py: Prefect and MLflow servers, workers). A spawned process runs in its own session, so
it outlives the flow run or shell that started it, and stopping it signals its whole group (a supervisor
and its server, a server and its uvicorn workers). Standard library only: scripts/services.py imports it
before anything else is set up.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# How a group is stopped by default: SIGTERM (graceful: uvicorn finishes open responses), SIGKILL after 20 s.
TERM_THEN_KILL: tuple[tuple[int, float], ...] = ((signal.SIGTERM, 20.0), (signal.SIGKILL, 0.0))
# The lowest priority a process can take; 0 is this process's own (a negative value needs privileges).
MAX_NICE = 19


def spawn_detached(cmd: list[str], log: Path, pidfile: Path, cwd: Path, env: dict[str, str] | None = None,
                   nice: int = 0) -> int:
    """Start `cmd` in its own session, stdout and stderr appended to `log`, its pid written to `pidfile`; returns the pid.

    `env`: the child's whole environment (None: this process's). `nice`: added to the child's niceness before it
    runs, so it and every thread and process it starts yield the cores to processes at the default priority.
    """
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice={nice}: must be 0 (this process's priority) to {MAX_NICE} (the lowest); "
                         "a negative value would need privileges a service does not need")
    log.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
    pidfile.write_text(f"{proc.pid}\n")
    return proc.pid


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a local server answers `url` with 200 (a health or ready endpoint): what `up` waits for before it
    starts the next service, and why it leaves one that already answers alone."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def read_pid(pidfile: Path) -> int:
    """The pid a pid file holds (its first word)."""
    return int(Path(pidfile).read_text().split()[0])


def alive(pid: int) -> bool:
    """Is the process still running? A child of this process that exited stays a zombie, which signal 0 still
    reaches, until it is reaped: it is reaped here. A process this user may not signal counts as gone."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:  # not our child (or already reaped)
        pass
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_group(pid: int, steps: Sequence[tuple[int, float]] = TERM_THEN_KILL, poll_s: float = 0.2) -> None:
    """Send each (signal, seconds to wait) of `steps` to pid's process group in turn, until the process is gone."""
    stop_groups([pid], steps, poll_s)


def stop_groups(pids: Sequence[int], steps: Sequence[tuple[int, float]] = TERM_THEN_KILL, poll_s: float = 0.2) -> None:
    """stop_group for several groups at once: each step's signal goes to every group still alive, and the step's wait
    is shared, so stopping n services takes as long as the slowest, not the sum (five services that each take ~10 s
    to exit on SIGINT: 10 s, not 50)."""
    left = list(pids)
    for sig, wait in steps:
        for pid in list(left):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                left.remove(pid)
        deadline = time.time() + wait
        while left and time.time() < deadline:
            left = [pid for pid in left if alive(pid)]
            if left:
                time.sleep(poll_s)
        left = [pid for pid in left if alive(pid)]
        if not left:
            return


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["stop", "alive"])
    ap.add_argument("pidfile", type=Path)
    a = ap.parse_args()
    pid = read_pid(a.pidfile)
    if a.action == "stop":
        stop_group(pid)
        a.pidfile.unlink(missing_ok=True)
    print(f"pid {pid}: {'alive' if alive(pid) else 'gone'}")
