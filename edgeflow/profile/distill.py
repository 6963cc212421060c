"""distill: the distillation stage, its teacher-output cache and sequence-level KD.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from edgeflow.profile.base import _Strict


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
        "mass (BENCHMARKS.md#teacher-cache).",
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
        "7,110 vs 173,154; BENCHMARKS.md#demo-student).",
    )
    student_from: str | None = Field(
        default=None,
        description="Directory with the student's config.json (random init) or checkpoint, and the tokenizer it was made with; "
        "must share the teacher's tokenizer. Relative to the repo. Replaces layer dropping.",
    )
    freeze_embeddings: bool = Field(
        default=False,
        description="Train the student with the teacher's input embedding frozen (and the output head with it when the two "
        "are tied): only the decoder layers and norms learn, and the table needs no gradient or AdamW state. Off by default: "
        "it saves memory, not quality. A 262,144-token vocabulary is most of a small model (Gemma 3 270M: 168 M of the 14-layer "
        "student's 246 M parameters, 2.7 GB of the 3.9 GB of training state), yet freezing it did not make that student "
        "answer better (60 steps in fp32: 1 of 5 demo answers fluent against 0 of 5, top-1 35.9 % against 36.0 %; "
        "BENCHMARKS.md#student-gate).",
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
        "default): on the demo's int4 engines greedy answers looped in 4 of 5 demo prompts, with 1.1 in none (BENCHMARKS.md#repetition-penalty).",
    )
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        default="auto",
        description="The teacher's and the student's forward passes under torch.autocast in bfloat16; weights, AdamW states and "
        "the loss stay fp32 (the student's passes under deepspeed-zero3 follow its own config instead). auto: bf16 where the "
        "device computes it natively (a CUDA GPU that supports it, a CPU listing avx512_bf16 or amx_bf16), off elsewhere, "
        "where emulated bf16 is slower than fp32. Measured on the demo's step (2-core AMD EPYC, AVX512_BF16): 3.9 s fp32, "
        "1.8 s bf16 (BENCHMARKS.md#distill-step). The teacher-output cache keeps the two apart (its namespace).",
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
        """Keys and types; the ranges are the sampler's, checked by the preflight (edgeflow/preflight.py)."""
        known = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")
        unknown = sorted(set(g) - set(known))
        if unknown:
            raise ValueError(f"distill.generation_defaults has unknown keys {unknown}; known: {list(known)}")
        if "do_sample" in g and not isinstance(g["do_sample"], bool):
            raise ValueError(f"distill.generation_defaults.do_sample={g['do_sample']!r}: must be true or false")
        numbers = {k: v for k, v in g.items() if k != "do_sample"}
        if any(isinstance(v, bool) for v in numbers.values()):
            raise ValueError(f"distill.generation_defaults {numbers}: temperature, top_p, top_k and repetition_penalty are numbers")

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
