"""How a release runs its stages: inline, or on a pool through the stage's deployment, as a subflow of the release.

Tiny CPU run (services up, see README): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none

`placement` in the profile says where each stage runs. A pool-placed stage is started with
`run_deployment(..., as_subflow=True)`: the Prefect UI shows it under the release, with the pool and worker
that ran it, and its result comes back through the configured result storage. Whatever a stage is handed
(ReleaseContext, ArtifactRefs) is JSON; files travel through the artifact store (edgeflow/tracking/store.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.tracking.codeversion import require_same_code
from edgeflow.tracking.runs import ReleaseContext, cache_inputs, content_key

# Stage -> the deployment prefect.yaml defines for it ("<flow name>/<deployment name>").
DEPLOYMENTS = {
    "distill": "distill/distill",
    "calibrate": "calibrate/calibrate",
    "quantize": "quantize/quantize",
    "build_engine": "build-engine/build-engine",
    "gate_reference": "gate-reference/gate-reference",
    "consistency": "consistency/consistency",
    "register": "register/register",
}
# Stages whose cache keys hold what their own host resolves (distill: the teacher as converted there; build_engine:
# the host's builder identity): only a run on their pool can say whether they are cached, so the release always
# submits them. Every other stage can be looked up by the release (run_stage's `calls`).
KEYED_ON_THEIR_HOST = frozenset({"distill", "build_engine"})
# Seconds between polls of a run's state where a wait is polled: a fleet rollout's device runs (edgeflow/pipeline/rollout.py), and
# a stage's wait while the Prefect server's event stream is down (wait_until_final).
POLL_S = 1.0
# A stage's end is pushed by the Prefect server's event stream (wait_until_final); the run's state is read again this
# often in case an event was missed, so a lost event costs this much at most, not the release.
EVENT_RECHECK_S = 10


class PlacementError(ValueError):
    """A placement names a pool or deployment the Prefect server does not have."""


class StageFailed(RuntimeError):
    """A pool-placed stage's flow run did not complete."""


def check_placement(placement) -> dict[str, str]:
    """Before any compute: every pool-placed stage has its deployment, on the pool the profile names.

    Returns {stage: pool}. Raises PlacementError naming the field, what the server has and the fix.
    """
    pooled = placement.pooled()
    if not pooled:
        return pooled
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    with get_client(sync_client=True) as client:
        for stage, pool in pooled.items():
            name = DEPLOYMENTS[stage]
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                pools = sorted(p.name for p in client.read_work_pools())
                raise PlacementError(
                    f"placement.{stage}={pool}: the Prefect server at {api} has no work pool {pool!r} (it has {pools}); "
                    f"create it (`prefect work-pool create {pool} --type process`, or `make services`) or set "
                    f"placement.{stage} to one of those or `inline`"
                ) from None
            try:
                dep = client.read_deployment_by_name(name)
            except ObjectNotFound:
                raise PlacementError(
                    f"placement.{stage}={pool}: the Prefect server at {api} has no deployment {name}; deploy it "
                    f"(`prefect --no-prompt deploy --all`, or `make services`) or set placement.{stage}: inline"
                ) from None
            if dep.work_pool_name != pool:
                raise PlacementError(
                    f"placement.{stage}={pool}, but deployment {name} is on pool {dep.work_pool_name!r}: set "
                    f"placement.{stage}: {dep.work_pool_name} or move the deployment's work_pool in prefect.yaml to {pool}"
                )
    return pooled


def run_stage(ctx: ReleaseContext, stage: str, flow_fn: Callable[..., Any], *,
              calls: Callable[..., StageCalls] | None = None, **params) -> Any:
    """Run one stage where the release's placement says: inline, or through its deployment on its pool.

    `calls`, for a stage whose every cache key the release's host computes exactly (the stage's own function of its
    inputs, e.g. edgeflow/pipeline/quantize.py stage_calls): when each call's result is cached and its artifacts are in the store,
    a pool-placed stage is not submitted at all. It would start a process on its pool (4-10 s here) only to find
    the same results under the same keys. The release's graph shows the look-up as the task `<stage>: cache look-up`.
    """
    pool = ctx.resolved().placement.where(stage)
    if pool == "inline":
        return flow_fn(ctx=ctx, **params)
    if calls is not None:
        if stage in KEYED_ON_THEIR_HOST:
            raise ValueError(f"stage {stage}'s keys hold what its own host resolves: the release cannot look it up")
        found = reuse_cached_stage(stage, pool, calls(ctx, **params))
        if found["cached"]:
            return found["result"]
    from prefect.deployments import run_deployment

    name = DEPLOYMENTS[stage]
    fr = run_deployment(name, parameters={"ctx": ctx, **params}, as_subflow=True, timeout=0,
                        tags=[f"edgeflow.stage:{stage}", f"edgeflow.release:{ctx.release_id}"])
    fr = wait_until_final(fr.id)
    if not fr.state.is_completed():
        raise StageFailed(f"stage {stage} (deployment {name}, pool {pool}): flow run {fr.id} ended "
                          f"{fr.state.type.value}: {fr.state.message}")
    return fr.state.result()


def wait_until_final(flow_run_id) -> Any:
    """The flow run, once in a final state: told by the Prefect server's event stream as the state changes
    (prefect.flow_runs.wait_for_flow_run), so the release submits the next stage without a poll interval in between
    (a 1 s poll cost 0.5 s a stage on average). Should the stream fail (the server restarting mid-stage), the run is
    read through the API, which retries as every call does, and the wait goes on."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import FlowRunWaitTimeout
    from prefect.flow_runs import wait_for_flow_run
    from prefect.utilities.asyncutils import run_coro_as_sync

    while True:
        try:
            return run_coro_as_sync(wait_for_flow_run(flow_run_id, timeout=EVENT_RECHECK_S))
        except FlowRunWaitTimeout:  # no final state yet (each try reads the run first): wait on
            continue
        except Exception as e:  # noqa: BLE001 - the event stream failed; the API read below raises if the server is gone
            print(f"flow run {flow_run_id}: the Prefect event stream failed ({type(e).__name__}: {e}); reading its state")
            with get_client(sync_client=True) as client:
                fr = client.read_flow_run(flow_run_id)
            if fr.state is not None and fr.state.is_final():
                return fr
            time.sleep(POLL_S)


def enter_stage(ctx: ReleaseContext, stage: str) -> None:
    """First line of every stage flow: refuse to run on a worker whose code is not the release's."""
    require_same_code(ctx.code, f"stage {stage} of release {ctx.release_id}")


def stored(task_fn, *args, **kwargs):
    """Call a cached task; if a cached result names artifacts the store no longer has, compute it again.

    A Prefect cache hit returns the references the first run produced. Should the store have lost one (a bucket
    lifecycle rule, a wiped tracking server), handing it on would fail the next stage; refresh instead.
    """
    return refreshed_if_missing(task_fn(*args, **kwargs), task_fn, *args, **kwargs)


def refreshed_if_missing(out, task_fn, *args, **kwargs):
    """`out`, a task's result (a reference or a list of them), unless the store lost one of its artifacts: then the
    task is called again with refresh_cache, and that result is returned."""
    missing = lost_artifacts(out)
    if not missing:
        return out
    print(f"{task_fn.name}: cached result names artifacts missing from the store ({missing[:3]}); computing it again")
    return task_fn.with_options(refresh_cache=True)(*args, **kwargs)


def lost_artifacts(out: Any) -> list[str]:
    """The URIs of the artifacts a task's result (a reference, a list of them, or another value) names that the store
    no longer holds."""
    from edgeflow.tracking.store import in_store

    return [r.uri for r in (out if isinstance(out, list) else [out]) if isinstance(r, ArtifactRef) and not in_store(r)]


# What a cache look-up returns when the cache holds nothing under the key (a cached result may itself be None).
MISSING = object()


def cached_result(key: str, store: Any = None) -> Any:
    """The result Prefect's task cache holds under `key`, in the default result storage where the release's tasks
    persist theirs, or MISSING. `edgeflow plan` (edgeflow/pipeline/plan.py) and the stage look-up below read it."""
    if store is None:
        from prefect.results import ResultStore, get_default_result_storage

        store = ResultStore(result_storage=get_default_result_storage())
    if not store.exists(key):
        return MISSING
    return store.read(key).result


def reuse_cached_stage(stage: str, pool: str, planned: StageCalls) -> dict:
    """{"cached": True, "result": the stage's result} if every one of its calls is cached with all its artifacts in the
    store, else {"cached": False}; run as a task of the release, `<stage>: cache look-up`, so the Prefect UI shows it."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    return task(_look_up, name="stage-cache-look-up", task_run_name=f"{stage}: cache look-up", cache_policy=NO_CACHE,
                persist_result=False)(stage, pool, planned)


def _look_up(stage: str, pool: str, planned: StageCalls) -> dict:
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE

    if PREFECT_TASKS_REFRESH_CACHE.value():  # every cache is to be refreshed: the stage must run
        return {"cached": False}
    keys = [call.key() for call in planned.calls]
    results = []
    for key in keys:
        out = cached_result(key)
        if out is MISSING:
            print(f"{stage}: nothing cached under {key}; submitting the stage to pool {pool}")
            return {"cached": False}
        lost = lost_artifacts(out)
        if lost:
            print(f"{stage}: {key} is cached but the store lost {lost[:3]}; submitting the stage to pool {pool}")
            return {"cached": False}
        results.append(out)
    print(f"{stage}: every call's result is cached ({', '.join(keys)}) with its artifacts in the store; not submitted "
          f"to pool {pool}")
    return {"cached": True, "result": results if planned.many else results[0]}


@dataclass(frozen=True)
class Call:
    """One cached task call of a stage, built by the stage's own function from its inputs (e.g. edgeflow/pipeline/distill.py
    train_call): the stage runs it, `edgeflow plan` (edgeflow/pipeline/plan.py) looks its key up. `run_name` is the stage's MLflow
    run (tag edgeflow.stage), whose cache_inputs.json says what the last computation of it hashed."""

    task: Any
    args: tuple
    run_name: str

    def key(self) -> str:
        return task_key(self.task, *self.args)

    def run(self) -> Any:
        return stored(self.task, *self.args)


@dataclass(frozen=True)
class StageCalls:
    """Every cached call a stage makes, built on the release's host by the stage's own functions, and how the stage
    returns their results: a list, one per call, in order (many), or the only call's."""

    calls: list[Call]
    many: bool


def task_key(task, *args, **kwargs) -> str:
    """The key Prefect computes when `task(*args, **kwargs)` runs: its own binding of the call (defaults applied),
    then content_key. `edgeflow plan` reads the result store under it."""
    from types import SimpleNamespace

    from prefect.utilities.callables import get_call_parameters

    return content_key(SimpleNamespace(task=task), get_call_parameters(task.fn, args, kwargs))


def run_origin() -> tuple[dict[str, str], dict | None]:
    """What a stage's MLflow run records of its Prefect run (edgeflow/tracking/runs.py install_origin): the stage's flow
    run id; inside a cached task, its cache key (tag edgeflow.cache_key) and what the key hashed (cache_inputs.json),
    so `edgeflow plan` can say which input of a stage changed since this run."""
    from prefect.context import TaskRunContext
    from prefect.runtime import flow_run

    tags = {"edgeflow.stage_flow_run_id": flow_run.get_id() or ""}
    task_run = TaskRunContext.get()
    if task_run is None or task_run.task.cache_key_fn is not content_key:
        return tags, None
    return tags | {"edgeflow.cache_key": content_key(task_run, task_run.parameters)}, cache_inputs(task_run.parameters)
