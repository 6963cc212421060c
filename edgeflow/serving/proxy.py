"""python -m edgeflow.serving.proxy --port 8000 --state .edgeflow/device/proxy.json

The stable port of a device. Clients talk to this proxy; it forwards each HTTP request (streams
included, chunk by chunk) to the edge server that currently serves, on a side port. A deploy starts
the new server on the other side port, health-gates it, then switches the upstream here: requests
already running finish on the old server, new ones go to the new one, and the old server is stopped
once its in-flight count reaches zero. No connection is cut and the stable port never closes, so a
rollout or a rollback is invisible to clients.

Why an HTTP-level proxy and not a TCP one or a socket handover: a TCP proxy pins every keep-alive
connection to the server it first reached, so stopping the old server would cut clients mid-session;
forwarding per request lets keep-alive clients move to the new server at their next request.

Control (loopback clients only): GET /_edgeflow/proxy -> {"upstream": port, "in_flight": {port: n}};
PUT /_edgeflow/proxy {"upstream": port} switches. The upstream is persisted in --state, so a proxy
restarted by its supervisor resumes forwarding to the same server.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgeflow.serving.settings import PROXY_POOL_KEEPALIVE_S, uvicorn_config

log = logging.getLogger("edgeflow.proxy")
CONTROL = "/_edgeflow/proxy"
# hop-by-hop headers (RFC 9110 §7.6.1) and those httpx/uvicorn recompute
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


class Upstream:
    """Which side port serves, persisted to a JSON file; and how many requests each port still runs."""

    def __init__(self, state: Path, initial: int | None) -> None:
        self.state = state
        self.port = initial
        if self.port is None and state.exists():
            self.port = int(json.loads(state.read_text())["upstream"])
        self.in_flight: collections.Counter[int] = collections.Counter()

    def switch(self, port: int) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"upstream": port}))
        os.replace(tmp, self.state)  # atomic: a restarted proxy never reads half a file
        self.port = port


def create_app(state: Path, upstream: int | None = None, host: str = "127.0.0.1") -> Starlette:
    """The proxy app: everything but the control path is forwarded to the current upstream."""
    up = Upstream(state, upstream)
    # no timeout on reading the body: the edge server enforces its own deadlines and ends streams itself
    # pooled connections expire before the edge server closes them (edgeflow.serving.settings): no request meets a closing socket
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), limits=httpx.Limits(
        max_keepalive_connections=32, keepalive_expiry=PROXY_POOL_KEEPALIVE_S))

    async def control(request: Request) -> Response:
        if request.client is None or request.client.host not in ("127.0.0.1", "::1"):
            return JSONResponse({"error": "the proxy control endpoint answers loopback clients only"}, status_code=403)
        if request.method == "PUT":
            body = await request.json()
            port = body.get("upstream")
            if not isinstance(port, int) or not 0 < port < 65536:
                return JSONResponse({"error": f"upstream must be a TCP port number, got {port!r}"}, status_code=422)
            up.switch(port)
        return JSONResponse({"upstream": up.port, "in_flight": {str(k): v for k, v in up.in_flight.items() if v}})

    async def forward(request: Request) -> Response:
        port = up.port
        if port is None:
            return JSONResponse({"error": {"message": "no edge server deployed on this device yet", "type": "unavailable"}},
                                status_code=503, headers={"Retry-After": "5"})
        url = httpx.URL(f"http://{host}:{port}{request.url.path}", query=request.url.query.encode())
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        up.in_flight[port] += 1
        try:
            upstream_request = client.build_request(request.method, url, headers=headers, content=await request.body())
            resp = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as e:
            up.in_flight[port] -= 1
            log.warning("%s %s: edge server on port %d unreachable: %r", request.method, request.url.path, port, e)
            return JSONResponse({"error": {"message": f"edge server on port {port} unreachable: {e!r}", "type": "unavailable"}},
                                status_code=502)

        async def done() -> None:
            await resp.aclose()
            up.in_flight[port] -= 1

        # aiter_raw passes bytes as they arrive (server-sent events stay token by token); if the client
        # goes away, Starlette stops iterating and `done` closes the upstream stream, which frees the
        # server's generation slot.
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out_headers, background=BackgroundTask(done))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(
        routes=[Route(CONTROL, control, methods=["GET", "PUT"]), Route("/{path:path}", forward, methods=methods)],
        lifespan=lifespan,
    )


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address of the stable port")
    ap.add_argument("--port", type=int, default=8000, help="the stable port clients use")
    ap.add_argument("--state", type=Path, required=True, help="JSON file holding the current upstream port")
    ap.add_argument("--upstream", type=int, default=None, help="initial upstream port (default: from --state)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.Server(uvicorn_config(create_app(a.state, a.upstream), a.host, a.port, timeout_graceful_shutdown=30)).run()


if __name__ == "__main__":
    main()
