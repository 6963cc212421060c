"""The profile: the validated pydantic models of a configs/*.yaml, one section per module (like vLLM's
`vllm/config/`). Values only, no I/O: reading a profile from disk and the checks that need the disk are the
preflight's (edgeflow/preflight.py `load_profile`).
"""
from edgeflow.profile.profile import Profile
from edgeflow.profile.teacher import TeacherConfig, GgufPart
from edgeflow.profile.distill import TeacherCacheConfig, SequenceKDConfig, DistillConfig
from edgeflow.profile.calibration import CalibrationConfig
from edgeflow.profile.quantize import VariantConfig, QuantizeConfig
from edgeflow.profile.engine import EngineConfig
from edgeflow.profile.gate import StudentGateConfig, GateConfig
from edgeflow.profile.registry import RegistryConfig
from edgeflow.profile.placement import STAGES, PlacementConfig
from edgeflow.profile.nightly import NightlyConfig
from edgeflow.profile.deploy import DeployConfig
from edgeflow.profile.rollout import WaveSpec, RolloutConfig
from edgeflow.profile.monitoring import MonitoringConfig
from edgeflow.profile.slo import SLOConfig, SLOTarget
from edgeflow.profile.devices import DEVICES, DeviceClass

__all__ = ["Profile", "TeacherConfig", "GgufPart", "TeacherCacheConfig", "SequenceKDConfig", "DistillConfig", "CalibrationConfig", "VariantConfig", "QuantizeConfig", "EngineConfig", "StudentGateConfig", "GateConfig", "RegistryConfig", "STAGES", "PlacementConfig", "NightlyConfig", "DeployConfig", "WaveSpec", "RolloutConfig", "MonitoringConfig", "SLOConfig", "SLOTarget", "DEVICES", "DeviceClass"]
