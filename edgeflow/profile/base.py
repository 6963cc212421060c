"""The base of every profile model: unknown keys are refused (extra="forbid").
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
