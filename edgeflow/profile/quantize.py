"""quantize: the variants (an llm-compressor recipe or a checkpoint quantized elsewhere) and the fallbacks.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from edgeflow.profile.base import _Strict


class VariantConfig(_Strict):
    # the quantize task gets the recipe's (or the pre-quantized checkpoint's) content, not its path
    CACHE_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"recipe", "prequantized"})
    name: str = Field(description="Variant name used in reports and the registry (e.g. awq-w4a16).")
    recipe: str | None = Field(default=None, description="llm-compressor recipe YAML, relative to the repo; passed "
                               "through unchanged. Exactly one of recipe and prequantized.")
    prequantized: str | None = Field(
        default=None, description="A directory holding this variant already quantized elsewhere (AutoAWQ GEMM, GPTQ or "
        "compressed-tensors, e.g. Qwen's official -AWQ release), relative to the repo: adopted bit-exactly instead of "
        "quantized (edgeflow/quantize/run.py adopt), then built, gated against the student and registered like the others. It "
        "must be the student's model (the same Architecture): start the student from its FP weights (distill.student_from).")
    calibration_samples: int | None = Field(
        default=None, description="Use only the first N calibration samples for this variant (None: all)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> VariantConfig:
        if (self.recipe is None) == (self.prequantized is None):
            raise ValueError(f"variant {self.name!r}: give exactly one of recipe (quantize here) and prequantized "
                             f"(adopt a checkpoint quantized elsewhere); got recipe={self.recipe!r}, "
                             f"prequantized={self.prequantized!r}")
        return self


class QuantizeConfig(_Strict):
    variants: list[VariantConfig] = Field(description="Quantization variants to produce, each from its own recipe.")
    recipe_overrides: dict[str, dict] = Field(
        default_factory=dict,
        description="Per-modifier field overrides applied on top of every recipe (e.g. {'AWQModifier': {'n_grid': 4}}) so small profiles run fast.",
    )
    max_parallel: int = Field(
        default=1, ge=1, le=16,
        description="Variants quantized at once as mapped tasks on one worker; with CUDA each takes GPU (slot mod device count). "
        "Keep 1 on CPU, where parallel variants only share the same cores: 1 runs them one after another in the stage's own thread.",
    )
    fallback_variants: list[VariantConfig] = Field(
        default_factory=list,
        description="Less aggressive variants (e.g. mixed W8/W4, W8A16), most aggressive first; recalibration attempt k adds the first k of them.",
    )
