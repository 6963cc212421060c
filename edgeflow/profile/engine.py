"""engine: the backend and its build profile (checked against the backend by the preflight, edgeflow/preflight.py).
"""
from __future__ import annotations

from pydantic import Field

from edgeflow.profile.base import _Strict


class EngineConfig(_Strict):
    backend: str = Field(default="cpu", description="Key of edgeflow.engines.BACKENDS (the one list of backend names).")
    profile: dict = Field(default_factory=dict, description="Backend build options, validated against the backend's "
                          "`Profile` model by the preflight when the profile loads (edgeflow/engines/<backend>: every key, its default and why).")
