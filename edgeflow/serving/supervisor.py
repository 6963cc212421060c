"""Keep one edge server running: restart it when it dies, give up when it keeps dying.

    python -m edgeflow.serving.supervisor -- python -m edgeflow.serving.server --engine engines/cpu --port 8001

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

A server that is frozen whole (SIGSTOP, a process stuck in the kernel, swap death) cannot run its own watchdog.
With `--liveness-url`, the supervisor asks that URL every `--liveness-interval-s`; any HTTP answer, even a 503 or
a 401, is alive. Once the server has answered, `--liveness-failures` silences in a row (each waited
`--liveness-timeout-s`) get it SIGKILLed and restarted like any crash. Defaults: 10 s × 3, so a frozen server is
back within about 45 s, before the EdgeflowTargetDown page (`for: 1m`) would go out; its restart still notifies
(EdgeflowServerRestarted). Before its first answer a server is loading, and deploy-edge's health wait owns it.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
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


class Liveness:
    """Whether the server still answers HTTP at all (see the module doc)."""

    def __init__(self, url: str, interval_s: float, timeout_s: float, failures: int) -> None:
        self.url, self.interval_s, self.timeout_s, self.failures = url, interval_s, timeout_s, failures

    _opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server's own port: never a proxy

    def answers(self) -> bool:
        try:
            with self._opener.open(self.url, timeout=self.timeout_s):
                return True
        except urllib.error.HTTPError:
            return True  # a status code is an answer: the process runs
        except (OSError, ValueError):  # refused, reset, timed out
            return False


class Supervisor:
    """Run `cmd`, restart on unexpected exits with backoff, stop on request."""

    def __init__(self, cmd: Sequence[str], max_restarts: int, window_s: float, backoff_s: float,
                 liveness: Liveness | None = None) -> None:
        self.cmd = list(cmd)
        self.liveness = liveness
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

    def _wait_child(self) -> int:
        """The child's exit status; with liveness on, a child that stops answering is killed first."""
        assert self.child is not None
        live = self.liveness
        if live is None:
            return self.child.wait()
        answered, silent = False, 0
        while True:
            try:
                return self.child.wait(timeout=live.interval_s)
            except subprocess.TimeoutExpired:
                pass
            if self.stopping:
                continue
            if live.answers():
                answered, silent = True, 0
            elif answered and self.child.poll() is None:
                silent += 1
                if silent >= live.failures:
                    self._log(f"server (pid {self.child.pid}) did not answer {live.url} within {live.timeout_s:g} s "
                              f"{silent} times in a row: frozen; killing it")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.child.pid, signal.SIGKILL)  # works on a stopped process too
                    return self.child.wait()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGINT, self._signal)
        recent: deque[float] = deque()
        delay = self.backoff_s
        while True:
            env = os.environ | {"EDGEFLOW_SERVER_RESTARTS": str(self.restarts)}
            self.child = subprocess.Popen(self.cmd, env=env, preexec_fn=_child_setup)
            started = time.monotonic()
            code = self._wait_child()
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
    p = argparse.ArgumentParser(prog="python -m edgeflow.serving.supervisor", description=__doc__.split("\n")[0])
    p.add_argument("--max-restarts", type=int, default=5, help="Restarts allowed within --window-s (default 5).")
    p.add_argument("--window-s", type=float, default=60.0, help="Window for --max-restarts, seconds (default 60).")
    p.add_argument("--backoff-s", type=float, default=0.5, help="First restart delay; doubles on quick repeats (default 0.5).")
    p.add_argument("--liveness-url", help="Restart the server when this URL stops answering (a frozen process), "
                   "e.g. http://127.0.0.1:8001/ready; unset: only exits restart it.")
    p.add_argument("--liveness-interval-s", type=float, default=10.0, help="Seconds between liveness checks (default 10).")
    p.add_argument("--liveness-timeout-s", type=float, default=5.0, help="How long one check waits (default 5).")
    p.add_argument("--liveness-failures", type=int, default=3, help="Silent checks in a row that kill the server (default 3).")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command line.")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command: give it after --, e.g. -- python -m edgeflow.serving.server --engine DIR")
    if args.max_restarts < 0 or args.window_s <= 0 or args.backoff_s < 0:
        p.error("--max-restarts must be >= 0, --window-s > 0 and --backoff-s >= 0")
    if args.liveness_interval_s <= 0 or args.liveness_timeout_s <= 0 or args.liveness_failures < 1:
        p.error("--liveness-interval-s and --liveness-timeout-s must be > 0 and --liveness-failures >= 1")
    liveness = (Liveness(args.liveness_url, args.liveness_interval_s, args.liveness_timeout_s, args.liveness_failures)
                if args.liveness_url else None)
    return Supervisor(cmd, args.max_restarts, args.window_s, args.backoff_s, liveness).run()


if __name__ == "__main__":
    sys.exit(main())
