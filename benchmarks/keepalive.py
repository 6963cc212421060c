"""Resets from the keep-alive race: a client reusing an idle connection just as the server closes it.

    python benchmarks/keepalive.py [--server-s 1.0] [--requests 40]

A real uvicorn server (idle timeout --server-s) and an httpx client (the OpenAI SDK's transport) send --requests
requests, each after an idle pause within ±1 % around the server's timeout. Prints the failed requests for a client
whose keepalive_expiry equals the server's timeout (uvicorn's and httpx's defaults are both 5 s) and for one whose
expiry is half of it. edgeflow.serving.settings.KEEPALIVE_S is chosen from this: the server outlasts the client.
"""
from __future__ import annotations

import argparse
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-s", type=float, default=1.0, help="the server's idle timeout (uvicorn timeout_keep_alive)")
    ap.add_argument("--requests", type=int, default=40, help="requests per client setting")
    a = ap.parse_args()

    async def ok(_request):
        return JSONResponse({"ok": True})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/", ok, methods=["POST"])]), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_keep_alive=a.server_s))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    for expiry in (a.server_s, a.server_s / 2):
        failed: list[str] = []
        with httpx.Client(limits=httpx.Limits(keepalive_expiry=expiry)) as client:
            for i in range(a.requests):
                try:
                    client.post(f"http://127.0.0.1:{port}/", content=b"x").raise_for_status()
                except httpx.HTTPError as e:
                    failed.append(type(e).__name__)
                time.sleep(a.server_s * (0.98 + 0.005 * (i % 10)))  # idle pauses from 0.98 to 1.025 × the timeout
        print(f"client keepalive_expiry {expiry:g} s, server timeout {a.server_s:g} s: {len(failed)} of {a.requests} "
              f"requests failed {sorted(set(failed))}")
    server.should_exit = True


if __name__ == "__main__":
    main()
