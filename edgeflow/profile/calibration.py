"""calibration: how the calibration set is drawn (domains, ratios, size, bounded recalibration).
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from edgeflow.profile.base import _Strict


class CalibrationConfig(_Strict):
    """How the calibration set is drawn; `for_attempt` derives a bounded recalibration's variant."""

    CACHE_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"sources"})  # their content comes as references

    sources: dict[str, str] = Field(
        default={
            "chat": "data/corpora/chat.jsonl",
            "wiki": "data/corpora/wiki.jsonl",
            "math": "data/corpora/math.jsonl",
        },
        description="Domain name -> file (JSONL/Parquet/text), relative to the repo.",
    )
    ratios: dict[str, float] = Field(
        default={"chat": 5, "wiki": 3, "math": 2}, description="Domain mix; normalised, so 5:3:2 means 50/30/20 %."
    )
    total: int = Field(default=3000, ge=1, description="Samples in the calibration set.")
    min_total: int = Field(default=64, ge=1, description="Refuse calibration sets smaller than this.")
    max_tokens: int = Field(default=512, ge=8, description="Each sample is truncated to this many tokens.")
    seed: int = Field(default=0, description="Sampling seed; the same seed and sources give the same set.")

    @model_validator(mode="after")
    def _check(self):
        if self.total < self.min_total:
            raise ValueError(
                f"calibration.total={self.total} is below calibration.min_total={self.min_total}: "
                f"quantization statistics from so few samples are unreliable; raise total or, for a tiny test profile, lower min_total"
            )
        missing = sorted(set(self.ratios) - set(self.sources))
        if missing:
            raise ValueError(f"calibration.ratios names domains without a source: {missing}; add them to calibration.sources")
        if any(r < 0 for r in self.ratios.values()) or sum(self.ratios.values()) <= 0:
            raise ValueError("calibration.ratios must be non-negative and sum to more than 0")
        return self

    def for_attempt(self, attempt: int) -> "CalibrationConfig":
        """Attempt 0 is this config; attempt k draws 2^k times the samples with seed + k."""
        return self if attempt == 0 else self.model_copy(update={"total": self.total * 2**attempt, "seed": self.seed + attempt})
