"""Bring a device back to the fleet's intended version: the registry's `production`, unless a rollout is at work.

    python -m edgeflow.pipeline.deploy_edge --profile configs/demo-cpu.yaml --reconcile      # what reconcile-<device id> runs

A device cut off from the servers during a wave keeps serving what it had, and the rollout fails closed without it:
its rollback could not reach it either. When it can reach the servers again, its own scheduled `reconcile-<id>`
deployment (on its queue, device.yaml `reconcile_cron`; runs that came due while it was away wait for its worker)
compares what it serves (state.json) with `production` and deploys `production` through deploy-edge when they
differ. While a rollout of its pool is active it does nothing: the rollout owns the fleet then.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import Profile


class Decision(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Literal["deploy", "in_sync", "wait", "nothing"] = Field(description="What reconcile does.")
    serving: str | None = Field(description="The version state.json says this device serves.")
    intended: str | None = Field(description="The fleet's intended version: the `production` alias.")
    reason: str = Field(description="Why, in one line.")


class ActiveRollout(BaseModel):
    """A rollout run that is at work, as the pipeline's locks see it (edgeflow/pipeline/locks.py active_runs)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The rollout's flow run name.")
    id: str = Field(description="The rollout's flow run id.")
    pool: str | None = Field(description="The pool it rolls out to; None when its profile does not load.")


def decide(target: Profile, rollouts: list[ActiveRollout]) -> Decision:
    """What this device should do to match the fleet (read-only), given the rollouts at work now."""
    from edgeflow.device.state import read_state
    from edgeflow.tracking.registry import alias_version, client

    serving = (read_state(target).get("current") or {}).get("version")
    pool = target.rollout.pool
    for run in rollouts:
        if run.pool == pool:
            return Decision(action="wait", serving=serving, intended=None,
                            reason=f"rollout {run.name!r} ({run.id}) is at work on pool {pool}; it decides what this "
                                   "device serves until it ends")
    intended = alias_version(client(), target.registry.model_name, "production")
    if not intended:
        return Decision(action="nothing", serving=serving, intended=None,
                        reason=f"{target.registry.model_name} has no `production` version yet; nothing to match")
    if str(serving) == str(intended):
        return Decision(action="in_sync", serving=serving, intended=str(intended),
                        reason=f"serves v{intended}, the fleet's production")
    return Decision(action="deploy", serving=serving, intended=str(intended),
                    reason=f"serves {f'v{serving}' if serving else 'nothing'}, the fleet's production is v{intended}")
