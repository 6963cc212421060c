"""MLflow experiments and runs, the release context, and content-hash cache keys shared by every stage.

    python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none     (services up: every run below is made)

One owner for what edgeflow records as MLflow runs: the experiments (created on first use, see experiment_id),
a release's parent run (open_release_run, with the profile's files published to it), each stage's child run
(stage_run), and the training-set tag. The deployment and promotion records live in their own experiments,
named here (written by edgeflow/device/record.py and edgeflow/tracking/promotion.py); the reports' runs by edgeflow/tracking/report.py.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.tracking.artifacts import ArtifactRef, sha256_json, sha256_tree
from edgeflow.tracking.store import check_reachable, publish, tracking_uri  # one direction: the store never imports runs


if TYPE_CHECKING:
    from edgeflow.profile import Profile


class ReleaseContext(BaseModel):
    """One release as every stage sees it, on whichever host it runs: ids, the profile as the release resolved it,
    and every file the profile names, published to the release's MLflow run.

    A stage reads its configuration from `settings` and its input files through `inputs` (materialized from the
    artifact store and checked by sha256), never from a YAML or a data file on its own host, which may hold another
    checkout.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_id: str = Field(description="Release id, also the report's file name.")
    profile: str = Field(description="Profile YAML path the release was started with (on the release's host; shown, not read).")
    mlflow_parent_run_id: str = Field(description="MLflow run that parents every stage run of this release.")
    prefect_flow_run_id: str | None = Field(default=None, description="Prefect flow run of the release.")
    settings: dict = Field(description="The validated profile as resolved once by the release (Profile.settings()).")
    inputs: dict[str, ArtifactRef] = Field(
        default_factory=dict,
        description="Every file the profile names, keyed by the path the profile gives, as published to the parent run.",
    )
    code: str = Field(description="edgeflow version + source hash of the release's host (edgeflow/tracking/codeversion.py).")

    def resolved(self):
        """The release's profile, validated again (values only: its files are read from the store, not this host)."""
        from edgeflow.profile import Profile

        return Profile.model_validate(self.settings)

    def input(self, path: str) -> ArtifactRef:
        """The published reference of one file the profile names (by the path the profile gives)."""
        try:
            return self.inputs[path]
        except KeyError:
            raise KeyError(
                f"{path} is not among the files release {self.release_id} resolved from its profile ({sorted(self.inputs)}); "
                "name it in the profile (edgeflow/profile/profile.py:Profile.input_files lists what a release ships)"
            ) from None


def _stable(value: Any) -> Any:
    """What of a task input identifies its content: refs by hash (not by run id or path), models by fields (less
    the paths a config lists in CACHE_EXCLUDE, whose content the task receives as references)."""
    if isinstance(value, ArtifactRef):
        return {"kind": value.kind, "sha256": value.sha256}
    if isinstance(value, ReleaseContext):
        return None  # which release asks does not change what a stage computes
    if isinstance(value, BaseModel):
        # a config's file paths whose content the task receives as references are not part of what it computes
        return _stable(value.model_dump(exclude=set(getattr(value, "CACHE_EXCLUDE", ()))))
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    return value


# Task parameters that only say where a task runs (e.g. which GPU a mapped variant takes).
PLACEMENT_PARAMETERS = frozenset({"slot"})


# Bumped when what a cached result holds changes shape: v2 results hand on artifact-store URIs, not host paths,
# so a result cached by an older edgeflow is recomputed rather than handed to a stage that cannot open it.
CACHE_GENERATION = "v2"


def cache_inputs(parameters: dict[str, Any]) -> dict[str, Any]:
    """What of a task call's parameters its cache key hashes: profile fields and upstream sha256s, no placement."""
    return _stable({k: v for k, v in parameters.items() if k not in PLACEMENT_PARAMETERS})


def content_key(context, parameters: dict[str, Any]) -> str:
    """Prefect cache key: task name + profile fields + upstream sha256s, so a retry or re-run reuses
    a stage whose inputs did not change, across flow runs, and recomputes it when they did."""
    return f"{context.task.name}-{CACHE_GENERATION}-{sha256_json(cache_inputs(parameters))[:32]}"


# One run per deployment attempt (edgeflow/device/record.py:record_deployment), FINISHED or FAILED.
DEPLOYMENTS_EXPERIMENT = "edgeflow-deployments"
# One run per attempted alias move, refused ones included (edgeflow/tracking/promotion.py:record_move).
PROMOTIONS_EXPERIMENT = "edgeflow-promotions"
# One run per rollout (edgeflow/pipeline/rollout.py): its persisted state (state.json), a wave-<i>.json per wave, the verdict.
ROLLOUTS_EXPERIMENT = "edgeflow-rollouts"


def experiment_id(client, name: str, artifact_location: str | None = None) -> str:
    """The experiment's id, created on first use (with the profile's artifact location, if it names one)."""
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_location)


def find_experiment_id(client, name: str) -> str | None:
    """The experiment's id, or None when it does not exist yet (a reader never creates one)."""
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else None


def open_release_run(profile: str, p: Profile, flow_run_id: str | None) -> ReleaseContext:
    """Create (or, on a retry of the same flow run, reuse) the MLflow parent run of a release, for the profile read
    from `profile` and preflighted once by the release (`p`), and publish every file it names to that run, so stages
    on other hosts read them from the store."""
    from datetime import datetime, timezone

    from mlflow import MlflowClient

    from edgeflow.tracking.codeversion import code_identity

    check_reachable(tracking_uri())
    c = MlflowClient(tracking_uri())
    exp_id = experiment_id(c, p.registry.experiment, p.registry.artifact_location)
    found = flow_run_id and c.search_runs([exp_id], f"tags.`edgeflow.prefect_flow_run_id` = '{flow_run_id}'", max_results=1)
    if found:
        parent = found[0]
        c.update_run(parent.info.run_id, status="RUNNING")
        release_id = parent.data.tags["edgeflow.release_id"]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        release_id = f"{p.name}-{stamp}" + (f"-{flow_run_id[:8]}" if flow_run_id else "")
        parent = c.create_run(exp_id, run_name=f"release {release_id}", tags={
            "edgeflow.release_id": release_id, "edgeflow.profile": profile, "edgeflow.prefect_flow_run_id": flow_run_id or "",
        })
        c.log_dict(parent.info.run_id, p.model_dump(by_alias=True), "profile.json")
    return ReleaseContext(release_id=release_id, profile=profile, mlflow_parent_run_id=parent.info.run_id,
                          prefect_flow_run_id=flow_run_id, settings=p.settings(),
                          inputs=publish_inputs(c, parent.info.run_id, p), code=code_identity())


def publish_inputs(client, run_id: str, p) -> dict[str, ArtifactRef]:
    """Every file the profile names, logged to the release's run under inputs/<sha256>/…: content-addressed, so a
    retry after an edit publishes the new content beside the old instead of over it."""
    refs = {}
    for path in dict.fromkeys(p.input_files().values()):
        local = p.resolve(path)
        sha = sha256_tree(local)
        refs[path] = publish(client, run_id, local, f"inputs/{sha[:16]}", "input", meta={"profile_path": path}, sha256=sha)
    return refs


def log_values(client: Any, run_id: str, params: dict[str, Any] | None = None,
               metrics: dict[str, float] | None = None, step: int = 0) -> None:
    """Params and metrics in as few requests as MLflow takes (log_batch: 100 params or 1,000 metrics a request), not
    one each: a stage's gate settings are 20-odd params and the consistency pass 60-odd metrics, and each call is an
    HTTP request and a database commit on the tracking server (BENCHMARKS.md#stage-fixed-costs). Param values are cut
    to 6,000 characters, MLflow's limit."""
    from mlflow.entities import Metric, Param

    ts = int(time.time() * 1000)
    ps = [Param(k, str(v)[:6000]) for k, v in (params or {}).items()]
    ms = [Metric(k, float(v), ts, step) for k, v in (metrics or {}).items()]
    for i in range(0, len(ps), 100):
        client.log_batch(run_id, params=ps[i:i + 100])
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i:i + 1000])


@contextmanager
def stage_run(ctx: ReleaseContext, stage: str, params: dict | None = None) -> Iterator[tuple[Any, str]]:
    """A child MLflow run under the release's parent run; marked FAILED if the stage raises."""
    from mlflow import MlflowClient

    origin_tags, keyed = _origin() if _origin is not None else ({}, None)
    client = MlflowClient(tracking_uri())
    parent = client.get_run(ctx.mlflow_parent_run_id)
    kill_orphans(client, parent.info.experiment_id, ctx.mlflow_parent_run_id, stage)
    run = client.create_run(
        parent.info.experiment_id,
        run_name=stage,
        tags={
            "mlflow.parentRunId": ctx.mlflow_parent_run_id,
            "edgeflow.release_id": ctx.release_id,
            "edgeflow.stage": stage,
            "edgeflow.profile": ctx.profile,
            **host_tags(),
            **origin_tags,
        },
    )
    run_id = run.info.run_id
    log_values(client, run_id, params=params)
    if keyed is not None:
        client.log_text(run_id, json.dumps(keyed, sort_keys=True, default=str), "cache_inputs.json")
    peak = _PeakRSS()
    t0 = time.perf_counter()
    try:
        with peak:
            yield client, run_id
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    log_values(client, run_id, metrics={"stage_wall_s": time.perf_counter() - t0, "stage_peak_rss_mb": peak.mb})
    client.set_terminated(run_id, "FINISHED")


# Where a stage run was started from, as the orchestrator knows it: () -> (tags, cache inputs or None). The pipeline
# installs Prefect's (edgeflow/pipeline/stages.py run_origin: the stage's flow run id; inside a cached task, its
# cache key and what the key hashed, so `edgeflow plan` can say which input of a stage changed since this run).
_origin: Callable[[], tuple[dict[str, str], dict | None]] | None = None


def install_origin(origin: Callable[[], tuple[dict[str, str], dict | None]] | None) -> None:
    """Tag every later stage run with what `origin()` returns (edgeflow/pipeline/__init__.py installs Prefect's)."""
    global _origin
    _origin = origin


def host_tags() -> dict[str, str]:
    """Where a stage run ran: the host (user@hostname, as a multi-host operator reads it), this host's EDGEFLOW_HOME
    and the edgeflow code (stage_run adds the orchestrator's run, whose work pool and worker its UI shows)."""
    import getpass
    import socket

    from edgeflow.tracking.codeversion import code_identity

    return {
        "edgeflow.host": f"{getpass.getuser()}@{socket.gethostname()}",
        "edgeflow.home": os.environ.get("EDGEFLOW_HOME", ""),
        "edgeflow.code": code_identity(),
    }


def kill_orphans(client: Any, experiment_id: str, parent_run_id: str, stage: str) -> list[str]:
    """Mark KILLED the runs of this stage under this release that are still RUNNING: a process that died (kill -9,
    a lost node) cannot end its own run, and a retry of the stage starts a new one. Returns their ids."""
    orphans = client.search_runs(
        [experiment_id],
        f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`edgeflow.stage` = '{stage}' and attributes.status = 'RUNNING'",
    )
    for r in orphans:
        client.set_tag(r.info.run_id, "edgeflow.killed_reason", f"stage {stage} was retried while this run was still RUNNING")
        client.set_terminated(r.info.run_id, "KILLED")
    return [r.info.run_id for r in orphans]


@dataclass
class MlflowStepLogger:
    """A `log(step, metrics)` callback writing one MLflow batch per call (one request per step, not per metric).

    A class rather than a closure so that a multi-process distillation can hand its tracking URI and run id to the
    process that logs (edgeflow/distill/launch.py).
    """

    client: Any
    run_id: str

    @property
    def tracking_uri(self) -> str:
        return self.client.tracking_uri

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        log_values(self.client, self.run_id, step=step,
                   metrics={k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))})


def mlflow_step_logger(client: Any, run_id: str) -> MlflowStepLogger:
    """A `log(step, metrics)` callback writing each step's metrics to run_id as one MLflow batch."""
    return MlflowStepLogger(client, run_id)


# Release parent-run tag: "passed", or "failed: <each missed limit>" (edgeflow/evaluation/student_gate.py).
STUDENT_GATE_TAG = "edgeflow.student_gate"


def record_student_gate(ctx: ReleaseContext, verdict: dict[str, Any]) -> None:
    """Record the student gate's verdict on the release's parent run: the tag, each measured value as a metric
    `student_gate.<measure>`, and the whole verdict as student_gate.json."""
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri())
    run = ctx.mlflow_parent_run_id
    c.set_tag(run, STUDENT_GATE_TAG, "passed" if verdict["passed"] else ("failed: " + "; ".join(verdict["failures"]))[:5000])
    log_values(c, run, metrics={f"student_gate.{m}": v for m, v in verdict["measures"].items() if v is not None})
    c.log_dict(run, verdict, "student_gate.json")


# Distill-run tag: {training file: sha256}. Training files are inputs, not outputs, so no ArtifactRef
# carries their content hash; without this tag lineage could name the files but not what they held.
TRAINING_SET_TAG = "edgeflow.training_set"


def log_training_set(client: Any, run_id: str, files: dict[str, Path]) -> dict[str, str]:
    """Tag the distill run with each training file's sha256, named as the profile names it; returns {name: sha256}."""
    hashes = {name: sha256_tree(f) for name, f in files.items()}
    client.set_tag(run_id, TRAINING_SET_TAG, json.dumps(hashes, sort_keys=True))
    return hashes


def training_set(run: Any) -> dict[str, str] | None:
    """The {path: sha256} a distill run recorded with log_training_set, or None if it recorded none."""
    raw = run.data.tags.get(TRAINING_SET_TAG)
    return json.loads(raw) if raw else None


class _PeakRSS:
    """Samples this process's resident memory while a stage runs (ru_maxrss would be the whole process's life)."""

    def __init__(self, interval: float = 0.25):
        import psutil

        self._proc, self._interval, self._stop = psutil.Process(), interval, threading.Event()
        self.mb = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.mb = max(self.mb, self._proc.memory_info().rss / 2**20)
            self._stop.wait(self._interval)

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mb = max(self.mb, self._proc.memory_info().rss / 2**20)
