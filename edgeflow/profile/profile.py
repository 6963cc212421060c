"""The profile: one validated model of a configs/*.yaml, every stage's section in its own module.

Values only: what reads the disk (the files the profile names, the teacher, the alert routes, a family on its
backend) is the preflight's (edgeflow/preflight.py), run once per entry point by `load_profile`.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from edgeflow.paths import REPO_ROOT
from edgeflow.profile.base import _Strict
from edgeflow.profile.calibration import CalibrationConfig
from edgeflow.profile.deploy import DeployConfig
from edgeflow.profile.distill import DistillConfig
from edgeflow.profile.engine import EngineConfig
from edgeflow.profile.gate import GateConfig
from edgeflow.profile.monitoring import MonitoringConfig
from edgeflow.profile.nightly import NightlyConfig
from edgeflow.profile.placement import PlacementConfig
from edgeflow.profile.quantize import QuantizeConfig
from edgeflow.profile.registry import RegistryConfig
from edgeflow.profile.rollout import RolloutConfig
from edgeflow.profile.slo import SLOConfig
from edgeflow.profile.teacher import TeacherConfig


class Profile(_Strict):
    name: str = Field(description="Profile name, recorded on every run.")
    workdir: str = Field(default=".edgeflow", description="Where artifacts, caches and services' data live.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="Where the teacher comes from.")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="Distillation stage.")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig, description="Calibration set.")
    quantize: QuantizeConfig = Field(description="Quantization variants.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine backend and build profile.")
    gate: GateConfig = Field(default_factory=GateConfig, description="Consistency gate.")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow registry.")
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="Edge deployment.")
    nightly: NightlyConfig = Field(default_factory=NightlyConfig, description="Nightly recalibration from access logs.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="Which pool each release stage runs on (inline: the release's own host).",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Staged rollout over the device fleet.")
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig, description="Where the fleet's alerts go.")
    slo: SLOConfig = Field(default_factory=SLOConfig, description="Service objectives per target device class (TTFT, "
                           "decode speed, memory), estimated before any build (`edgeflow estimate`, `edgeflow plan`).")

    def settings(self) -> dict:
        """What a release hands its stages (ReleaseContext.settings): the fields as written, JSON-safe, so that
        validating it again on another host gives this profile (defaults stay defaults: validators that ask which
        fields were set see the same answer)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def input_files(self) -> dict[str, str]:
        """{field: path} of every file the profile names (what a release resolves once and ships through the store)."""
        refs = {f"distill.corpora[{i}]": c for i, c in enumerate(self.distill.corpora)}
        refs |= {f"calibration.sources.{k}": v for k, v in self.calibration.sources.items()}
        refs |= {f"gate.eval_sources.{k}": v for k, v in self.gate.eval_sources.items()}
        for group in ("variants", "fallback_variants"):
            for i, v in enumerate(getattr(self.quantize, group)):
                field = "recipe" if v.recipe is not None else "prequantized"  # a pre-quantized checkpoint: a directory
                refs[f"quantize.{group}[{i}].{field}"] = getattr(v, field)
        if self.distill.strategy == "deepspeed-zero3" and self.distill.processes != 1:
            refs["distill.deepspeed_config"] = self.distill.deepspeed_config
        if self.distill.student_from is not None:
            refs["distill.student_from"] = self.distill.student_from  # a directory
        if self.teacher.chat_template is not None:
            refs["teacher.chat_template"] = self.teacher.chat_template
        return refs

    def resolve(self, rel: str) -> Path:
        """Paths in profiles are relative to the repository root."""
        p = Path(rel)
        return p if p.is_absolute() else REPO_ROOT / p

    @model_validator(mode="after")
    def _variant_names(self):
        names = [v.name for v in self.quantize.variants + self.quantize.fallback_variants]
        if len(set(names)) != len(names) or "fp32" in names:
            raise ValueError(
                f"quantize.variants and quantize.fallback_variants names must be unique and not 'fp32' (the reference row): {names}"
            )
        return self

    @model_validator(mode="after")
    def _nightly_domain_known(self):
        if self.nightly.domain not in self.calibration.sources:
            raise ValueError(
                f"nightly.domain={self.nightly.domain!r} is not a calibration domain ({sorted(self.calibration.sources)}); "
                "set nightly.domain to the domain the access logs should replace"
            )
        return self

    @model_validator(mode="after")
    def _ports_distinct(self):
        ports = [self.deploy.port, *self.deploy.side_ports]
        if len(set(ports)) != 3:
            raise ValueError(f"deploy.port and deploy.side_ports must be three different ports, got {ports}")
        return self

    @property
    def work(self) -> Path:
        return self.resolve(self.workdir)
