"""registry: the MLflow registered model and the release experiment.
"""
from __future__ import annotations

from pydantic import Field

from edgeflow.profile.base import _Strict


class RegistryConfig(_Strict):
    model_name: str = Field(default="edgeflow-student", description="MLflow registered model name.")
    experiment: str = Field(default="edgeflow-release", description="MLflow experiment of release runs.")
    artifact_location: str | None = Field(
        default=None,
        description="Artifact location of the release experiment when it is created, e.g. s3://bucket/edgeflow (every host "
        "then needs the bucket's credentials). None: the tracking server's proxied store (mlflow-artifacts:/, "
        "`mlflow server --artifacts-destination`), which every host reaches through the tracking URL alone.",
    )
