"""In-process engine watchdog: a call into the engine that stops producing tokens ends the process.

    wd = Watchdog(stall_s=30); wd.start(on_stall=print); call = wd.begin(); wd.progress(call); wd.end(call)

Why exit instead of recovering in-process: a hung engine call is stuck inside native code (an ONNX
Runtime or TensorRT kernel, a CUDA sync), and a Python thread cannot be interrupted there. The only
reliable way to get the device back is a fresh process, so the watchdog tells the server (which
fails /health and sends an error event to every open stream), waits `grace_s` for those bytes to
leave, and exits with EXIT_STALLED; the supervisor (edgeflow.serving.supervisor, or systemd) starts a new
server. This is what turns "port open, HTTP 200, no body, forever" into a short, visible restart.

The watchdog runs in its own thread, so it also fires when the event loop itself is blocked.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("edgeflow.serving.watchdog")

# sysexits EX_SOFTWARE: distinct from 0 (clean stop) and 2 (bad config / incompatible engine,
# which a restart cannot fix), so the supervisor knows this exit is worth a restart.
EXIT_STALLED = 70


class Watchdog:
    """Tracks every engine call's last progress; fires once when any call is silent for `stall_s`."""

    def __init__(self, stall_s: float, grace_s: float = 1.0, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.stall_s = stall_s
        self.grace_s = grace_s
        self._exit = exit_fn
        self._calls: dict[int, float] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None

    @property
    def enabled(self) -> bool:
        return self.stall_s > 0

    def begin(self) -> int:
        """Register an engine call; its clock starts now (prefill counts)."""
        with self._lock:
            call = next(self._ids)
            self._calls[call] = time.monotonic()
            return call

    def progress(self, call: int) -> None:
        """The call produced a token."""
        with self._lock:
            if call in self._calls:
                self._calls[call] = time.monotonic()

    def end(self, call: int) -> None:
        """The call returned (finished, cancelled or failed)."""
        with self._lock:
            self._calls.pop(call, None)

    def longest_silence(self) -> float:
        """Seconds since the least recently progressing call last progressed (0 when idle)."""
        with self._lock:
            oldest = min(self._calls.values(), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def start(self, on_stall: Callable[[str], None]) -> None:
        """Begin watching in a daemon thread; `on_stall(reason)` runs once before the process exits."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, args=(on_stall,), name="engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, on_stall: Callable[[str], None]) -> None:
        tick = min(1.0, self.stall_s / 4)
        while not self._stop.wait(tick):
            silent = self.longest_silence()
            if silent < self.stall_s:
                continue
            self.fired = (
                f"engine made no progress for {silent:.1f} s (watchdog_stall_s={self.stall_s}); "
                "the server process exits so that its supervisor restarts it"
            )
            log.critical(self.fired)
            try:
                on_stall(self.fired)
            except Exception:  # noqa: BLE001 - exiting matters more than telling everyone
                log.exception("watchdog on_stall failed")
            time.sleep(self.grace_s)
            self._exit(EXIT_STALLED)
            return
