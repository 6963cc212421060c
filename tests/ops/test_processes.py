"""Detached processes by pid file: spawned in their own session, stopped by process group."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from edgeflow.ops.processes import alive, read_pid, spawn_detached, stop_group, stop_groups


def test_spawn_writes_log_and_pidfile_and_stop_ends_the_whole_group(tmp_path):
    # a parent that starts a child in its own group and ignores SIGTERM: only the group's SIGKILL ends both
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    log, pidfile = tmp_path / "logs" / "p.log", tmp_path / "run" / "p.pid"
    pid = spawn_detached([sys.executable, "-c", code], log, pidfile, tmp_path)
    assert read_pid(pidfile) == pid and alive(pid)
    deadline = time.time() + 30
    while not log.read_text().strip() and time.time() < deadline:
        time.sleep(0.1)
    child = int(log.read_text().split()[0])
    t0 = time.time()
    stop_group(pid, ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)))
    assert not alive(pid) and time.time() - t0 >= 1.0  # SIGTERM was ignored for its full wait, then SIGKILL
    deadline = time.time() + 5
    while alive(child) and time.time() < deadline:  # the child (not ours) is reaped by init
        time.sleep(0.1)
    assert not alive(child)


def test_stop_of_a_gone_process_returns_and_a_gone_pid_is_not_alive(tmp_path):
    pid = spawn_detached([sys.executable, "-c", "pass"], tmp_path / "l.log", tmp_path / "p.pid", tmp_path)
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:  # alive reaps the exited child (else it stays a zombie)
        time.sleep(0.05)
    assert not alive(pid)
    stop_group(pid)  # no such group any more: nothing to do, no error


def test_stopping_several_groups_shares_each_steps_wait(tmp_path):
    """Three groups that ignore SIGTERM: one shared SIGTERM wait, then SIGKILL ends all three (not three waits in a
    row); one that exits on SIGTERM is gone after the first step, and a pid already gone is skipped."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    pids = []
    for i, code in enumerate([stubborn] * 3 + ["import time; print('up', flush=True); time.sleep(60)"]):
        pids.append(spawn_detached([sys.executable, "-c", code], tmp_path / f"{i}.log", tmp_path / f"{i}.pid", tmp_path))
    gone = spawn_detached([sys.executable, "-c", "pass"], tmp_path / "g.log", tmp_path / "g.pid", tmp_path)
    deadline = time.time() + 30
    while time.time() < deadline and not all((tmp_path / f"{i}.log").read_text().strip() for i in range(4)):
        time.sleep(0.1)  # every handler installed before the first signal
    while alive(gone) and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    stop_groups(pids + [gone], ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)))
    took = time.time() - t0
    assert not any(alive(p) for p in pids)
    assert 2.0 <= took < 2.0 * 3, took  # one shared 2 s SIGTERM wait, not one per stubborn group


def test_a_niced_spawn_and_the_processes_it_starts_run_at_the_lower_priority(tmp_path):
    # the child prints its own niceness and its child's: both are the parent's plus 7
    code = ("import os, subprocess, sys; "
            "c = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'], capture_output=True, text=True); "
            "print(os.nice(0), c.stdout.strip(), flush=True)")
    log = tmp_path / "n.log"
    pid = spawn_detached([sys.executable, "-c", code], log, tmp_path / "n.pid", tmp_path, nice=7)
    deadline = time.time() + 30
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    base = os.nice(0)
    assert log.read_text().split() == [str(min(base + 7, 19))] * 2


def test_a_nice_value_outside_what_a_service_may_take_is_refused_before_anything_starts(tmp_path):
    for bad in (-1, 20):
        with pytest.raises(ValueError, match=rf"nice={bad}: must be 0 .* to 19"):
            spawn_detached([sys.executable, "-c", "pass"], tmp_path / "x.log", tmp_path / "x.pid", tmp_path, nice=bad)
    assert not (tmp_path / "x.pid").exists()
