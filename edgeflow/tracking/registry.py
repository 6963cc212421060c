"""MLflow registry: versions with lineage tags, aliases, and downloads by alias."""
from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from edgeflow.tracking.artifacts import ArtifactRef
from edgeflow.tracking.runs import tracking_uri

# Version tag linking a registered version to the gate report that let it in (see gate_report_link).
GATE_REPORT_TAG = "edgeflow.gate_report"
# Version tag (set by the register stage) and deployment-run tag (set by edgeflow/device/record.py:record_deployment): the
# package's tree hash, as edgeflow/tracking/artifacts.py:write_manifest returns it.
PACKAGE_SHA256_TAG = "edgeflow.package_sha256"


def gate_report_link(gate_report: ArtifactRef) -> str:
    """`runs:/<consistency run>/gate/<file>`: where the consistency stage logged this gate report."""
    # edgeflow/pipeline/consistency.py logs the report under the artifact path "gate", keeping its file name.
    return f"runs:/{gate_report.mlflow_run_id}/gate/{gate_report.name}"


def client() -> MlflowClient:
    return MlflowClient(tracking_uri(), registry_uri=tracking_uri())


def ensure_model(c: MlflowClient, name: str) -> None:
    try:
        c.get_registered_model(name)
    except MlflowException:
        c.create_registered_model(name, description="edgeflow student, quantized; each version ships checkpoint + engine.")


def register_version(c: MlflowClient, name: str, run_id: str, artifact_path: str, tags: dict[str, str]) -> str:
    """Register the run's artifact directory as a new model version; returns the version number."""
    ensure_model(c, name)
    mv = c.create_model_version(name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id, tags=tags)
    return mv.version


def alias_version(c: MlflowClient, name: str, alias: str) -> str | None:
    """The version an alias points to, or None if unset."""
    try:
        return c.get_model_version_by_alias(name, alias).version
    except MlflowException:
        return None


def gate_figures(mv) -> dict[str, float]:
    """The gate's top-1 agreement and mean KL a version was registered with (version tags edgeflow.gate.*)."""
    return {k: float(mv.tags[f"edgeflow.gate.{k}"]) for k in ("top1_agreement", "kl")}


def split_runs_uri(uri: str) -> tuple[str, str]:
    """`runs:/<run_id>/<path>` -> (run_id, path); ValueError for anything else."""
    run_id, _, path = uri.removeprefix("runs:/").partition("/")
    if not uri.startswith("runs:/") or not run_id or not path:
        raise ValueError(f"{uri!r} is not a runs:/<run_id>/<path> URI")
    return run_id, path


def load_run_json(c: MlflowClient, run_id: str, path: str) -> dict:
    """One small JSON artifact of a run, read through the client's own tracking server."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(c.download_artifacts(run_id, path, tmp)).read_text())


def download(name: str, alias: str, dest: Path, version: str | None = None) -> tuple[str, Path]:
    """Download `models:/name@alias` (or `models:/name/version`, when given: no race with an alias that moves) into
    dest; returns (version, local path)."""
    import mlflow.artifacts

    c = client()
    mv = c.get_model_version(name, version) if version else c.get_model_version_by_alias(name, alias)
    dest.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{name}/{mv.version}", dst_path=str(dest), tracking_uri=tracking_uri()
    )
    return mv.version, Path(local)
