"""Admission of generation requests: `max_concurrency` running, `max_queue` waiting, 429 beyond, and
the request deadline (`request_timeout_s` from arrival, queueing included; 504 while still waiting).

    deadline = await admit(admission, started=rec.started, timeout_s=settings.request_timeout_s)
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from edgeflow.serving.protocol import ApiError


class QueueFull(Exception):
    pass


class Admission:
    """Slots and a FIFO queue, driven from the event loop thread only (so no locks)."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self, timeout: float) -> None:
        """Take a slot, waiting at most `timeout` s; QueueFull at once if the queue is full."""
        if self.active < self.max_active and not self.waiting:
            self.active += 1
            return
        if self.waiting >= self.max_queue:
            raise QueueFull
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # a slot was handed over just as we gave up: pass it on
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        # Hand the slot straight to the oldest waiter (active stays the same), else free it.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


async def admit(admission: Admission, started: float, timeout_s: float) -> float:
    """Take a slot for a request that arrived at `started` (time.monotonic) and has `timeout_s` in all;
    returns its deadline. 429 + Retry-After at once when the queue is full, 504 when the wait outlasts it."""
    deadline = started + timeout_s
    try:
        await admission.acquire(max(0.0, deadline - time.monotonic()))
    except QueueFull:
        raise ApiError(
            429,
            f"server is at capacity: {admission.active} generating (max_concurrency={admission.max_active}) "
            f"and {admission.waiting} waiting (max_queue={admission.max_queue}); retry shortly",
            code="rate_limit_exceeded", headers={"Retry-After": "1"},
        ) from None
    except TimeoutError:
        raise ApiError(
            504, f"waited {time.monotonic() - started:.1f} s for a generation slot; "
            f"request_timeout_s={timeout_s}", code="timeout",
        ) from None
    return deadline
