"""Rollout: a registered version over the fleet in waves, each one watched, promoted only if every wave holds.

Tiny CPU run (services up, devices registered, Prometheus scraping them):
    python -m edgeflow.pipeline.rollout --profile configs/test-multihost.yaml --version 2

plan (the targeted devices of the inventory, cumulative waves from `rollout.waves`) → for each wave: deploy
the candidate on each of its devices (deploy-edge on the device's own queue: the health-gated blue/green
switch) → probe each one (probe-edge on the device: gate prompts through its stable port, within the gate's
figure) → observe the window (Prometheus, against the devices still on the old version) → verdict. A breach
anywhere rolls every device this rollout switched back to the version it ran, leaves `production` where it
was and fails the run naming the device, the check and the numbers. When every wave passed, `production`
moves through the checked promotion (edgeflow/pipeline/promote.py). State is persisted after every step (MLflow
`edgeflow-rollouts`): Retry resumes at the wave it was in.
"""
from __future__ import annotations

import argparse
import os
import time

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from edgeflow.preflight import load_profile
from edgeflow.profile import Profile, RolloutConfig


class RolloutBreach(RuntimeError):
    """A wave breached: the devices were rolled back and `production` did not move."""


class DeviceRunLost(RuntimeError):
    """A device's run stopped reporting and was marked Crashed (its worker or its network went): what it did on the
    device is unknown, so the rollout treats the device as switched and rolls it back with the rest."""


def _run_on_device(deployment: str, device: str, parameters: dict, cfg) -> dict:
    """Run a deployment on the device's own queue and wait: rollout.pickup_timeout_s for its worker to take it (a device
    that is cut off never does; the run is then cancelled, so the device never runs it stale), then
    rollout.deploy_timeout_s for the run itself."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from edgeflow.pipeline.stages import POLL_S
    from edgeflow.device.identity import queue_name

    fr = run_deployment(deployment, parameters=parameters, work_queue_name=queue_name(device), timeout=0)
    what = f"{deployment.split('/')[0]} on {device} (flow run {fr.id})"
    with get_client(sync_client=True) as client:
        for limit, field, done in ((cfg.pickup_timeout_s, "pickup_timeout_s", lambda s: not (s.is_scheduled() or s.is_pending())),
                                   (cfg.deploy_timeout_s, "deploy_timeout_s", lambda s: s.is_final())):
            deadline = time.monotonic() + limit
            while not done(fr.state) and time.monotonic() < deadline:
                time.sleep(POLL_S)
                fr = client.read_flow_run(fr.id)
            if done(fr.state):
                continue
            if field == "pickup_timeout_s":
                _cancel(fr.id, f"not picked up within rollout.pickup_timeout_s={limit:.0f} s")
                raise RuntimeError(f"{what} was not picked up within rollout.pickup_timeout_s={limit:.0f} s: the device's "
                                   "worker is not polling its queue (cut off, or stopped); the run was cancelled")
            raise RuntimeError(f"{what} is still {fr.state.type.value} after rollout.deploy_timeout_s={limit:.0f} s")
    if fr.state.is_crashed():
        raise DeviceRunLost(f"{what} was lost mid-run: it ended CRASHED ({fr.state.message or 'no message'}); what it "
                            "changed on the device is unknown until the device reports again")
    if not fr.state.is_completed():
        raise RuntimeError(f"{what} ended {fr.state.type.value}: {fr.state.message or 'no message'}")
    return fr.state.result()


def _cancel(flow_run_id, why: str) -> None:
    """Cancel a device's queued run the rollout stopped waiting for; the device reconciles with production instead
    (edgeflow/device/reconcile.py)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelled(message=why), force=True)


@task(task_run_name="deploy v{version} on {device}")
def deploy_device(profile: str, device: str, version: str, reason: str, cfg: RolloutConfig) -> dict:
    """deploy-edge on the device's own queue: fetch, verify, bind, health-gate, switch (or leave it as it was). The
    device reads `profile` itself (its own device.yaml on top)."""
    return _run_on_device("deploy-edge/deploy-edge", device, {"profile": profile, "alias": "rollout", "version": version,
                                                              "reason": reason}, cfg)


@task(task_run_name="probe v{version} on {device}")
def probe_device(profile: str, device: str, version: str, cfg: RolloutConfig) -> dict:
    """probe-edge on the device: the gate's greedy prompts through its stable port."""
    return _run_on_device("probe-edge/probe-edge", device, {"profile": profile, "version": version}, cfg)


@task(task_run_name="observe {seconds:.0f} s: {devices} vs {old}")
def observe_window(cfg: RolloutConfig, devices: list[str], old: list[str], seconds: float) -> dict:
    """Wait out the window, then read the wave's Prometheus series against the old-version devices'."""
    from edgeflow.fleet.watch import observe

    start = time.time()
    time.sleep(seconds)
    return observe(cfg, devices, old, start, time.time()).model_dump()


@task(task_run_name="check devices online: {devices}")
def check_online(pool: str, devices: list[str]) -> list[str]:
    """Breaches for wave devices whose worker stopped heartbeating (a device that vanished mid-rollout)."""
    from edgeflow.pipeline.inventory_store import worker_status

    status = worker_status(pool)
    return [f"{d}: vanished mid-rollout ({status.get(d, 'no worker registered')}) (check: device online)"
            for d in devices if status.get(d) != "online"]


@flow(name="rollout-wave", flow_run_name="wave {index}: {devices}", log_prints=True)
def rollout_wave(profile: str, index: int, devices: list[str], old: list[str], version: str,
                 cfg: RolloutConfig | None = None) -> dict:
    """One wave: deploy, probe, observe, verdict. Returns {"breaches": [...], "probes": [...], "watch": {...}, "skipped": {...}}.

    A device whose fingerprint cannot run the shipped engine, on a profile with deploy.build_on_device: false, is
    skipped with its reason (it keeps its version); with build_on_device: true it builds its own engine. `cfg`: the
    rollout settings as the rollout read them (None, run on its own: read from `profile`)."""
    cfg = cfg if cfg is not None else load_profile(profile).rollout
    breaches = check_online(cfg.pool, devices)
    if breaches:
        return verdict_artifact(index, version, {"breaches": breaches, "probes": [], "watch": None})
    futures = {d: deploy_device.submit(profile, d, version, f"rollout wave {index}", cfg) for d in devices}
    skipped = {}
    for d, f in futures.items():
        try:
            f.result()
        except Exception as e:
            if "EngineIncompatibleError" in str(e):  # deploy.build_on_device: false, and the engine cannot run there
                skipped[d] = f"skipped: {e}"
                print(f"{d}: {skipped[d]}")
            elif isinstance(e, DeviceRunLost) or "lost mid-run" in str(e):  # the type, or its message through Prefect
                breaches.append(f"{d}: {e} (check: deploy)")
            else:
                breaches.append(f"{d}: deploy-edge failed, the device kept its version: {e} (check: deploy)")
    devices = [d for d in devices if d not in skipped]
    if not devices and not breaches:
        breaches.append(f"no device of wave {index} can run the engine ({'; '.join(skipped.values())}) (check: deploy)")
    if breaches:
        return verdict_artifact(index, version, {"breaches": breaches, "probes": [], "watch": None, "skipped": skipped})
    probes = []
    for d in devices:
        try:
            probes.append(probe_device(profile, d, version, cfg))
        except Exception as e:
            breaches.append(f"{d}: on-device probe failed: {e} (check: probe)")
    breaches += [f"{r['device']}: {r['reason']} (check: probe)" for r in probes if not r["passed"]]
    if breaches:
        return verdict_artifact(index, version, {"breaches": breaches, "probes": probes, "watch": None, "skipped": skipped})
    try:
        watch = observe_window(cfg, devices, old, cfg.observe_s)
    except Exception as e:  # Prometheus unreachable or erroring: fail closed
        return verdict_artifact(index, version, {"breaches": [f"{', '.join(devices)}: {e} (check: Prometheus)"],
                                                 "probes": probes, "watch": None, "skipped": skipped})
    breaches += watch["breaches"] + check_online(cfg.pool, devices)
    print(f"wave {index} {devices}: {'PASSED' if not breaches else 'BREACHED'}; window {watch['window']}; "
          + "; ".join(breaches + watch["notes"]))
    return verdict_artifact(index, version, {"breaches": breaches, "probes": probes, "watch": watch, "skipped": skipped})


def verdict_artifact(index: int, version: str, verdict: dict) -> dict:
    """The wave's verdict as a markdown artifact on its flow run (the Prefect UI's Artifacts tab); returns `verdict`."""
    from prefect.artifacts import create_markdown_artifact

    lines = [f"## wave {index}, v{version}: {'BREACHED' if verdict['breaches'] else 'passed'}", ""]
    lines += [f"- breach: {b}" for b in verdict["breaches"]]
    lines += [f"- probe: {p['reason']}" for p in verdict["probes"]]
    lines += [f"- {d}: {why}" for d, why in verdict.get("skipped", {}).items()]
    watch = verdict["watch"]
    if watch:
        lines += ["", f"window {watch['window']}", "", "| device | scraped | requests | 5xx | TTFT p99 ms | restarts | bad feedback |",
                  "|---|---|---|---|---|---|---|"]
        rows = watch["wave"] + ([watch["baseline"] | {"device": f"old version: {watch['baseline']['device']}"}]
                                if watch["baseline"] else [])
        lines += [f"| {f['device']} | {f['scraped']} | {f['requests']:.0f} | {f['errors_5xx']:.0f} | {f['ttft_p99_ms']} | "
                  f"{f['restarts']:.0f} | {f['bad_feedback']:.0f} |" for f in rows]
        lines += [f"- note: {n}" for n in watch["notes"]]
    create_markdown_artifact("\n".join(lines), key=f"rollout-wave-{index}", description=f"rollout wave {index} verdict")
    return verdict


# The rollout's state is read and written through MLflow on every run of the flow, a Retry included: never from
# Prefect's result cache. Under PREFECT_RESULTS_PERSIST_BY_DEFAULT a plain task is cached by its inputs and the flow
# run id, which a Retry keeps: `plan` would hand the Retry the first run's plan (every wave pending) instead of the
# state it persisted, and the Retry would enter passed waves again.
@task(cache_policy=NO_CACHE)
def plan(p: Profile, version: str | None, alias: str, flow_run_id: str) -> dict:
    """The candidate, the targeted online devices in waves, what each serves now; or the persisted state of this run."""
    from edgeflow.pipeline.inventory_store import read_inventory, worker_status
    from edgeflow.fleet.rollout import RolloutState, WaveState, find_state, plan_waves, start_state, targeted
    from edgeflow.tracking.registry import alias_version, client

    found = find_state(flow_run_id)
    if found is not None:
        print(f"resuming rollout of v{found.version} ({found.status}); waves: " +
              ", ".join(f"{w.index} {w.devices} {w.status}" for w in found.waves))
        return found.model_dump()
    from edgeflow.pipeline.locks import pool_of, refuse_if_running

    # one rollout per fleet: a second one would switch the same devices back and forth
    refuse_if_running("rollout", ["rollout"], p.rollout.pool, pool_of, None if flow_run_id == "local" else flow_run_id)
    c = client()
    name = p.registry.model_name
    version = version or alias_version(c, name, alias)
    if not version:
        raise ValueError(f"{name} has no `{alias}` alias; pass version=<n> or register a version first")
    c.get_model_version(name, version)  # exists, or MLflow says so
    records = read_inventory(p.rollout.pool)
    chosen = targeted(p.rollout, records, worker_status(p.rollout.pool))
    serving = {r.id: r.serving.version for r in chosen}
    waves = [WaveState(index=i, devices=ds, previous={d: serving[d] for d in ds})
             for i, ds in enumerate(plan_waves(p.rollout.waves, [r.id for r in chosen]))]
    state = RolloutState(model=name, version=str(version), production_before=alias_version(c, name, "production"),
                         flow_run_id=flow_run_id, waves=waves)
    return start_state(state).model_dump()


@task(cache_policy=NO_CACHE)
def save(state: dict, wave: int | None = None) -> None:
    from edgeflow.fleet.rollout import RolloutState, save_state

    s = RolloutState.model_validate(state)
    save_state(s, s.waves[wave] if wave is not None else None)


@flow(name="rollout", log_prints=True)
def rollout(profile: str, version: str | None = None, alias: str = "staging") -> dict:
    """A version (or the alias's) over the targeted devices, wave by wave; `production` moves only if all hold."""
    from prefect.runtime import flow_run

    p = load_profile(profile)  # once: every wave and every device step below takes it from here
    state = plan(p, version, alias, flow_run.get_id() or "local")
    if state["status"] == "rolled_back":
        raise RolloutBreach(f"this rollout was already rolled back: {state['reason']}; start a new rollout")
    version = state["version"]
    for wave in state["waves"]:
        if wave["status"] == "passed":
            continue
        wave["status"] = "deploying"
        wave["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        save(state, wave["index"])
        switched = {d for w in state["waves"] if w["index"] < wave["index"] for d in w["devices"]} | set(wave["devices"])
        old = [d for w in state["waves"] for d in w["devices"] if d not in switched]
        verdict = rollout_wave(profile, wave["index"], wave["devices"], old, version, p.rollout)
        wave.update(probes=verdict["probes"], watch=verdict["watch"], breaches=verdict["breaches"], skipped=verdict.get("skipped", {}),
                    window=(verdict["watch"] or {}).get("window"), status="breached" if verdict["breaches"] else "passed")
        save(state, wave["index"])
        if verdict["breaches"]:
            roll_back(profile, p.rollout, state, wave["index"])
            save(state)
            raise RolloutBreach(state["reason"])
    from edgeflow.pipeline.promote import promote

    state["promotion"] = promote(profile, version, "production",
                                 f"rollout {state['flow_run_id']}: every wave passed on {state['waves'][-1]['devices']}")
    skipped = {d: why for w in state["waves"] for d, why in w.get("skipped", {}).items()}
    served = sum(len(w["devices"]) for w in state["waves"]) - len(skipped)
    state["status"] = "completed"
    state["reason"] = (f"v{version} serves on {served} device(s); production moved"
                       + (f"; skipped: {'; '.join(f'{d} ({why})' for d, why in skipped.items())}" if skipped else ""))
    save(state)
    return state


def roll_back(profile: str, cfg: RolloutConfig, state: dict, failed: int) -> None:
    """Every device this rollout touched, up to the failed wave, back to the version it served before."""
    breach = "; ".join(state["waves"][failed]["breaches"])
    for w in state["waves"][: failed + 1]:
        for d in w["devices"]:
            prev = w["previous"].get(d)
            if prev is None or str(prev) == state["version"]:
                state["rolled_back"][d] = f"left as is (served {prev or 'nothing'} before the rollout)"
                continue
            try:
                deploy_device(profile, d, str(prev), f"rollback of v{state['version']} after wave {failed}: {breach}"[:3900], cfg)
                state["rolled_back"][d] = str(prev)
            except Exception as e:
                state["rolled_back"][d] = f"rollback FAILED: {e}"
    state["status"] = "rolled_back"
    state["reason"] = (f"wave {failed} breached: {breach}; rolled back: "
                       + ", ".join(f"{d} -> {v}" for d, v in state["rolled_back"].items())
                       + f"; production unchanged (v{state['production_before']})")


@flow(name="probe-edge", log_prints=True)
def probe_edge(profile: str, version: str) -> dict:
    """On the device: the gate's greedy prompts through its stable port, against the gate's figure for `version`."""
    from edgeflow.device.identity import load_for_device
    from edgeflow.device.probe import run_probe

    target, device = load_for_device(profile)
    result = run_probe(target, version, device.id if device else None)
    print(result.reason)
    return result.model_dump()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", None), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--version", default=None)
    ap.add_argument("--alias", default="staging")
    ap.add_argument("--probe", action="store_true", help="run the on-device probe of --version here instead")
    a = ap.parse_args()
    print(probe_edge(a.profile, a.version) if a.probe else rollout(a.profile, a.version, a.alias))
