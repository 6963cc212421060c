"""Prefect flows, one per stage. Importing this package prepares the stage process before torch and mlflow load:

- the allocator (edgeflow/ops/allocator.py: torch's large CPU blocks reused instead of unmapped, about 20 % off a CPU
  distillation step);
- MLflow's client telemetry off unless the environment says otherwise (MLFLOW_DISABLE_TELEMETRY). Its background
  thread sets and unsets the variable _MLFLOW_TELEMETRY_SESSION_ID, and a request that iterated os.environ at that
  moment (requests reads the proxy variables) failed with KeyError: a release's first MLflow call failed that way
  when mlflow was imported just before it. A pipeline host also has no business sending usage data out;
- torch's threads from EDGEFLOW_TORCH_THREADS when it is set (edgeflow/engines/cpu_host.py:apply_torch_threads), for a
  host that runs several stage processes at once;
- a nested flow run's heartbeat thread not waited for at its end (edgeflow/pipeline/heartbeats.py: an inline stage handed back
  up to 1 s late);
- a long loop's progress (edgeflow/tracking/progress.py) reported as a Prefect progress artifact of its run
  (edgeflow/pipeline/progress.py PrefectSink): the domain packages that report it never import Prefect;
- a stage's MLflow run tagged with its Prefect flow run and cache key (edgeflow/pipeline/stages.py run_origin).
"""
import os

from edgeflow.ops.allocator import tune as _tune_allocator
from edgeflow.engines.cpu_host import apply_torch_threads as _apply_torch_threads

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
_tune_allocator()
_apply_torch_threads()

from edgeflow.pipeline.heartbeats import install as _install_heartbeats  # noqa: E402 - after the allocator, before any flow runs

_install_heartbeats()

from edgeflow.pipeline.progress import install as _install_progress  # noqa: E402

_install_progress()  # a stage's long loops report as Prefect progress artifacts (edgeflow/tracking/progress.py)

from edgeflow.pipeline.stages import run_origin as _run_origin  # noqa: E402
from edgeflow.tracking.runs import install_origin as _install_origin  # noqa: E402

_install_origin(_run_origin)  # a stage's MLflow run records its Prefect run and cache key (edgeflow/tracking/runs.py)
