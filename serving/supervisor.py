"""Keep one edge server running: restart it when it dies, give up when it keeps dying.

    python -m serving.supervisor -- python -m serving.server --engine engines/cpu --port 8001

deploy-edge starts every edge server under this supervisor, so a server that its watchdog ends
(exit 70) or that crashes comes back on the same port within seconds, without anyone watching.
Exit status 0 (asked to stop) and 2 (bad settings, incompatible engine) are final: a restart
cannot fix them, and deploy-edge must see the candidate fail at once. More than `--max-restarts`
restarts within `--window-s` also ends the supervisor (like systemd's StartLimitBurst), with the
server's last exit status, so a model that crashes on every request does not flap forever.

The server runs in its own process group and receives SIGTERM/SIGINT from here exactly once
(uvicorn treats a second signal as "stop now, drop open responses", which would break draining).
If the supervisor itself is killed, the kernel kills the server too (PR_SET_PDEATHSIG).
Each (re)start passes EDGEFLOW_SERVER_RESTARTS to the server, which exports it as a metric.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence

FINAL_EXIT_CODES = (0, 2)
PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    os.setpgrp()  # a signal to the supervisor's group must not reach the server a second time
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc Linux: the server may outlive a SIGKILLed supervisor
        pass


def _exit_status(code: int, forwarded: int | None) -> int:
    """The supervisor's own exit status: 0 when the server stopped on the signal we forwarded
    (uvicorn re-raises it after a clean shutdown), else the server's status (128+N for signal N)."""
    if forwarded is not None and code in (0, -forwarded):
        return 0
    return code if code >= 0 else 128 - code


class Supervisor:
    """Run `cmd`, restart on unexpected exits with backoff, stop on request."""

    def __init__(self, cmd: Sequence[str], max_restarts: int, window_s: float, backoff_s: float) -> None:
        self.cmd = list(cmd)
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.restarts = 0
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.forwarded: int | None = None

    def _log(self, msg: str) -> None:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} supervisor[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)

    def _signal(self, signum: int, _frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.forwarded = signum
        if self.child is not None and self.child.poll() is None:
            self._log(f"forwarding {signal.Signals(signum).name} to the server (pid {self.child.pid})")
            self.child.send_signal(signum)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        recent: deque[float] = deque()
        delay = self.backoff_s
        while True:
            env = os.environ | {"EDGEFLOW_SERVER_RESTARTS": str(self.restarts)}
            self.child = subprocess.Popen(self.cmd, env=env, preexec_fn=_child_setup)
            started = time.monotonic()
            code = self.child.wait()
            if self.stopping or code in FINAL_EXIT_CODES:
                self._log(f"server exited with status {code}; not restarting")
                return _exit_status(code, self.forwarded)
            now = time.monotonic()
            recent.append(now)
            while recent and now - recent[0] > self.window_s:
                recent.popleft()
            if len(recent) > self.max_restarts:
                self._log(f"server exited with status {code}; {len(recent)} exits within {self.window_s:g} s "
                          f"exceed --max-restarts={self.max_restarts}; giving up")
                return _exit_status(code, None) or 1
            # Back off only when it dies quickly; a server that ran a while restarts at once.
            delay = self.backoff_s if now - started > self.window_s else min(delay * 2, 30.0)
            self._log(f"server exited with status {code}; restarting in {delay:g} s")
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not self.stopping:
                time.sleep(0.05)
            if self.stopping:
                return 0
            self.restarts += 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--max-restarts", type=int, default=5, help="Restarts allowed within --window-s (default 5).")
    p.add_argument("--window-s", type=float, default=60.0, help="Window for --max-restarts, seconds (default 60).")
    p.add_argument("--backoff-s", type=float, default=0.5, help="First restart delay; doubles on quick repeats (default 0.5).")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command line.")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command: give it after --, e.g. -- python -m serving.server --engine DIR")
    if args.max_restarts < 0 or args.window_s <= 0 or args.backoff_s < 0:
        p.error("--max-restarts must be >= 0, --window-s > 0 and --backoff-s >= 0")
    return Supervisor(cmd, args.max_restarts, args.window_s, args.backoff_s).run()


if __name__ == "__main__":
    sys.exit(main())
