"""One run at a time per model (releases, nightlies) and per fleet (rollouts), read from the Prefect server.

    python -c "from edgeflow.pipeline.locks import active_runs; print(active_runs(['rollout']))"

Two releases of one model at once would register the same candidate twice and race for `staging`; two rollouts of
one pool would switch the same devices back and forth. The lock is the Prefect server's own record of flow runs:
the first line of such a run lists the others of its flows that are active (due, pending, running or paused) and
whose parameters name the same model or pool. The one created first keeps going; any other fails at once with
RunInProgress, naming the run it yields to. Runs are ordered by creation time, then id, whatever state each is in
when the other looks, so of two runs started at once exactly one goes on. Nothing is held: a run that was killed is
Crashed (the zombie automation, scripts/services.py) and no longer counts, a run scheduled for later does not count
until it is due, and a Retry of a run is the same flow run, never refused by itself.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

ACTIVE = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED")  # SCHEDULED only once due (active_runs)


class RunInProgress(RuntimeError):
    """Another flow run of the same model or fleet is active and started first."""


def active_runs(flow_names: list[str]) -> list[Any]:
    """Active flow runs of these flows (Prefect FlowRun objects), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=flow_names)),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType(s) for s in ACTIVE]))),
        )
    now = datetime.now(timezone.utc)
    due = [r for r in runs if r.state_type is None or r.state_type.value != "SCHEDULED"
           or (r.expected_start_time is not None and r.expected_start_time <= now)]
    return sorted(due, key=_order)


def _order(run: Any) -> tuple:
    return (run.created, str(run.id))


def refuse_if_running(what: str, flow_names: list[str], key: str, key_of: Callable[[dict], str | None],
                      flow_run_id: str | None) -> None:
    """Raise RunInProgress when an active run of `flow_names` whose parameters give the same `key` came before
    `flow_run_id`. Outside a flow run (flow_run_id None: a direct call, a test) there is nothing to order against."""
    if flow_run_id is None:
        return
    runs = active_runs(flow_names)
    mine = next((r for r in runs if str(r.id) == flow_run_id), None)
    for run in runs:
        if str(run.id) == flow_run_id:
            continue
        if mine is not None and _order(run) > _order(mine):
            continue  # it came after this one: it is the one to yield
        try:
            theirs = key_of(run.parameters or {})
        except Exception:  # noqa: BLE001 - a run whose parameters no longer load cannot hold the lock
            theirs = None
        if theirs == key:
            started = run.start_time.isoformat(timespec="seconds") if run.start_time else "not started yet"
            raise RunInProgress(
                f"{what} refused: flow run {run.name!r} ({run.id}) of {_flow_name(run, flow_names)} is "
                f"already at work on {key} ({run.state_type.value if run.state_type else 'active'}, started {started}): "
                f"wait for it to finish, or cancel it (`prefect flow-run cancel {run.id}`) and start again")


def _flow_name(run: Any, flow_names: list[str]) -> str:
    if len(flow_names) == 1:
        return flow_names[0]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow(run.flow_id).name


DEFAULT_PROFILE = "configs/demo-cpu.yaml"  # the release, nightly and rollout flows' default `profile`


def model_of(parameters: dict) -> str:
    """The registered model a release or nightly flow run works on, from its parameters."""
    from edgeflow.preflight import load_profile

    return load_profile(parameters.get("profile", DEFAULT_PROFILE)).registry.model_name


def pool_of(parameters: dict) -> str:
    """The device pool a rollout flow run switches, from its parameters."""
    from edgeflow.preflight import load_profile

    return load_profile(parameters.get("profile", DEFAULT_PROFILE)).rollout.pool


def active_rollouts() -> list["ActiveRollout"]:
    """The rollouts at work now, with the pool each rolls out to (None when its profile does not load): what a
    device's reconcile waits for (edgeflow/device/reconcile.py decide)."""
    from edgeflow.device.reconcile import ActiveRollout

    out = []
    for run in active_runs(["rollout"]):
        try:
            pool = pool_of(run.parameters or {})
        except Exception:  # noqa: BLE001 - a run whose profile does not load is not any pool's
            pool = None
        out.append(ActiveRollout(name=run.name, id=str(run.id), pool=pool))
    return out
