"""placement: which work pool each release stage runs on, and the stages a release places.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeflow.profile.base import _Strict


# Stages a release places, in the order it runs them; each has a deployment of the same name in prefect.yaml.
STAGES = ("distill", "calibrate", "quantize", "build_engine", "gate_reference", "consistency", "register")


class PlacementConfig(_Strict):
    """Where each stage of a release runs: `inline` (in the release's own flow run, on its host) or a work pool,
    through that stage's deployment, as a subflow of the release. The deployment must be on that pool."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    distill: str = Field(default="inline", description="inline, or the work pool of the distill deployment (a100 in production).")
    calibrate: str = Field(default="inline", description="inline, or the pool of the calibrate deployment (cpu).")
    quantize: str = Field(default="inline", description="inline, or the pool of the quantize deployment (a100 in production).")
    build_engine: str = Field(
        default="inline",
        description="inline, or the pool of the build-engine deployment: the engine's target (orin for TensorRT-LLM, whose "
        "engines run only on the GPU and TensorRT version that built them).",
    )
    gate_reference: str = Field(
        default="inline",
        description="inline, or the pool of the gate-reference deployment: the FP student's side of the gate, which needs "
        "torch (a100 in production, or cpu).",
    )
    consistency: str = Field(
        default="inline",
        description="inline, or the pool of the consistency deployment: the engine side of the gate. It scores the built "
        "engines, so it belongs where they were built (the build_engine pool).",
    )
    # `register` would shadow BaseModel's ABC classmethod of that name: the YAML key is `register`, the attribute not
    register_stage: str = Field(default="inline", alias="register", description="inline, or the pool of the register deployment (cpu).")

    @model_validator(mode="after")
    def _names(self):
        for stage in STAGES:
            where = self.where(stage)
            if not where or not where.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"placement.{stage}={where!r} is not `inline` or a work-pool name (letters, digits, - and _)")
        return self

    def where(self, stage: str) -> str:
        """`inline` or the pool of one of STAGES."""
        return self.register_stage if stage == "register" else getattr(self, stage)

    def pooled(self) -> dict[str, str]:
        """{stage: pool} of the stages that do not run inline."""
        return {s: self.where(s) for s in STAGES if self.where(s) != "inline"}
