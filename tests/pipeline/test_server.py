"""edgeflow/pipeline/server.py: the Prefect server edgeflow starts retries, inside the server, a write its SQLite
database refused as busy, so a client is answered without its 2 s back-off.

The server is Prefect's own, started as `scripts/services.py up` starts it, on its own SQLite file. The busy database
is real: another connection holds SQLite's write lock (BEGIN IMMEDIATE), as a heartbeat or an event writer does, and
Prefect's DEFERRED transaction that read first cannot take it.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgeflow.ops.processes import answers
from tests.helpers.ports import free_port


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    log = home / "server.log"
    env = os.environ | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                        "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgeflow.pipeline.server", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode}: {log.read_text()[-3000:]}")
        if answers(f"{url}/health"):
            break
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the server did not answer in 180 s: {log.read_text()[-3000:]}")
    yield url, home / "prefect.db", log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _hold_write_lock(db: Path, seconds: float = 0.0, release: threading.Event | None = None) -> threading.Thread:
    """Another writer: SQLite's write lock held for `seconds` (or until `release` is set), then a committed write.
    Returns once the lock is held."""
    held = threading.Event()

    def hold():
        con = sqlite3.connect(db, isolation_level=None, timeout=30)
        con.execute("BEGIN IMMEDIATE")
        con.execute("CREATE TABLE IF NOT EXISTS edgeflow_test_writer (x INTEGER)")
        con.execute("INSERT INTO edgeflow_test_writer VALUES (1)")
        held.set()
        if release is not None:
            release.wait(60)
        else:
            time.sleep(seconds)
        con.execute("COMMIT")
        con.close()

    writer = threading.Thread(target=hold, daemon=True)
    writer.start()
    assert held.wait(30)
    return writer


def test_a_write_refused_as_busy_is_answered_once_the_lock_is_gone_not_with_a_503(prefect_server):
    url, db, log = prefect_server
    with httpx.Client(base_url=url, timeout=60) as api:  # no client retries: what the server answers, as it answers
        assert api.post("/work_pools/", json={"name": "busy-test", "type": "process"}).status_code == 201
        flow = api.post("/flows/", json={"name": "busy-test"}).json()
        # the lock is held until the server says the request met it (no timing: on a loaded box the request may
        # reach the database late), then released within the server's retry budget
        release = threading.Event()
        _hold_write_lock(db, release=release)
        answer: dict = {}
        # create_flow_run reads the pool's queue, then inserts: the transaction SQLite refuses while the lock is held
        request = threading.Thread(target=lambda: answer.update(r=api.post(
            "/flow_runs/", json={"flow_id": flow["id"], "work_pool_name": "busy-test"})))
        request.start()
        deadline = time.monotonic() + 60
        while request.is_alive() and time.monotonic() < deadline and \
                "busy: POST /api/flow_runs/ refused" not in log.read_text():
            time.sleep(0.005)
        release.set()
        request.join(60)
    r = answer["r"]
    assert r.status_code == 201, (r.status_code, r.text)
    assert r.json()["work_pool_name"] == "busy-test"
    retried = [line for line in log.read_text().splitlines() if "busy: POST /api/flow_runs/ answered after" in line]
    assert retried, "the flow run was created without meeting the lock: the test proved nothing"


def test_a_lock_held_past_the_budget_reaches_the_client_as_prefects_503(prefect_server):
    """The server gives up after RETRY_BUDGET_S and the client gets Prefect's own answer, which its back-off retries."""
    from edgeflow.pipeline.server import RETRY_BUDGET_S

    url, db, log = prefect_server
    with httpx.Client(base_url=url, timeout=60) as api:
        assert api.post("/work_pools/", json={"name": "busy-test-long", "type": "process"}).status_code == 201
        flow = api.post("/flows/", json={"name": "busy-test-long"}).json()
        writer = _hold_write_lock(db, RETRY_BUDGET_S + 3)
        r = api.post("/flow_runs/", json={"flow_id": flow["id"], "work_pool_name": "busy-test-long"})
        writer.join(30)
    assert r.status_code == 503
    assert r.json() == {"exception_message": "Service Unavailable"}
