"""A rollout's state survives its process: persisted to MLflow after every step, found again by the flow run id."""
from __future__ import annotations

from edgeflow.profile import WaveSpec
from edgeflow.fleet.rollout import RolloutState, WaveState, find_state, plan_waves, save_state, start_state


def test_a_retry_finds_the_wave_it_was_in(mlflow_tracking):
    waves = [WaveState(index=i, devices=ds, previous={d: "3" for d in ds})
             for i, ds in enumerate(plan_waves([WaveSpec(devices=1), WaveSpec(percent=100)], ["a", "b", "c"]))]
    state = start_state(RolloutState(model="m", version="4", production_before="3", flow_run_id="run-1", waves=waves))
    assert find_state("run-2") is None  # another flow run starts its own rollout
    state.waves[0].status = "passed"
    state.waves[1].status = "deploying"
    save_state(state, state.waves[1])
    # the process dies here; the Retry (same flow run id) reads back exactly this
    again = find_state("run-1")
    assert again == state and [w.status for w in again.waves] == ["passed", "deploying"]
    assert again.waves[1].devices == ["b", "c"] and again.waves[1].previous == {"b": "3", "c": "3"}
    again.status, again.reason = "rolled_back", "wave 1 breached: b: ..."
    save_state(again)
    from mlflow import MlflowClient

    run = MlflowClient(mlflow_tracking).get_run(again.mlflow_run_id)
    assert run.data.tags["edgeflow.rollout_status"] == "rolled_back" and run.info.status == "FAILED"
    assert run.data.tags["edgeflow.reason"] == "wave 1 breached: b: ..."
