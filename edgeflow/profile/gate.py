"""gate: the consistency gate on the built engines, and the student gate before them.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from edgeflow.profile.base import _Strict


class StudentGateConfig(_Strict):
    """The student gate (edgeflow/evaluation/student_gate.py): is the distilled student worth quantizing and serving at
    all? Measured against the teacher on the held-out eval text by the distill stage, and on the FP student's own
    engine's answers to the demo prompts by the consistency stage. A student that misses any limit is not registered;
    the release fails naming each measure, its value and its limit. None switches one measure off.

    Defaults, from the students measured in BENCHMARKS.md#student-gate: the SmolLM2 demo student (24 layers,
    60 steps) scores top-1 62.7-63.7 %, KL 0.54, perplexity 0.66x the teacher's, 5/5 answers; the Gemma 3 demo student
    that answered fluently (Xeon) top-1 33.7 %, perplexity 0.82x, 3/5 answers; the one that answered only in loops
    (the AVX2-only box) top-1 36.0 %, KL 1.92, 0/5 answers: only its answers tell it apart. 11-layer SmolLM2 students
    after 60 steps: KL 1.89-2.68, perplexity 2.6-5.5x; untrained cuts: top-1 0.5-24.5 %, KL 9.7. The limits sit below
    the weakest fluent student, so they refuse what is broken, not what is merely small: a production profile should
    raise them to what its users accept."""

    min_top1_vs_teacher: float | None = Field(
        default=0.30, ge=0, le=1,
        description="Fail below this held-out top-1 agreement with the teacher (0..1). 0.30: the weakest student that "
        "answered fluently reached 33.7 % (Gemma 3 270M cut to 14 layers); untrained cuts reach 0.5-24 %.")
    max_kl_vs_teacher: float | None = Field(
        default=3.0, ge=0,
        description="Fail above this held-out mean KL(teacher || student) per token (nats). 3.0: students that trained "
        "60 steps measured 0.54-2.68; an untrained cut 9.7.")
    max_ppl_ratio: float | None = Field(
        default=3.0, gt=0,
        description="Fail above this held-out perplexity, as a multiple of the teacher's. 3.0: the 60-step SmolLM2 "
        "students measured 0.66-2.6x (every third layer kept: 5.5x, refused).")
    min_answers_ok: float | None = Field(
        default=0.6, ge=0, le=1,
        description="Fail when fewer than this share of the FP student's answers to the demo prompts are not degenerate "
        "(edgeflow/evaluation/answers.py; measured on its built engine as the server answers). 0.6 = 3 of 5: the weakest "
        "fluent student answered 3/5 (Gemma 3 fp32 row), the looping one 0/5.")

    def limits(self) -> dict[str, float]:
        """The limits that are set, by field name."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class GateConfig(_Strict):
    CACHE_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"eval_sources"})  # their content comes as references
    eval_sources: dict[str, str] = Field(
        default={"chat": "data/eval/chat.jsonl", "wiki": "data/eval/wiki.jsonl", "math": "data/eval/math.jsonl"},
        description="Held-out evaluation files per domain; must not overlap the calibration set.",
    )
    num_prompts: int = Field(default=1000, ge=1, description="Evaluation prompts (spread over the sources).")
    max_tokens: int = Field(default=128, ge=8, description="Tokens per evaluation sample.")
    min_top1_agreement: float = Field(default=0.995, ge=0, le=1, description="Pass: top-1 agreement with the FP reference (all positions).")
    max_mean_kl: float = Field(default=0.02, ge=0, description="Pass: mean KL(FP reference ‖ variant) per token.")
    max_ppl_increase: float = Field(default=0.05, ge=0, description="Pass: relative perplexity increase over the FP reference.")
    greedy_prompts: int = Field(
        default=200, ge=0, description="Prompts (halves of evaluation sequences) continued greedily by the reference and every engine; 0 skips the check."
    )
    greedy_tokens: int = Field(default=32, ge=1, description="Tokens of each greedy continuation compared for exact match.")
    min_greedy_exact_match: float | None = Field(
        default=None, ge=0, le=1,
        description="Pass: fraction of greedy continuations identical to the reference's (None: reported, not gated).",
    )
    min_engine_parity: float = Field(
        default=0.98, ge=0, le=1, description="Engine fault if the engine's top-1 agreement with its own fake-quantized HF model is below this."
    )
    reference_top_k: int = Field(
        default=256, ge=1,
        description="Tokens per position of the FP reference the gate stores for the device (edgeflow/evaluation/reference.py). "
        "KL is computed over these plus one bucket for the rest: exact when they hold all the reference's mass, a lower "
        "bound otherwise; the report prints the mass outside them. 256 keeps the 1,000-prompt production reference at "
        "~200 MB (1,000 x 128 positions x 256 x 6 bytes).",
    )
    min_answers_ok: float | None = Field(
        default=0.6, ge=0, le=1,
        description="Pass: at least this share of the variant's answers to the demo prompts are not degenerate "
        "(edgeflow/evaluation/answers.py), whatever its KL; None: reported, not gated. 0.6 = 3 of 5: variants of fluent "
        "students answered 4/5 or 5/5 (BENCHMARKS.md#student-gate), variants of a looping one 0-2/5.",
    )
    student: StudentGateConfig = Field(
        default_factory=StudentGateConfig,
        description="The student gate: limits on the distilled student itself, against the teacher and on its answers.",
    )
    recalibration_attempts: int = Field(
        default=2, ge=0, le=5,
        description="When no variant passes: recalibrate and re-quantize at most this many times, each attempt with twice the calibration samples and a new seed.",
    )
