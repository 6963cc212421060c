"""The gate report, typed: what the consistency stage writes (edgeflow/pipeline/consistency.py) and every reader reads.

    python -m edgeflow.evaluation.report .edgeflow/releases/<release_id>/gate-attempt0.json   # validate one, print its verdict

One JSON file per gate attempt, logged to the consistency run under `gate/`. The attempt summary and the
release report (edgeflow/tracking/report.py), the register stage (edgeflow/pipeline/register.py) and the promotion check
(edgeflow/tracking/promotion.py) read it through `GateReport`, never as an untyped dict. Fields keep the order the
consistency stage writes them in, so `model_dump(exclude_unset=True)` of a report read back is the dict that
was written (the register stage packs each row into the version's gate.json that way).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.tracking.artifacts import ArtifactRef


class GateRow(BaseModel):
    """One variant's engine against the FP reference: the measured figures, the verdict and its reasons."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Variant name (`fp32` for the full-precision student).")
    size_mb: float = Field(description="Checkpoint size in MiB, rounded to 0.1.")
    decode_tok_s: float = Field(description="Decode tokens per second of one 64-token generation on the built engine, "
                                "with the decoding settings the server applies by default (decode_settings).")
    ttft_ms: float = Field(description="Time to first token of that generation, in milliseconds.")
    decode_tok_s_greedy: float | None = Field(
        default=None, description="The same generation decoded greedily (what the gate's greedy checks run); None in "
        "reports written before it was measured.")
    ttft_ms_greedy: float | None = Field(default=None, description="Time to first token of the greedy generation, in ms.")
    decode_settings: str | None = Field(
        default=None, description="The server's default decoding, from the engine's generation_config.json (e.g. "
        "'repetition_penalty 1.1'), or 'greedy'.")
    top1_agreement: float = Field(description="Share of positions where the engine's argmax equals the reference's (0..1).")
    kl: float = Field(description="Mean KL(reference ‖ engine) over the evaluation positions.")
    kl_p99: float = Field(description="99th percentile of the per-position KL.")
    top1_last: float = Field(description="Top-1 agreement at each prompt's last position (0..1).")
    greedy_exact: float | None = Field(description="Share of greedy prompts whose continuation equals the reference's; None without greedy prompts.")
    ppl: float = Field(description="Perplexity of the engine on the evaluation texts.")
    passed: bool = Field(description="True when the variant met every gate threshold.")
    quantized: bool = Field(description="True for a quantized variant, False for the FP student.")
    reasons: list[str] = Field(description="Why the variant failed, one line per missed threshold, then one per missed "
                               "service objective (`slo <device>: ...`); empty when it passed.")
    quality_passed: bool | None = Field(
        default=None, description="True when the variant met every quality threshold, whatever its service objectives "
        "(a recalibration cannot make an engine faster); None in reports written before service objectives.")
    slo: list[dict[str, Any]] | None = Field(
        default=None, description="Per slo.targets entry: {device, pool, objectives, measured, misses} as "
        "edgeflow/evaluation/service.py measured the engine on this host, or {device, pool, not_measured} where this host "
        "does not stand for the target; None for the FP student and without service objectives.")
    metrics: dict[str, float | int | None] = Field(
        description="Every figure the gate computed for the variant (edgeflow/evaluation/metrics.py), engine_parity included."
    )
    checkpoint: ArtifactRef = Field(description="The checkpoint the engine was built from.")
    engine: ArtifactRef = Field(description="The built engine that was scored.")
    engine_precision: str = Field(description="What the engine computes with, from its engine.json (e.g. 'int4', 'fp32 (dequantized)').")
    layer_error: list[float] | None = Field(
        default=None, description="Per-decoder-layer relative hidden-state error of the fake-quantized model; None for the FP student."
    )
    greedy_continuations: list[list[int]] | None = Field(
        default=None, description="The engine's greedy continuation (token ids) of each of the reference's greedy prompts, in "
        "order: what the on-device probe (edgeflow/device/probe.py) expects the deployed server to answer.",
    )
    answers: list[dict[str, Any]] | None = Field(
        default=None, description="The engine's answers to the fixed demo prompts, as the server would give them, with "
        "their repetition figures (edgeflow/evaluation/answers.py).",
    )


class GateReferenceInfo(BaseModel):
    """Which stored FP reference the engines were scored against, and how much of its mass the top-k kept."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(description="Content hash of the reference artifact.")
    uri: str = Field(description="Artifact-store URI of the reference.")
    top_k: int = Field(description="Tokens per position the reference stores (gate.reference_top_k, capped by the vocabulary).")
    tail_mass_mean: float = Field(description="Mean probability mass outside the stored top-k (0: the KL is exact; else a lower bound).")


class GateReport(BaseModel):
    """One gate attempt: thresholds, what it was measured on, and one row per variant."""

    model_config = ConfigDict(extra="forbid")

    thresholds: dict[str, Any] = Field(description="The profile's gate config as applied, less eval_sources (edgeflow/profile/gate.py:GateConfig).")
    eval_prompts: int | None = Field(default=None, description="Held-out prompts scored; None in a report that records the verdict only.")
    eval_positions: int | None = Field(default=None, description="Token positions scored; None in a report that records the verdict only.")
    reference: GateReferenceInfo | None = Field(default=None, description="The FP reference scored against; None in a report that records the verdict only.")
    backend: str | None = Field(default=None, description="Engine backend the variants ran on; None in a report that records the verdict only.")
    attempt: int = Field(description="Recalibration attempt (0 for the first).")
    calibration: dict[str, Any] | None = Field(
        default=None, description="The calibration set the attempt quantized with: sha256 and total samples; None in a report that records the verdict only."
    )
    rows: list[GateRow] = Field(description="One row per variant, the FP student first.")
    plots: dict[str, ArtifactRef] = Field(default_factory=dict, description="Plot name -> the PNG published to the consistency run.")

    def row(self, name: str | None) -> GateRow | None:
        """The row of a variant, or None when the report has none of that name."""
        return next((r for r in self.rows if r.name == name), None)

    @property
    def fp_row(self) -> GateRow | None:
        """The FP student's row (the yardstick), or None in a report without one."""
        return next((r for r in self.rows if not r.quantized), None)

    @property
    def quantized(self) -> list[GateRow]:
        """The rows of quantized variants (the FP student's row is the yardstick, not a candidate)."""
        return [r for r in self.rows if r.quantized]


def parse_gate_report(text: str) -> GateReport:
    """A gate report from its JSON text; pydantic.ValidationError (a ValueError) names each bad field."""
    return GateReport.model_validate(json.loads(text))


def load_gate_report(ref: ArtifactRef) -> GateReport:
    """The gate report a consistency stage published, materialized from the artifact store (verified by sha256)."""
    from edgeflow.tracking.store import materialize

    return parse_gate_report(materialize(ref).read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path, help="A gate-attempt<N>.json file.")
    report = parse_gate_report(ap.parse_args().path.read_text())
    for r in report.rows:
        print(f"{r.name}: {'passed' if r.passed else 'failed: ' + '; '.join(r.reasons)}")
