"""The Prefect server edgeflow starts (`python -m edgeflow.pipeline.server`): Prefect's own app, unchanged, behind one
ASGI layer that retries, inside the server, a request its SQLite database refused as busy.

Why: Prefect's server opens its write transactions DEFERRED. A transaction that read, then writes after another
connection committed (a worker's heartbeat, the event writers, another stage's state change), fails at once with
SQLITE_BUSY_SNAPSHOT; SQLite's busy timeout does not apply to it. Prefect answers 503 and its client waits
2**attempt s (2 s, then 4 s) before it asks again. On a release's hand-offs that was 2.0-2.4 s each, four to eight
times per release (py-spy on a cached re-run: 2.4 s of a 5.1 s hand-off inside one `create_task_run`;
BENCHMARKS.md#stage-fixed-costs). The same request asked again a few milliseconds later, in the server, succeeds.

What is retried is what Prefect's client would retry (any 503 Prefect's handler sends for a retryable error), with
the body the client sent, so its effect is the client's retry, minus the wait. After RETRY_BUDGET_S the 503 goes to
the client as before, and its own back-off takes over. A Postgres database (PREFECT_API_DATABASE_CONNECTION_URL)
needs none of this; the layer is harmless there (it sees no 503).

Every retried request is two lines in the server's log: `busy: POST /api/... refused, retrying for up to B s` at its first
refusal, then `busy: POST /api/... answered after N retries in T s` (count these for how often the lock was met).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# The first retry after 10 ms, then doubling (10, 20, 40 ... ms). Measured over a cold and a cached test-tiny release
# (2-core AMD EPYC with AVX-512, BENCHMARKS.md#stage-fixed-costs): five requests refused, each answered after 1-3
# retries in 0.04-0.16 s. The client's own back-off starts at 2 s, so 1.5 s of retries in the server costs a client
# nothing it would not have waited anyway.
FIRST_RETRY_S = 0.01
RETRY_BUDGET_S = 1.5

log = logging.getLogger("edgeflow.pipeline.server")


class BusyRetry:
    """ASGI middleware: an HTTP request answered 503 is run again (same method, path, headers and body) until it is
    answered otherwise or `budget_s` has passed; websockets and lifespan pass through untouched."""

    def __init__(self, app: App, budget_s: float = RETRY_BUDGET_S, first_s: float = FIRST_RETRY_S) -> None:
        self.app = app
        self.budget_s = budget_s
        self.first_s = first_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        start = time.monotonic()
        delay = self.first_s
        retries = 0
        while True:
            last = time.monotonic() - start + delay > self.budget_s
            held = await self._attempt(scope, body, receive, send, forward_503=last)
            if not held:
                if retries:
                    log.info("busy: %s %s answered after %d retries in %.3f s", scope["method"], scope["path"],
                             retries, time.monotonic() - start)
                return
            retries += 1
            if retries == 1:
                log.info("busy: %s %s refused, retrying for up to %.1f s", scope["method"], scope["path"], self.budget_s)
            await asyncio.sleep(delay)
            delay *= 2

    async def _attempt(self, scope: Scope, body: bytes, receive: Receive, send: Send, forward_503: bool) -> bool:
        """Run the app once. True when it answered 503 and that answer was held back (to retry); False when the
        answer went to the client."""
        replayed = False
        held = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, as the app would see it

        async def hold_or_send(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] == 503 and not forward_503:
                held = True
                return
            if not held:
                await send(message)

        try:
            # A copy: Starlette's routing writes the matched route into the scope it is given (root_path, path_params,
            # endpoint), and a retry on the written scope found no route (404).
            await self.app(dict(scope), replay, hold_or_send)
        except Exception:
            # Starlette re-raises the handled exception after its 503 went out (ServerErrorMiddleware), for the
            # server's log; a held 503 is retried instead. Anything else is the server's to log, as before.
            if held:
                return True
            raise
        return held


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away before it sent its body
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m edgeflow.pipeline.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=4200, help="port to listen on (default 4200)")
    args = p.parse_args(argv)

    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import get_current_settings

    # The retries' lines whatever level Prefect's server logs at (WARNING by default, which keeps uvicorn's access log
    # quiet): one handler of the module's own, not the root's.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    settings = get_current_settings().server
    # What `prefect server start` passes uvicorn for one worker process (prefect/cli/_server_utils.py).
    uvicorn.run(BusyRetry(create_app(final=True)), host=args.host, port=args.port,
                timeout_keep_alive=settings.api.keepalive_timeout, log_level=settings.logging_level.lower())


if __name__ == "__main__":
    main()
