"""What the end-to-end tests share: runs of the real deployments (polled every second), the flow runs a release
made, the version a stable port serves, a flow run read, awaited, retried as the UI does, its states and subflows, a rollout's persisted state, a release the student gate refuses, and clearing a test port a killed session left held."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_deployment(name: str, **kwargs):
    """Prefect's run_deployment, polling the flow run's state every second: its default, 5 s, adds 2.5 s on average to
    every call a test waits on (edgeflow/pipeline/stages.py polls the stages at POLL_S for the same reason)."""
    from prefect.deployments import run_deployment as run

    return run(name, **({"poll_interval": 1} | kwargs))


def clear_stale_servers(*ports: str) -> None:
    """Stop a Prefect or MLflow server that still listens on one of these test ports after `services.py down`: one a
    killed earlier session left behind, whose store may be gone. `up` would take it for this session's (it answers)
    and every call would fail against its missing store. Anything else on the port fails the fixture, naming it."""
    import signal

    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.status != "LISTEN" or str(conn.laddr.port) not in ports or conn.pid is None:
            continue
        proc = psutil.Process(conn.pid)
        cmdline = " ".join(proc.cmdline())
        if not any(s in cmdline for s in ("prefect server start", "edgeflow.pipeline.server", "mlflow server", "mlflow.server", "uvicorn", "gunicorn")):
            pytest.fail(f"test port {conn.laddr.port} is held by pid {conn.pid} ({cmdline[:200]}); stop it or set the "
                        "EDGEFLOW_TEST_*_PORT variables")
        try:
            os.killpg(os.getpgid(conn.pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs([proc], timeout=10)


def stage_flow_runs(release_id: str) -> dict[str, list]:
    """{stage: [flow runs]} of a release's pool-placed stages, by the tags edgeflow/pipeline/stages.py gives them."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"edgeflow.release:{release_id}"])))

    out: dict[str, list] = {}
    for r in asyncio.run(read()):
        out.setdefault(next(t.split(":", 1)[1] for t in r.tags if t.startswith("edgeflow.stage:")), []).append(r)
    return out


def flow_runs_of(flow_name: str) -> list:
    """Every flow run of one flow (e.g. deploy-edge), any state."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])), limit=200)

    return asyncio.run(read())


def read_flow_run(flow_run_id):
    """The flow run as the Prefect API has it now."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    return asyncio.run(read())


def flow_run_states(flow_run_id) -> list:
    """Every state the flow run went through, oldest first."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run_states(flow_run_id)

    return asyncio.run(read())


def child_flow_runs(flow_run_id) -> list:
    """The subflow runs (and deployment runs started as subflows) of one flow run."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))

    return asyncio.run(read())


def wait_final(flow_run_id, timeout: float, runs: int = 1):
    """The flow run once it is final (and has run `runs` times: a Retry's), or as it is after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    run = read_flow_run(flow_run_id)
    while time.monotonic() < deadline and not (run.state.is_final() and run.run_count >= runs):
        time.sleep(1)
        run = read_flow_run(flow_run_id)
    return run


def retry_flow_run(flow_run_id, message: str) -> None:
    """What the Prefect UI's Retry button sends: the run, final, set AwaitingRetry."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    async def retry():
        async with get_client() as client:
            await client.set_flow_run_state(flow_run_id, AwaitingRetry(message=message), force=True)

    asyncio.run(retry())


def wait_for_rollout_state(flow_run_id, ready, timeout: float = 600):
    """The rollout state the run persisted (MLflow `edgeflow-rollouts`), once `ready(state)` holds."""
    import time

    from edgeflow.fleet.rollout import find_state

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = find_state(str(flow_run_id))
        if state is not None and ready(state):
            return state
        time.sleep(0.5)
    raise AssertionError(f"rollout {flow_run_id}: no persisted state that is ready after {timeout:.0f} s "
                         f"(last: {find_state(str(flow_run_id))}; run: {read_flow_run(flow_run_id).state})")


def served_version(port: int, model: str) -> str:
    """The version a stable port serves, as its answers say (system_fingerprint = the registered version)."""
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.json()["system_fingerprint"]


STUDENT_REFUSED = "Nothing was registered, staged or deployed. Fix: train longer (distill.steps, now 3)"


def refused_release(c, profile_path: Path, name: str, expect: str = STUDENT_REFUSED) -> tuple[object, dict, set[str]]:
    """Run a release that is refused (by default by the student gate: `expect` is in its failure message); check that
    it registered, moved and deployed nothing. Returns the flow run, its report, and the stages that ran an MLflow run
    under its parent run."""
    import re

    def staging_version():
        from mlflow.exceptions import MlflowException

        try:
            return c.get_model_version_by_alias(name, "staging").version
        except MlflowException:  # no version staged yet (this test run alone)
            return None

    staging = staging_version()
    versions = len(c.search_model_versions(f"name = '{name}'"))
    deploys = len(flow_runs_of("deploy-edge"))
    fr = run_deployment("release/release", parameters={"profile": str(profile_path), "deploy": "pool"}, timeout=1800)
    assert fr.state.is_failed(), f"release ended {fr.state.type}: {fr.state.message}"
    assert expect in fr.state.message, fr.state.message
    assert staging_version() == staging
    assert len(c.search_model_versions(f"name = '{name}'")) == versions
    assert len(flow_runs_of("deploy-edge")) == deploys
    release_id = re.search(r"\(report: reports/(\S+)\.md\)", fr.state.message).group(1)
    report = json.loads((REPO / "reports" / f"{release_id}.json").read_text())
    assert report["staging"] is None and report["registered"] == {} and report["deploy"] is None
    parent = c.get_run(report["mlflow_parent_run_id"])
    student_gate = parent.data.tags["edgeflow.student_gate"]
    assert student_gate.startswith("failed: ") if expect == STUDENT_REFUSED else student_gate == "passed", student_gate
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return fr, report, {r.data.tags["edgeflow.stage"] for r in children}
