"""A rollout's plan and its persisted state (the flow is edgeflow/pipeline/rollout.py).

    python -c "from edgeflow.fleet.rollout import plan_waves; print(plan_waves([WaveSpec(devices=1), WaveSpec(percent=100)], ['a', 'b', 'c']))"

Waves are cumulative (edgeflow/profile/rollout.py RolloutConfig): after wave i, at least that many devices (or that
share of the targeted ones, rounded up) run the candidate. The state is one MLflow run of
`edgeflow-rollouts` per rollout flow run, keyed by the Prefect flow run id, with state.json rewritten
after every step: a Retry of the same flow run reads it and resumes at the wave it was in (a passed wave
is not deployed or watched again; a wave that was deploying or observing is redeployed, which leaves a
device that already switched unchanged, and watched again from the start).
"""
from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import RolloutConfig, WaveSpec


class WaveState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = Field(description="0 is the canary.")
    devices: list[str] = Field(description="Device ids switched in this wave.")
    status: Literal["pending", "deploying", "observing", "passed", "breached"] = Field(default="pending", description="Where it is.")
    previous: dict[str, str | None] = Field(default_factory=dict, description="What each device served before this rollout touched it.")
    started_at: str | None = Field(default=None, description="When its deploys started (UTC).")
    window: str | None = Field(default=None, description="The observation window read.")
    watch: dict | None = Field(default=None, description="The Prometheus figures and verdict (edgeflow/fleet/watch.py WaveWatch).")
    probes: list[dict] = Field(default_factory=list, description="Each device's on-device probe (edgeflow/device/probe.py ProbeResult).")
    breaches: list[str] = Field(default_factory=list, description="Why the wave failed, one line per breach.")
    skipped: dict[str, str] = Field(
        default_factory=dict, description="Devices left on their version because they cannot run the shipped engine "
        "and deploy.build_on_device is false, with the reason.",
    )


class RolloutState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="Registered model name.")
    version: str = Field(description="The candidate version rolled out.")
    production_before: str | None = Field(description="`production` when the rollout started.")
    flow_run_id: str = Field(description="The rollout's Prefect flow run (a Retry keeps it).")
    mlflow_run_id: str = Field(default="", description="The edgeflow-rollouts run holding this state.")
    waves: list[WaveState] = Field(description="The plan, with each wave's progress.")
    status: Literal["running", "completed", "rolled_back", "failed"] = Field(default="running", description="Where the rollout is.")
    rolled_back: dict[str, str] = Field(default_factory=dict, description="Device -> version it was rolled back to (or why not).")
    reason: str = Field(default="", description="The verdict in one line.")
    promotion: dict | None = Field(default=None, description="The production move, once every wave passed.")

    def devices(self) -> list[str]:
        return [d for w in self.waves for d in w.devices]


def wave_sizes(waves: list[WaveSpec], n: int) -> list[int]:
    """Cumulative device counts per wave for a fleet of n; waves that add no device are dropped."""
    sizes, last = [], 0
    for w in waves:
        k = min(n, w.devices if w.devices is not None else math.ceil(n * w.percent / 100))
        if k > last:
            sizes.append(k)
            last = k
    return sizes


def plan_waves(waves: list[WaveSpec], devices: list[str]) -> list[list[str]]:
    """The devices of each wave, in the given order (the canary is the first device)."""
    if not devices:
        raise ValueError("the rollout addresses no device")
    sizes = wave_sizes(waves, len(devices))
    return [devices[a:b] for a, b in zip([0, *sizes], sizes)]


def targeted(cfg: RolloutConfig, records: list, online: dict[str, str]) -> list:
    """The registered devices of rollout.pool that carry every tag of rollout.target; refuses when none does."""
    from edgeflow.fleet.inventory import select

    chosen = select(records, cfg.target)
    if not chosen:
        known = ", ".join(f"{r.id} {r.tags}" for r in records) or "none registered"
        raise ValueError(f"rollout.target={cfg.target} addresses no device of pool {cfg.pool!r} (devices: {known}); fix the "
                         "target tags or register the devices (python -m edgeflow.fleet worker on each)")
    offline = [f"{r.id} ({online.get(r.id, 'no worker')})" for r in chosen if online.get(r.id) != "online"]
    if offline:
        raise ValueError(f"targeted devices are not online: {', '.join(offline)}; a rollout starts only with every target "
                         "reachable (start its worker, or narrow rollout.target)")
    return chosen


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def find_state(flow_run_id: str) -> RolloutState | None:
    """The state a previous run of this flow run persisted, if any."""
    from mlflow import MlflowClient

    from edgeflow.tracking.registry import load_run_json
    from edgeflow.tracking.runs import ROLLOUTS_EXPERIMENT, find_experiment_id, tracking_uri

    c = MlflowClient(tracking_uri())
    exp = find_experiment_id(c, ROLLOUTS_EXPERIMENT)
    if exp is None:
        return None
    runs = c.search_runs([exp], f"tags.`edgeflow.prefect_flow_run_id` = '{flow_run_id}'", max_results=1)
    return RolloutState.model_validate(load_run_json(c, runs[0].info.run_id, "state.json")) if runs else None


def start_state(state: RolloutState) -> RolloutState:
    """Create the state's MLflow run and save it."""
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import ROLLOUTS_EXPERIMENT, experiment_id, tracking_uri

    c = MlflowClient(tracking_uri())
    run = c.create_run(experiment_id(c, ROLLOUTS_EXPERIMENT), run_name=f"{state.model} v{state.version} rollout", tags={
        "edgeflow.model": state.model, "edgeflow.version": state.version, "edgeflow.prefect_flow_run_id": state.flow_run_id,
        "edgeflow.devices": ",".join(state.devices())})
    state.mlflow_run_id = run.info.run_id
    save_state(state)
    return state


def save_state(state: RolloutState, wave: WaveState | None = None) -> None:
    """Rewrite state.json (and wave-<i>.json for `wave`); tag the run with where the rollout is."""
    from mlflow import MlflowClient

    from edgeflow.tracking.runs import tracking_uri

    c = MlflowClient(tracking_uri())
    rid = state.mlflow_run_id
    c.log_dict(rid, state.model_dump(mode="json"), "state.json")
    if wave is not None:
        c.log_dict(rid, wave.model_dump(mode="json"), f"wave-{wave.index}.json")
    c.set_tag(rid, "edgeflow.rollout_status", state.status)
    c.set_tag(rid, "edgeflow.reason", state.reason[:4000])
    if state.status != "running":
        c.set_terminated(rid, "FINISHED" if state.status == "completed" else "FAILED")
