"""The stable-port proxy between two real edge servers: streams pass through, a switch moves new
requests only, the in-flight count drains, and the upstream survives a proxy restart."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.live_server import LiveServer
from tests.helpers.ports import free_port

MODEL = "tiny-edge"


class LiveProxy:
    def __init__(self, state, upstream=None) -> None:
        import uvicorn

        from edgeflow.serving.proxy import create_app
        from edgeflow.serving.settings import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(create_app(state, upstream), "127.0.0.1", self.port))  # as edgeflow.serving.proxy runs
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveProxy":
        self.thread.start()
        for _ in range(200):
            try:
                httpx.get(f"{self.url}/_edgeflow/proxy", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("proxy did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def control(self, **body) -> dict:
        r = httpx.put(f"{self.url}/_edgeflow/proxy", json=body, timeout=5) if body else httpx.get(f"{self.url}/_edgeflow/proxy", timeout=5)
        return r.json() | {"_status": r.status_code}


@pytest.fixture(scope="module")
def blue_green(engine_dir):
    with LiveServer(engine_dir, model_name=MODEL, engine_version="blue") as blue, \
            LiveServer(engine_dir, model_name=MODEL, engine_version="green") as green:
        yield blue, green


def _version(url: str) -> str:
    return httpx.get(f"{url}/health", timeout=30).json()["engine"]["engine_version"]


def test_no_upstream_yet_is_503_with_retry_after(tmp_path):
    with LiveProxy(tmp_path / "proxy.json") as proxy:
        r = httpx.get(f"{proxy.url}/v1/models", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] and "no edge server" in r.text


def test_stream_passes_through_and_switch_moves_only_new_requests(blue_green, tmp_path):
    blue, green = blue_green
    state = tmp_path / "proxy.json"
    with LiveProxy(state, blue.port) as proxy:
        assert _version(proxy.url) == "blue"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 60, "stream": True}
        chunks: list[str] = []
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{proxy.url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:  # the first event arrives before the generation is over: streaming, not buffering
                if line.startswith("data: "):
                    chunks.append(line)
                    break
            assert proxy.control()["in_flight"] == {str(blue.port): 1}
            switched = proxy.control(upstream=green.port)
            assert switched["upstream"] == green.port and json.loads(state.read_text()) == {"upstream": green.port}
            assert _version(proxy.url) == "green"  # a new request goes to the new server …
            chunks += [line for line in lines if line.startswith("data: ")]  # … while this stream finishes on blue
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 5
        for _ in range(50):
            if proxy.control()["in_flight"] == {}:
                break
            time.sleep(0.1)
        assert proxy.control()["in_flight"] == {}
    with LiveProxy(state) as restarted:  # a restarted proxy resumes with the persisted upstream
        assert restarted.control()["upstream"] == green.port and _version(restarted.url) == "green"


def test_bad_switch_is_refused_and_a_dead_upstream_is_502(blue_green, tmp_path):
    with LiveProxy(tmp_path / "proxy.json", blue_green[0].port) as proxy:
        refused = proxy.control(upstream="8001")
        assert refused["_status"] == 422 and "TCP port" in refused["error"]
        assert proxy.control()["upstream"] == blue_green[0].port
        proxy.control(upstream=free_port())  # nothing listens there
        r = httpx.get(f"{proxy.url}/v1/models", timeout=5)
        assert r.status_code == 502 and "unreachable" in r.text


def _exchange(sock, path: str) -> bytes:
    """One HTTP/1.1 request on an open socket; the response head and body as bytes."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
    if fields.get(b"transfer-encoding") == b"chunked":  # the proxy streams: read to the last, empty chunk
        while not body.endswith(b"0\r\n\r\n"):
            body += sock.recv(65536)
    else:
        while len(body) < int(fields[b"content-length"]):
            body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_an_idle_connection_stays_open_past_the_clients_own_keep_alive(blue_green, tmp_path):
    """httpx (and the OpenAI SDK on it) reuses an idle connection for up to 5 s. A server closing at 5 s too resets
    a request now and then; the proxy and the edge server keep idle connections longer, so the client always gives
    up first, and the proxy's pool lets its own connections go before the edge server would."""
    import socket

    from edgeflow.serving.settings import KEEPALIVE_S, PROXY_POOL_KEEPALIVE_S

    blue = blue_green[0]
    with LiveProxy(tmp_path / "proxy.json", blue.port) as proxy:
        conns = {name: socket.create_connection(("127.0.0.1", port), timeout=30)
                 for name, port in (("proxy", proxy.port), ("edge server", blue.port))}
        for sock in conns.values():
            assert b" 200 " in _exchange(sock, "/v1/models").split(b"\r\n")[0]
        time.sleep(6)  # idle past httpx's default keepalive_expiry (5 s)
        answers = {name: _exchange(sock, "/v1/models").split(b"\r\n")[0] for name, sock in conns.items()}
        for sock in conns.values():
            sock.close()
    assert answers == {"proxy": b"HTTP/1.1 200 OK", "edge server": b"HTTP/1.1 200 OK"}
    assert PROXY_POOL_KEEPALIVE_S < KEEPALIVE_S
