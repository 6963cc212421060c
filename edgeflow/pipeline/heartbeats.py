"""A stage run inline ends when its work ends, not up to a second later (installed by importing edgeflow/pipeline/).

Each flow run sends heartbeats (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, for the zombie automation of scripts/services.py)
from a thread that sleeps in one-second steps, and Prefect 3.9.1's sync engine joins that thread when the run's
body returns. A subflow run inline in the release (calibrate, gate_reference and register in most profiles) thus
handed back to the release up to 1 s after it ended: 2.4 s of a fully cached test-tiny release over its three inline
stages (py-spy of the release process; 2-core AMD EPYC, AVX2; BENCHMARKS.md#stage-fixed-costs).

For a run nested in another (an inline stage, or a pool-placed stage, which the release links as its subflow) the
thread is no longer joined: it sees the stop at its next step and returns without sending. Its run's final state is
set by then either way. A top-level run (the release itself, `python -m edgeflow.pipeline.x`) still joins, so that no heartbeat
is in flight while its process exits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

# The Prefect whose engine this was measured on (pyproject pins it); another leaves Prefect's behaviour alone.
PREFECT_VERSION = "3.9.1"


def install() -> bool:
    """Wrap prefect.flow_engine._send_heartbeats (once); True if it is wrapped."""
    import prefect
    import prefect.flow_engine as engine_module

    if prefect.__version__ != PREFECT_VERSION:
        return False
    original = engine_module._send_heartbeats
    if getattr(original, "edgeflow_wrapped", False):
        return True

    @contextmanager
    def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
        nested = engine.flow_run is not None and engine.flow_run.parent_task_run_id is not None
        with original(engine, join_on_exit=join_on_exit and not nested):
            yield

    send_heartbeats.edgeflow_wrapped = True
    engine_module._send_heartbeats = send_heartbeats
    return True
