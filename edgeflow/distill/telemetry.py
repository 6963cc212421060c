"""Training telemetry: the stall watchdog (TrainingStalled when no optimizer step completes within
distill.stall_timeout_s, with the training thread's stack logged) and the training gauges pushed to a Prometheus
Pushgateway (GaugePusher; a failed push is logged, never raised).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Callable

import torch

logger = logging.getLogger("edgeflow.distill")


class TrainingStalled(RuntimeError):
    """No optimizer step completed within distill.stall_timeout_s."""


class StallWatchdog:
    """A timer thread that flags a stall when no step completes within `timeout_s`; the loop raises on the flag.

    Raising from the training loop (not killing the process) lets the MLflow run be marked FAILED and Prefect
    record the error. When the flag trips, the thread logs every thread's stack at once, so a step hung in
    native code (where Python cannot interrupt it) still says where it hangs, and `on_stall` runs (it
    pushes a stalled gauge). Collectives in a distributed run are bounded by torch.distributed's own timeout.
    """

    def __init__(self, timeout_s: float, total_steps: int, on_stall: Callable[[], None] | None = None):
        self.timeout_s, self.total_steps, self.on_stall = timeout_s, total_steps, on_stall
        self._last = time.monotonic()
        self._last_step = 0
        self._stop = threading.Event()
        self.stalled_after: float | None = None

    def beat(self, completed_steps: int | None = None) -> None:
        """Progress: a step (or a checkpoint write) completed."""
        self._last = time.monotonic()
        if completed_steps is not None:
            self._last_step = completed_steps

    def check(self) -> None:
        """Raise TrainingStalled if the watchdog tripped."""
        if self.stalled_after is not None:
            raise TrainingStalled(
                f"distill: no optimizer step completed for {self.stalled_after:.3g} s (distill.stall_timeout_s={self.timeout_s:g}); "
                f"{self._last_step} of {self.total_steps} steps were done. Training was stopped instead of hanging. If steps are "
                "legitimately this slow (a cold device, long sequences on a CPU, a big checkpoint write), raise distill.stall_timeout_s; "
                "otherwise see the stack logged with 'distill stalled' for what hangs (data, a collective, the device)."
            )

    def _watch(self) -> None:
        while not self._stop.is_set():
            waited = time.monotonic() - self._last
            if waited >= self.timeout_s:
                self.stalled_after = waited
                # the training thread (Prefect may run a task off the main thread)
                frame = sys._current_frames().get(self._trainer)
                stack = "".join(traceback.format_stack(frame)) if frame else "(training thread not found)"
                logger.error("distill stalled: no step for %.3g s (stall_timeout_s=%g); training thread at:\n%s", waited, self.timeout_s, stack)
                if self.on_stall:
                    try:
                        self.on_stall()
                    except Exception as e:  # noqa: BLE001 - reporting the stall must not hide it
                        logger.warning("stall report failed: %s", e)
                return
            self._stop.wait(self.timeout_s - waited)

    def __enter__(self) -> StallWatchdog:
        self._last = time.monotonic()
        self._trainer = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="distill-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class GaugePusher:
    """Training gauges pushed to a Prometheus Pushgateway (job "edgeflow-distill", grouped by run)."""

    JOB = "edgeflow-distill"

    def __init__(self, url: str, run: str):
        from prometheus_client import CollectorRegistry, Gauge

        self.url, self.grouping = url, {"run": run}
        self.registry = CollectorRegistry()
        g = lambda name, doc: Gauge(f"edgeflow_distill_{name}", doc, registry=self.registry)  # noqa: E731
        self.step = g("step", "Optimizer steps completed.")
        self.loss = g("loss", "Total distillation loss of the last step.")
        self.tokens_per_s = g("tokens_per_second", "Training tokens per second over the last step.")
        self.last_step_ts = g("last_step_timestamp_seconds", "Unix time the last optimizer step completed.")
        self.stalled = g("stalled", "1 when the stall watchdog tripped.")
        if torch.cuda.is_available():
            self.gpu_util = g("gpu_utilization_percent", "GPU utilisation (nvml), device 0.")
            self.gpu_mem = g("gpu_memory_allocated_bytes", "Bytes allocated by torch on the current CUDA device.")
        else:
            self.rss = g("process_rss_bytes", "Resident memory of the training process.")
        self._failures = 0

    def push(self, step: int | None = None, loss: float | None = None, tokens_per_s: float | None = None) -> bool:
        """Set the gauges and push them; a failed push is logged, not raised (telemetry never stops training)."""
        from prometheus_client import push_to_gateway

        if step is not None:
            self.step.set(step)
            self.last_step_ts.set(time.time())
        if loss is not None:
            self.loss.set(loss)
        if tokens_per_s is not None:
            self.tokens_per_s.set(tokens_per_s)
        if torch.cuda.is_available():
            try:
                self.gpu_util.set(torch.cuda.utilization())
            except Exception:  # noqa: BLE001 - utilisation needs nvml; memory is still reported
                pass
            self.gpu_mem.set(torch.cuda.memory_allocated())
        else:
            import psutil

            self.rss.set(psutil.Process().memory_info().rss)
        try:
            push_to_gateway(self.url, job=self.JOB, registry=self.registry, grouping_key=self.grouping, timeout=10)
            self._failures = 0
            return True
        except Exception as e:  # noqa: BLE001
            self._failures += 1
            if self._failures in (1, 10, 100):
                logger.warning("push to Pushgateway %s failed (%d in a row): %s", self.url, self._failures, e)
            return False

    def mark_stalled(self) -> None:
        self.stalled.set(1)
        self.push()

