"""The device's update lock: a switch waits while the serving server is busier than deploy.update_lock_max_in_flight."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile
from edgeflow.device.proxy import point_proxy
from edgeflow.device.switch import wait_update_lock
from tests.helpers.ports import free_port


def test_a_switch_waits_for_the_burst_and_gives_up_naming_the_limit(tmp_path):
    release = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            release.wait(30)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "edgeflow.serving.proxy", "--host", "127.0.0.1", "--port", str(port),
                              "--state", str(tmp_path / "proxy.json")], cwd=REPO_ROOT)
    try:
        base = load_profile("configs/test-tiny.yaml")
        p = base.model_copy(update={"deploy": base.deploy.model_copy(update={
            "port": port, "update_lock_max_in_flight": 0, "update_lock_timeout_s": 1.5})})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/_edgeflow/proxy", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        old = upstream.server_address[1]
        point_proxy(p, old)
        assert wait_update_lock(p, old) < 1  # idle: no wait
        busy = threading.Thread(target=lambda: httpx.get(f"http://127.0.0.1:{port}/slow", timeout=60))
        busy.start()
        time.sleep(0.5)
        with pytest.raises(TimeoutError, match=r"update lock held: .* port \d+ still had 1 requests in flight \(> "
                                               r"deploy.update_lock_max_in_flight=0\) after 2 s .*old version keeps serving"):
            wait_update_lock(p, old)
        threading.Timer(0.5, release.set).start()  # the burst ends: the switch goes ahead
        waited = wait_update_lock(p.model_copy(update={"deploy": p.deploy.model_copy(update={"update_lock_timeout_s": 20})}), old)
        assert 0.2 < waited < 20
        busy.join(30)
    finally:
        release.set()
        proxy.terminate()
        proxy.wait(10)
        upstream.shutdown()
