"""The vllm backend's pure half: the profile, what vLLM's compressed-tensors loader runs, the engine arguments.

    python -c "from edgeflow.engines.vllm_engine.plan import plan_build; print(plan_build('ckpt', {})['precision'])"

Nothing here imports vLLM, torch or reads a tensor: `plan_build` reads config.json and the safetensors
headers, checks the profile and every config group of the checkpoint's quantization_config against what
vLLM's loader and kernels run, and returns everything `build` writes. Every refusal is a ValueError
naming the config group and field (or the profile key), raised before anything is written.

Upstream facts are those of vLLM 0.34.0 (the version `VLLM_VERSION` pins), read in its wheel:
  model_executor/layers/quantization/compressed_tensors/compressed_tensors.py
    _quantization_scheme_map_from_config refuses actorder 'group'/'dynamic'; _get_scheme_from_parts sends
    integer weight-only layers (strategy group or channel, no input activations, static) to
    CompressedTensorsWNA16 only when their format is 'pack-quantized' (anything else: NotImplementedError).
  .../schemes/compressed_tensors_wNa16.py: num_bits 2..8 symmetric (uint{b}b{2^(b-1)}) or with zero points
    (uint{b}); get_min_capability() 75.
  model_executor/layers/quantization/utils/marlin_utils.py: Marlin types uint4b8 and uint8b128 without zero
    points, uint4 with them; MARLIN_SUPPORTED_GROUP_SIZES [-1, 32, 64, 128]; tile misalignment (e.g. 576-wide
    SmolLM2 projections) is zero-padded at weight prep; a group straddling tensor-parallel ranks is refused.
  model_executor/kernels/linear/__init__.py choose_mp_linear_kernel: on CUDA it tries Machete (sm90 only),
    Marlin, Conch (optional package), Exllama (float16, symmetric), TritonW4A16, then Humming, in that order.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgeflow.engines.checkpoint import holds_packed_weights, read_config, weight_schemes
from edgeflow.engines.sampling import MAX_TOP_LOGPROBS

BACKEND = "vllm"
# The vLLM release this backend's API use (AsyncLLM, SamplingParams, prompt logprobs) was read from.
VLLM_VERSION = "0.34.0"
# engine.json layout of this backend (bumped when what `build` writes changes).
FORMAT_VERSION = 1
# Lowest compute capability vLLM 0.34 runs compressed-tensors weight-only layers on
# (CompressedTensorsWNA16.get_min_capability() and MarlinLinearKernel.get_min_capability()).
VLLM_MIN_SM = 75
# Marlin (marlin_utils.py): (num_bits, symmetric) -> the vLLM weight type it runs.
MARLIN_TYPES = {(4, True): "uint4b8", (8, True): "uint8b128", (4, False): "uint4"}
MARLIN_GROUP_SIZES = (32, 64, 128)  # plus per-channel (-1)
WNA16_BITS = range(2, 9)
# Files of a checkpoint vLLM reads to build the model (tokenizer files are copied separately).
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
# Decoder linears split along their input dimension under tensor parallelism (RowParallelLinear).
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)$")


def sm_number(sm: str | None) -> int | None:
    """'sm80' -> 80, 'sm100' -> 100; None for anything else."""
    m = re.fullmatch(r"sm(\d{2,3})", str(sm or ""))
    return int(m.group(1)) if m else None


class Profile(BaseModel):
    """engine.profile for backend vllm: how `load` constructs vLLM's engine (recorded in engine.json)."""

    model_config = ConfigDict(extra="forbid")

    vllm_version: str = Field(
        default=VLLM_VERSION,
        description="The vLLM release the engine must run with (major.minor are checked at load). Default: the "
                    "release this backend was written against (pyproject extra `vllm`).")
    dtype: Literal["float16", "bfloat16"] = Field(
        default="float16",
        description="Activation and KV-cache dtype (vLLM's --dtype). float16: the TensorRT-LLM A100 engine's dtype, "
                    "so the two A100 rows compute alike, and the only dtype vLLM's Exllama fallback kernel takes; "
                    "bfloat16 needs sm80 or newer.")
    max_model_len: int | None = Field(
        default=None,
        description="Longest prompt + completion in tokens (vLLM's --max-model-len). None: the checkpoint's "
                    "max_position_embeddings, vLLM's own default (8192 for SmolLM2, the TensorRT-LLM a100 "
                    "profile's max_seq_len); resolved at build and recorded.")
    gpu_memory_utilization: float = Field(
        default=0.14,
        description="Fraction of the GPU's memory this engine instance may take (vLLM's per-instance "
                    "--gpu-memory-utilization). 0.14: the consistency gate loads every variant's engine at once in "
                    "one process (up to 6 in production-a100-orin.yaml: the FP reference, 3 variants, 2 fallbacks), "
                    "6 x 0.14 = 0.84 of the GPU; on a 40 GB A100 that is 5.6 GB each, far above SmolLM2's 0.27 GB of "
                    "fp16 weights plus one 8192-token sequence's KV cache (23 KB/token). Raise it for a server that "
                    "runs one engine.")
    max_num_seqs: int = Field(
        default=64,
        description="Sequences decoded together per step (vLLM's --max-num-seqs). 64: the TensorRT-LLM a100 "
                    "profile's max_batch_size, so both A100 engines take the same concurrency.")
    enforce_eager: bool = Field(
        default=False,
        description="true runs PyTorch eagerly without CUDA graphs (vLLM's --enforce-eager). false (vLLM's default): "
                    "a 135M-parameter model's decode step is kernel-launch bound, which CUDA graphs remove.")
    tensor_parallel_size: int = Field(
        default=1,
        description="GPUs one engine is split over (vLLM's --tensor-parallel-size). 1: the models edgeflow ships fit "
                    "one A100 many times over, and TP splits a row-parallel layer's groups across ranks.")
    min_sm: str = Field(
        default="sm80",
        description="Oldest GPU architecture the engine may load on. sm80: the A100 hosts this backend serves; "
                    "vLLM 0.34's Marlin int4 kernels run from sm75, bfloat16 from sm80.")
    max_logprobs: int = Field(
        default=-1,
        description="Most log-probabilities one request may ask for (vLLM's --max-logprobs). -1 (no cap): `score` "
                    "asks for the whole vocabulary at every prompt position (prompt_logprobs=-1), which any smaller "
                    "cap than the vocabulary refuses.")
    require_marlin: bool = Field(
        default=True,
        description="true refuses at build a quantized scheme vLLM's Marlin kernels cannot run (asymmetric int8, "
                    "group sizes other than 32/64/128, widths other than 4/8); false lets vLLM fall back to "
                    "Triton/Humming kernels, which it does without a warning and several times slower.")

    @field_validator("vllm_version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not re.match(r"^\d+\.\d+\.\d+", v):
            raise ValueError(f"is not a vLLM release (major.minor.patch); set it to the installed one, e.g. '{VLLM_VERSION}'")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _max_model_len(cls, v: int | None) -> int | None:
        if v is not None and v < 16:
            raise ValueError("is below 16 tokens, too short for a chat turn; leave it unset (the checkpoint's "
                             "max_position_embeddings) or set 16 or more")
        return v

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _memory(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError("must be in (0, 1], a fraction of the GPU's memory; e.g. 0.14 per gate engine, 0.9 for "
                             "a server that runs one engine")
        return v

    @field_validator("max_num_seqs", "tensor_parallel_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be at least 1")
        return v

    @field_validator("min_sm")
    @classmethod
    def _min_sm(cls, v: str) -> str:
        n = sm_number(v)
        if n is None:
            raise ValueError("is not an architecture like 'sm80'; set 'sm80' (A100) or 'sm90' (H100)")
        if n < VLLM_MIN_SM:
            raise ValueError(f"is below sm{VLLM_MIN_SM}, the oldest GPU vLLM {VLLM_VERSION} runs compressed-tensors "
                             f"weight-only layers on; set 'sm80'")
        return v

    @field_validator("max_logprobs")
    @classmethod
    def _max_logprobs(cls, v: int) -> int:
        if v != -1 and v < MAX_TOP_LOGPROBS:
            raise ValueError(f"must be -1 (no cap, what `score` needs) or at least {MAX_TOP_LOGPROBS} (the most "
                             "top_logprobs a request may ask for); set -1")
        return v

    @model_validator(mode="after")
    def _bf16_needs_ampere(self) -> Profile:
        if self.dtype == "bfloat16" and sm_number(self.min_sm) < 80:
            raise ValueError(f"dtype='bfloat16' needs sm80 or newer but min_sm={self.min_sm!r}; set min_sm='sm80' or "
                             "dtype='float16'")
        return self


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (tensor names, dtypes, shapes), without reading any tensor."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


def marlin_refusal(bits: int, symmetric: bool, group_size: int | None) -> str | None:
    """Why Marlin cannot run this weight scheme (None when it can): field, value and Marlin's limit."""
    if (bits, symmetric) not in MARLIN_TYPES:
        if bits in (4, 8):
            return (f"weights.symmetric=false with num_bits={bits}: Marlin runs zero points only for 4-bit weights "
                    "(uint4; query_marlin_supported_quant_types(has_zp=True))")
        return f"weights.num_bits={bits}: Marlin runs 4- and 8-bit weights only"
    if group_size is not None and group_size not in MARLIN_GROUP_SIZES:
        return f"weights.group_size={group_size}: Marlin's group sizes are {list(MARLIN_GROUP_SIZES)} (or per channel)"
    return None


def quantization_plan(config: dict[str, Any], require_marlin: bool, where: str = "config.json") -> dict[str, Any] | None:
    """None for a dense checkpoint; else, per config group, the scheme and the vLLM weight type and kernel it gets.

    ValueError naming `where`'s config group and field for what vLLM 0.34 cannot load from compressed-tensors
    (and, with require_marlin, for what Marlin cannot run)."""
    schemes = weight_schemes(config, where, engine=BACKEND)  # other formats, KV cache, sparsity, activations, dynamic
    if schemes is None:
        return None
    groups = {}
    for name, s in schemes.items():
        g = f"{where} quantization_config.config_groups.{name}"
        if s.type != "int":
            raise ValueError(f"{g}.weights.type={s.type!r}: the vllm backend builds the integer weight-only schemes "
                             "edgeflow's recipes write (W4A16, W8A16); quantize with type int")
        if s.format != "pack-quantized":
            raise ValueError(f"{g}.format={s.format!r}: vLLM loads integer weight-only layers only from 'pack-quantized' "
                             "(CompressedTensorsWNA16; other formats raise NotImplementedError); save the checkpoint with "
                             "llm-compressor's default compressor (save_compressed=True)")
        if s.strategy not in ("group", "channel"):
            raise ValueError(f"{g}.weights.strategy={s.strategy!r}: vLLM's weight-only kernels take 'group' or "
                             "'channel' scales; re-quantize with one of those")
        if s.strategy == "group" and not s.group_size:
            raise ValueError(f"{g}.weights.group_size={s.group_size!r} with strategy 'group': set a group size (64)")
        if s.bits not in WNA16_BITS:
            raise ValueError(f"{g}.weights.num_bits={s.bits}: vLLM's weight-only layers take 2 to 8 bits; use 4 or 8")
        if s.actorder in ("group", "dynamic"):
            raise ValueError(f"{g}.weights.actorder={s.actorder!r}: vLLM {VLLM_VERSION} no longer loads group/dynamic "
                             "activation ordering (a permuted weight_g_idx); quantize with actorder 'weight' or none "
                             "(deployments/recipes/gptq-w4a16-sym-actorder.yaml)")
        why = marlin_refusal(s.bits, s.symmetric, s.group_size)
        if why and require_marlin:
            raise ValueError(f"{g}.{why}; vLLM would fall back to a slower Triton/Humming kernel without a warning. "
                             "Fix: re-quantize to W4A16 (group 32/64/128, symmetric or not) or symmetric W8A16, or set "
                             "engine.profile.require_marlin=false to accept the fallback")
        groups[name] = s.summary() | {
            "strategy": s.strategy, "actorder": s.actorder,
            "vllm_weight_type": MARLIN_TYPES.get((s.bits, s.symmetric))
            or (f"uint{s.bits}b{1 << (s.bits - 1)}" if s.symmetric else f"uint{s.bits}"),
            "kernel": "Marlin" if why is None else f"not Marlin ({why}): vLLM's fallback (Triton W4A16 or Humming)",
        }
    return {"method": "compressed-tensors", "groups": groups}


def precision(quant: dict[str, Any] | None, dtype: str) -> str:
    """What the layers compute with: the profile dtype for a dense checkpoint, 'int4', 'int8', 'int8+int4' (mixed)."""
    if quant is None:
        return dtype
    bits = sorted({g["bits"] for g in quant["groups"].values()}, reverse=True)
    return "+".join(f"int{b}" for b in bits)


def _check_tensors(checkpoint_dir: Path, files: list[Path], quant: dict[str, Any] | None) -> dict[str, list[int]]:
    """Tensor names and shapes from the headers; ValueError if a quantized checkpoint holds no packed weights."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        try:
            shapes |= {k: v.get("shape", []) for k, v in safetensors_header(f).items()}
        except (OSError, ValueError, struct.error) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    if quant is not None and not holds_packed_weights(shapes):
        raise ValueError(f"{checkpoint_dir}: quantization_config is set but no *.weight_packed tensor is stored; "
                         "re-save the checkpoint compressed (save_compressed=True)")
    return shapes


def _check_parallel(config: dict[str, Any], shapes: dict[str, list[int]], tp: int, where: str) -> None:
    """ValueError for a tensor_parallel_size vLLM cannot split this model by (heads, groups straddling ranks)."""
    if tp == 1:
        return
    heads = config.get("num_attention_heads") or 0
    kv = config.get("num_key_value_heads") or heads
    if heads and heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {where} num_attention_heads={heads}; use a divisor")
    if kv and kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and {where} num_key_value_heads={kv}: one must divide the other")
    # inputs of the row-parallel linears, which tensor parallelism splits: o_proj (heads x head_dim), down_proj
    inputs = {"o_proj": heads * (config.get("head_dim") or ((config.get("hidden_size") or 0) // heads if heads else 0)),
              "down_proj": config.get("intermediate_size") or 0}
    for name, shape in shapes.items():
        m = _ROW_PARALLEL.search(name.removesuffix(".weight_scale"))
        if not (name.endswith(".weight_scale") and m and len(shape) == 2 and shape[1] > 1 and inputs[m.group(1)]):
            continue
        n_in = inputs[m.group(1)]
        gs = n_in // shape[1]
        if (n_in // tp) % gs:
            raise ValueError(f"tensor_parallel_size={tp}: {name.removesuffix('.weight_scale')} has {n_in} inputs, "
                             f"{n_in // tp} per rank, not a multiple of its group size {gs} (a group would straddle "
                             "ranks, which vLLM refuses); use tensor_parallel_size=1")


def plan_build(checkpoint_dir: Path, profile: dict | None) -> dict[str, Any]:
    """Everything `build` writes, from config.json and the safetensors headers; ValueError before any write."""
    from edgeflow.engines import validate_profile

    checkpoint_dir = Path(checkpoint_dir)
    p = validate_profile(BACKEND, profile).model_dump()
    config = read_config(checkpoint_dir)
    where = f"{checkpoint_dir}/config.json"
    if not config.get("architectures"):
        raise ValueError(f"{where}: architectures is missing; vLLM picks the model class from it (re-save the "
                         "checkpoint with transformers)")
    quant = quantization_plan(config, p["require_marlin"], where)
    files = sorted({f for pattern in MODEL_FILES for f in checkpoint_dir.glob(pattern) if f.is_file()})
    weights = [f for f in files if f.name.endswith(".safetensors")]
    if not weights:
        raise ValueError(f"{checkpoint_dir}: no *.safetensors weights (vLLM's load_format is safetensors)")
    shapes = _check_tensors(checkpoint_dir, weights, quant)
    _check_parallel(config, shapes, p["tensor_parallel_size"], where)
    limit = config.get("max_position_embeddings")
    if p["max_model_len"] is None:
        if not limit:
            raise ValueError(f"{where} has no max_position_embeddings; set engine.profile.max_model_len")
        p["max_model_len"] = int(limit)
    elif limit and p["max_model_len"] > limit:
        raise ValueError(f"max_model_len={p['max_model_len']} exceeds {where} max_position_embeddings={limit} (vLLM "
                         f"refuses it); set max_model_len <= {limit} or leave it unset")
    vocab = config.get("vocab_size")
    if p["max_logprobs"] != -1 and vocab and p["max_logprobs"] < vocab:
        raise ValueError(f"max_logprobs={p['max_logprobs']} is below the vocabulary ({vocab} tokens): score() asks vLLM "
                         "for every token's log-probability at every position; set max_logprobs=-1")
    return {
        "profile": p,
        "quantization": quant,
        "precision": precision(quant, p["dtype"]),
        "model_files": [f.name for f in files],
        "vocab_size": vocab,
        "min_sm": p["min_sm"],
        "engine_args": engine_args(p, quant is not None),
    }


def engine_args(profile: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """vllm.AsyncEngineArgs keyword arguments (all but `model`, the engine directory at load) for a resolved profile.

    Tokens in, tokens out: edgeflow tokenizes itself, so vLLM loads no tokenizer (skip_tokenizer_init) and every
    request sets detokenize=False. generation_config='vllm' keeps the checkpoint's generation_config.json from
    changing defaults or capping max_tokens: each request states every parameter. raw_logprobs (vLLM's default,
    stated) is the model's own distribution, what edgeflow.engines.sampling's Token.logprob means."""
    return {
        "dtype": profile["dtype"],
        "max_model_len": profile["max_model_len"],
        "gpu_memory_utilization": profile["gpu_memory_utilization"],
        "max_num_seqs": profile["max_num_seqs"],
        "enforce_eager": profile["enforce_eager"],
        "tensor_parallel_size": profile["tensor_parallel_size"],
        "max_logprobs": profile["max_logprobs"],
        "logprobs_mode": "raw_logprobs",
        "quantization": "compressed-tensors" if quantized else None,
        "load_format": "safetensors",
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "trust_remote_code": False,
        "disable_log_stats": True,
    }
