"""The engine watchdog and the supervisor: a stalled engine becomes a short, visible restart.

The stall is real: the server's chaos setting `fault_stall_after_tokens` makes every engine call
block forever after N tokens, exactly as a stuck kernel would, inside the real server process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from edgeflow.serving.watchdog import EXIT_STALLED, Watchdog
from tests.helpers.ports import free_port

MODEL = "tiny-edge"


def _fires(wd: Watchdog, timeout: float) -> list[int]:
    codes: list[int] = []
    told: list[str] = []
    wd._exit = codes.append
    wd.start(on_stall=told.append)
    deadline = time.monotonic() + timeout
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.stop()
    assert len(told) == len(codes)
    return codes


def test_watchdog_fires_on_a_silent_call_and_not_on_a_progressing_one():
    # 2 s against a token every 50 ms: a false fire needs the token thread held off the CPU for 2 s, which no
    # loaded test box has done; the stalled case below keeps a short limit, since a late fire still fires
    wd = Watchdog(stall_s=2.0, grace_s=0.0)
    call = wd.begin()
    stop = threading.Event()

    def tokens():  # a call that keeps producing tokens for 3 s, longer than the stall limit
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            wd.progress(call)
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=tokens).start()
    codes = []
    wd._exit = codes.append
    wd.start(on_stall=lambda reason: None)
    stop.wait(5)
    assert codes == [] and wd.fired is None
    wd.end(call)
    assert wd.longest_silence() == 0.0
    wd.stop()

    stalled = Watchdog(stall_s=0.4, grace_s=0.0)
    stalled.begin()  # begins, never progresses (a hung prefill)
    assert _fires(stalled, 5) == [EXIT_STALLED]
    assert "no progress" in stalled.fired and "watchdog_stall_s=0.4" in stalled.fired


def test_watchdog_off_when_stall_is_zero():
    wd = Watchdog(stall_s=0)
    wd.begin()
    wd.start(on_stall=lambda r: None)
    assert wd._thread is None


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"supervisor exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become ready")


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_stalled_engine_ends_open_streams_with_an_error_and_the_supervisor_restarts_the_server(engine_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "edgeflow.serving.supervisor", "--backoff-s", "0.2", "--",
           sys.executable, "-m", "edgeflow.serving.server", "--engine", str(engine_dir), "--port", str(port),
           "--model-name", MODEL, "--watchdog-stall-s", "2", "--fault-stall-after-tokens", "3",
           "--request-timeout-s", "120", "--max-tokens-limit", "64"]
    sup = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(url, sup)
        assert _metric(url, "edgeflow_server_restarts") == 0
        pid_before = httpx.get(f"{url}/health", timeout=10).json()  # probes need 1 token: below the stall point
        assert pid_before["status"] == "healthy"

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40, "stream": True}
        t0 = time.monotonic()
        events = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        took = time.monotonic() - t0
        # three tokens arrive, then the engine hangs; the watchdog (2 s) ends the stream with an error
        # event long before the request's own 120 s deadline
        assert took < 10, took
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks)
        assert "error" in chunks[-1] and "no progress" in chunks[-1]["error"]["message"], chunks[-1]

        # the server exits 70 and comes back on the same port, counting the restart
        _wait_ready(url, sup)
        assert _metric(url, "edgeflow_server_restarts") == 1
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "healthy"
        text = log.read_text()
        assert f"server exited with status {EXIT_STALLED}; restarting" in text
    finally:
        os.killpg(sup.pid, signal.SIGTERM)  # as deploy-edge stops a server: the whole group
        code = sup.wait(timeout=30)
    assert code == 0, log.read_text()[-3000:]  # the server stopped cleanly on the one forwarded SIGTERM
    assert "forwarding SIGTERM" in log.read_text()


def test_supervisor_does_not_restart_a_server_that_cannot_start(tmp_path):
    """Exit 2 (incompatible engine, bad settings) is final: a deploy must see its candidate fail at once."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "edgeflow.serving.supervisor", "--", sys.executable, "-m", "edgeflow.serving.server",
                        "--engine", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "not restarting" in r.stderr and r.stderr.count("supervisor[") == 1
    assert time.monotonic() - t0 < 60


def test_supervisor_gives_up_after_max_restarts(tmp_path):
    runs = tmp_path / "runs"
    child = f"import os,sys; open({str(runs)!r},'a').write(os.environ['EDGEFLOW_SERVER_RESTARTS']+'\\n'); sys.exit(3)"
    r = subprocess.run([sys.executable, "-m", "edgeflow.serving.supervisor", "--max-restarts", "2", "--backoff-s", "0",
                        "--", sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert runs.read_text().split() == ["0", "1", "2"]  # first start + 2 restarts, each told its count
    assert "exceed --max-restarts=2; giving up" in r.stderr


@pytest.mark.parametrize("argv", [[], ["--max-restarts", "-1", "--", "true"], ["--liveness-failures", "0", "--", "true"]])
def test_supervisor_usage_errors(argv):
    r = subprocess.run([sys.executable, "-m", "edgeflow.serving.supervisor", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and ("no command" in r.stderr or "--max-restarts must be" in r.stderr or "--liveness-failures >= 1" in r.stderr)


def test_corrupt_tokens_chaos_changes_answers_while_requests_succeed(engine_dir):
    """fault_corrupt_every: the degraded-on-device case the rollout probe must catch (requests and /health still 200)."""
    from tests.helpers.live_server import LiveServer

    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    answers = {}
    for every in (None, 1):
        with LiveServer(engine_dir, model_name=MODEL, fault_corrupt_every=every) as s:
            assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers[every] = (r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"])
    (clean, n_clean), (bad, n_bad) = answers[None], answers[1]
    assert n_clean >= 1 and n_bad >= 1 and bad != clean


def test_supervisor_kills_and_restarts_a_server_that_stops_answering_and_leaves_a_loading_one_alone(tmp_path):
    """Liveness: a child that answered HTTP and then froze (SIGSTOP) is SIGKILLed and started again; before its first
    answer (loading) silence is not counted."""
    port = free_port()
    runs, hits = tmp_path / "runs", tmp_path / "hits"
    child = (f"import os,sys,time,http.server; open({str(runs)!r},'a').write(os.environ['EDGEFLOW_SERVER_RESTARTS']+'\\n'); "
             "time.sleep(1.5)\n"  # loading: nothing listens yet, and the liveness checks must not count it
             "class H(http.server.SimpleHTTPRequestHandler):\n"
             f"    def log_message(self, *a): open({str(hits)!r}, 'a').write('x')\n"  # one byte per request answered
             f"http.server.HTTPServer(('127.0.0.1',{port}),H).serve_forever()")
    sup = subprocess.Popen([sys.executable, "-m", "edgeflow.serving.supervisor", "--backoff-s", "0",
                            "--liveness-url", f"http://127.0.0.1:{port}/", "--liveness-interval-s", "0.2",
                            "--liveness-timeout-s", "0.3", "--liveness-failures", "3", "--", sys.executable, "-c", child],
                           cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        import psutil

        server = psutil.Process(sup.pid).children()[0]
        assert runs.read_text().split() == ["0"]  # not killed while loading
        deadline = time.monotonic() + 30  # the supervisor has seen it answer (its checks: every request but ours)
        while (len(hits.read_text()) if hits.exists() else 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while runs.read_text().split() != ["0", "1"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert runs.read_text().split() == ["0", "1"]
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        _, err = sup.communicate(timeout=30)
    assert "times in a row: frozen; killing it" in err and "exited with status -9; restarting" in err, err
