"""build(Path("ckpt"), Path("eng"), {"build_profile": "orin-agx"}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

TensorRT-LLM engine backend: TensorRT engines built on the target GPU (Jetson AGX Orin sm87 with the
`v0.12.0-jetson` branch, or an A100 sm80 with mainline) from edgeflow checkpoints.

What it does, per interface function (see `tasks/engines/__init__.py`):

* `build` = `plan_build` (pure: validates the profile and the checkpoint's quantization, returns the
  exact `convert_checkpoint.py` and `trtllm-build` command lines; runs on any CPU) + an environment
  check (TensorRT-LLM installed at the profile's version, a CUDA device whose SM is the profile's
  target: a TensorRT plan only runs on the architecture and TensorRT version that built it, so builds
  happen on the target) + staging, conversion, engine build and `engine.json`.
  - llm-compressor checkpoints (compressed-tensors "pack-quantized", W4A16 group-wise) are repacked
    bit-exactly into the AutoGPTQ layout (`cpu_onnx.repack_compressed_tensors`) and converted with
    `--use_weight_only --weight_only_precision int4_gptq --per_group --group_size <g>`: TensorRT-LLM
    then runs the stored integers, zero points and (float16-rounded) scales; nothing is re-quantized.
    This holds for AWQ checkpoints too; `int4_awq` is NOT used (see `_INT4_WHY`): TensorRT-LLM's
    W4A16_AWQ is ModelOpt's format (symmetric, no zero points, a separate `pre_quant_scale`), while
    llm-compressor's AWQ has already folded its scales into the weights and stores asymmetric
    group-wise integers with zero points, exactly what W4A16_GPTQ holds. engine.json records the
    chosen precision and why under `quantization`.
  - W8A16 (int8 weights, per channel): profile `int8_weight_only_precision` "int8" (TensorRT-LLM
    re-derives per-channel scales from the exactly dequantized weights: close, not bit-exact, and
    engine.json says `exact: false`) or "int8_gptq" (exact: group-wise int8 with the channel scale
    repeated over 64-wide groups; needs a TensorRT-LLM with W8A16_GPTQ, i.e. mainline).
  - Dense checkpoints (the FP reference row) are converted in the profile dtype (float16).
  - Activation/KV-cache quantization, sparsity, transforms, act-order g_idx, a mixed W8/W4 recipe
    (one converter precision per engine) raise ValueError naming the field, before any work.
* `check_compatible` compares engine.json with `device_fingerprint()` through the pure `compare`.
* `load` / `generate` / `score` run TensorRT-LLM's C++ executor through `ModelRunnerCpp` (in-flight
  batching: concurrent `generate` calls share the engine's batch slots), falling back to the Python
  `ModelRunner` when the C++ bindings are missing. `score` needs context logits, i.e. an engine
  built with `--gather_context_logits`; by default `build` makes a second engine for that under
  `score/` so the serving engine keeps its last-token-only lm_head (see `gather_context_logits`).
  These three need a GPU; they are written against TensorRT-LLM's runtime API but unverified on hardware.

`tensorrt_llm`, `tensorrt` and torch are imported only inside the functions that need them, so
importing this module (and planning a build) works on a CPU-only machine.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tasks.artifacts import sha256_json, sha256_tree
from tasks.engines.sampling import SamplingParams
from tasks.engines import EngineIncompatibleError
from tasks.engines.cpu_onnx import QuantScheme, _copy_tokenizer_files, repack_compressed_tensors

BACKEND = "tensorrt_llm"
ENGINE_JSON = "engine.json"
SCORE_SUBDIR = "score"
PROFILES_DIR = Path(__file__).resolve().parents[2] / "deployments" / "engine-profiles"
# Where the TensorRT-LLM source checkout lives on the build host: convert_checkpoint.py ships with
# the examples, not in the wheel. /opt/TensorRT-LLM is where NVIDIA's jetson-containers image puts it.
TRTLLM_SRC_ENV = "EDGEFLOW_TRTLLM_SRC"
DEFAULT_TRTLLM_SRC = "/opt/TensorRT-LLM"

# Caller-facing profile keys. Every BuildProfile field (see the YAML files in
# deployments/engine-profiles/) may also be given here and overrides the named build profile.
DEFAULT_PROFILE: dict[str, Any] = {
    # Name of deployments/engine-profiles/<name>.yaml. Orin is the deployment target.
    "build_profile": "orin-agx",
    # Recipe that produced the checkpoint: "awq" | "gptq" | "rtn" | None. config.json does not say;
    # when None, the checkpoint's recipe.yaml (written by llm-compressor) is read if present. It is
    # recorded in engine.json; it does not change the converter flags (see _INT4_WHY).
    "algorithm": None,
    # TensorRT-LLM source tree holding the convert script; None -> $EDGEFLOW_TRTLLM_SRC or /opt/TensorRT-LLM.
    "tensorrt_llm_src": None,
}

ALGORITHMS = ("awq", "gptq", "rtn")

# Why W4A16 checkpoints of every recipe are converted with int4_gptq (the reasoning engine.json carries).
_INT4_WHY = (
    "int4_gptq loads the checkpoint's own integers, zero points and scales (GPTQ layout qweight/qzeros/"
    "scales, W4A16_GPTQ, has_zero_point=true): nothing is re-quantized. int4_awq is not used even for AWQ: "
    "TensorRT-LLM's W4A16_AWQ is ModelOpt's export (symmetric, has_zero_point=false, a separate "
    "pre_quant_scale per input channel) and convert_checkpoint.py accepts --quant_ckpt_path only for *_gptq; "
    "llm-compressor's AWQ folds its activation scales into the preceding weights and stores plain group-wise "
    "asymmetric int4 with zero points, which is what TensorRT-LLM itself maps pre-quantized AWQ checkpoints "
    "to (update_quant_config_from_hf: quant_method 'awq' -> W4A16_GPTQ with zero points)."
)
_INT8_WHY = {
    "int8": (
        "W8A16 per channel: TensorRT-LLM re-derives the per-channel scales (absmax/127) from the exactly "
        "dequantized weights; llm-compressor's scales are absmax/127.5 of the pre-GPTQ weights, so some "
        "integers move by one step: close to the checkpoint, not bit-exact"
    ),
    "int8_gptq": (
        "W8A16_GPTQ: the stored int8 integers, zero points and scales, the per-channel scale repeated over "
        "64-wide groups (identical arithmetic); exact"
    ),
}
_EXPECTED_QUANT_ALGO = {None: None, "int4_gptq": "W4A16_GPTQ", "int8": "W8A16", "int8_gptq": "W8A16_GPTQ"}
# TensorRT-LLM's fine-grained (scale + zero) W4A16/W8A16 kernels take group sizes 64 and 128.
_TRT_GROUP_SIZES = (64, 128)
_LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")
# L4T release (/etc/nv_tegra_release) -> JetPack. TensorRT on Jetson comes with JetPack.
_JETPACK_BY_L4T = {"36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2"}


# --------------------------------------------------------------------------------------------
# Build profiles
# --------------------------------------------------------------------------------------------


class BuildProfile(BaseModel):
    """One TensorRT-LLM build + runtime configuration (deployments/engine-profiles/<name>.yaml)."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(description="What the profile is for, in one line.")
    target: str = Field(pattern=r"^sm\d{2,3}$", description="GPU architecture the engine is built for and runs on, e.g. sm87.")
    tensorrt_llm_branch: str = Field(description="TensorRT-LLM branch/tag whose flags this profile uses.")
    tensorrt_llm_version: str = Field(description="TensorRT-LLM version of that branch; the build host must match major.minor.")
    jetpack: str | None = Field(default=None, description="JetPack release the branch needs (Jetson only).")
    convert_script: str = Field(description="Llama convert_checkpoint.py, relative to the TensorRT-LLM source tree.")
    kv_cache_flag: Literal["paged_kv_cache", "kv_cache_type"] = Field(
        description="How this branch's trtllm-build spells the paged KV cache: --paged_kv_cache enable (<=0.12) or --kv_cache_type paged."
    )
    dtype: Literal["float16", "bfloat16"] = Field(description="Activation/weight dtype of the engine.")
    max_batch_size: int = Field(gt=0, description="Requests the engine schedules at once (in-flight batch slots).")
    max_input_len: int = Field(gt=0, description="Longest prompt, tokens.")
    max_seq_len: int = Field(gt=0, description="Longest prompt + generation, tokens.")
    max_num_tokens: int = Field(gt=0, description="Tokens processed per engine step (all sequences, padding removed).")
    max_beam_width: int = Field(default=1, ge=1, description="Beams; greedy decoding needs 1.")
    tokens_per_block: int = Field(gt=0, description="Tokens per paged-KV-cache block (power of two).")
    paged_kv_cache: bool = Field(description="Paged KV cache (needed for in-flight batching).")
    context_fmha: bool = Field(description="Fused multi-head attention for the context (prefill) phase.")
    use_paged_context_fmha: bool = Field(description="Context FMHA reading the paged KV cache directly.")
    remove_input_padding: bool = Field(description="Packed (padding-free) inputs; needed for in-flight batching.")
    gemm_plugin: str = Field(description="GEMM plugin dtype: auto (= dtype), float16, bfloat16 or disable.")
    gpt_attention_plugin: str = Field(description="Attention plugin dtype: auto (= dtype), float16, bfloat16.")
    in_flight_batching: bool = Field(description="Serve with the C++ executor (ModelRunnerCpp) and in-flight batching.")
    kv_cache_free_gpu_memory_fraction: float = Field(
        gt=0, le=1, description="Share of free GPU memory the runtime may take for the KV cache."
    )
    gather_context_logits: Literal["score_engine", "serving", "off"] = Field(
        description="Where score() gets all-position logits: a second engine under score/, the serving engine itself, or nowhere."
    )
    int8_weight_only_precision: Literal["int8", "int8_gptq"] = Field(
        description="Converter precision for W8A16 checkpoints: int8 (re-derived scales) or int8_gptq (exact)."
    )
    workers: int = Field(default=1, ge=1, description="trtllm-build --workers (parallel builds; one GPU here).")

    @model_validator(mode="after")
    def _consistent(self) -> BuildProfile:
        if self.max_seq_len <= self.max_input_len:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} must exceed max_input_len={self.max_input_len} (room to generate)"
            )
        if self.max_num_tokens < self.max_input_len:
            # without chunked context a whole prompt is one engine step
            raise ValueError(f"max_num_tokens={self.max_num_tokens} must be >= max_input_len={self.max_input_len}")
        if self.tokens_per_block & (self.tokens_per_block - 1) or not 16 <= self.tokens_per_block <= 256:
            raise ValueError(f"tokens_per_block={self.tokens_per_block} must be a power of two in [16, 256]")
        if self.max_beam_width != 1:
            raise ValueError(f"max_beam_width={self.max_beam_width}: edgeflow decodes with beam width 1 (greedy or sampling), set 1")
        for name in ("gemm_plugin", "gpt_attention_plugin"):
            value = getattr(self, name)
            allowed = {"auto", self.dtype} | ({"disable"} if name == "gemm_plugin" else set())
            if value not in allowed:
                raise ValueError(f"{name}={value!r} with dtype={self.dtype!r}: choose one of {sorted(allowed)}")
        if self.use_paged_context_fmha and not (self.context_fmha and self.paged_kv_cache):
            raise ValueError("use_paged_context_fmha=true needs context_fmha=true and paged_kv_cache=true")
        if self.in_flight_batching and not (self.paged_kv_cache and self.remove_input_padding):
            raise ValueError("in_flight_batching=true needs paged_kv_cache=true and remove_input_padding=true")
        return self


def available_build_profiles() -> list[str]:
    """Names of the YAML build profiles under deployments/engine-profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_build_profile(name: str) -> dict[str, Any]:
    """The raw mapping of deployments/engine-profiles/<name>.yaml (ValueError naming the profile if unknown)."""
    names = available_build_profiles()
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"profile build_profile={name!r} is unknown; choose one of {names} (files in {PROFILES_DIR})")
    data = yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{PROFILES_DIR / f'{name}.yaml'}: expected a mapping of build profile fields")
    return data


def resolve_profile(profile: dict | None) -> tuple[str, BuildProfile, dict[str, Any]]:
    """(build profile name, validated BuildProfile, caller options) from a build() profile dict."""
    profile = dict(profile or {})
    known = set(DEFAULT_PROFILE) | set(BuildProfile.model_fields)
    unknown = sorted(set(profile) - known)
    if unknown:
        raise ValueError(
            f"unknown tensorrt_llm engine profile keys {unknown}; known: {sorted(known)} "
            "(build profile fields override deployments/engine-profiles/<build_profile>.yaml)"
        )
    options = {k: profile.pop(k, v) for k, v in DEFAULT_PROFILE.items()}
    name = options["build_profile"]
    merged = {**load_build_profile(name), **profile}
    try:
        build_profile = BuildProfile(**merged)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'profile'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"build profile {name!r} (with overrides {sorted(profile)}) is invalid: {problems}") from None
    algorithm = options["algorithm"]
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"profile algorithm={algorithm!r}: choose one of {list(ALGORITHMS)} or None")
    return name, build_profile, options


# --------------------------------------------------------------------------------------------
# Checkpoint -> converter precision (pure, config.json only)
# --------------------------------------------------------------------------------------------


def _read_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{checkpoint_dir}: no config.json; not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def recipe_algorithm(checkpoint_dir: Path) -> str | None:
    """awq/gptq/rtn from the recipe.yaml llm-compressor saves next to the weights, or None if absent/unclear."""
    path = Path(checkpoint_dir) / "recipe.yaml"
    if not path.exists():
        return None
    text = path.read_text()
    if "AWQModifier" in text:
        return "awq"
    if "GPTQModifier" in text:
        return "gptq"
    if "QuantizationModifier" in text:
        return "rtn"
    return None


def weight_scheme(config: dict[str, Any], where: str = "config.json") -> dict[str, Any] | None:
    """None for a dense checkpoint; the one weight-only scheme of a compressed-tensors one; else ValueError."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{where} quantization_config"
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"{where}.quant_method={method!r}: the tensorrt_llm engine builds llm-compressor 'compressed-tensors' "
            "checkpoints or dense ones; refusing to guess at another format"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{where}.kv_cache_scheme={qc['kv_cache_scheme']!r}: quantized KV cache is not supported")
    if qc.get("sparsity_config"):
        raise ValueError(f"{where}.sparsity_config is set: sparse compressed checkpoints are not supported")
    if qc.get("transform_config"):
        raise ValueError(f"{where}.transform_config is set: rotated (transformed) checkpoints are not supported")
    ignore = qc.get("ignore") or []
    if "lm_head" not in ignore:
        raise ValueError(
            f"{where}.ignore={ignore}: the lm_head is quantized; TensorRT-LLM's weight-only converters keep it "
            "dense (re-quantize with ignore: [lm_head])"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: cannot tell what the weights are")
    schemes = {}
    for name, group in groups.items():
        g = f"{where}.config_groups.{name}"
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{g}: activation quantization is set; the tensorrt_llm engine builds weight-only schemes (W4A16, W8A16)")
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{g}.format={fmt!r}: only 'pack-quantized' weights are repacked for TensorRT-LLM")
        if w.get("dynamic"):
            raise ValueError(f"{g}.weights.dynamic=true: dynamic weight quantization is not supported")
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(f"{g}.weights: type={w.get('type')!r} num_bits={w.get('num_bits')}; supported: int, 4 or 8 bits")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{g}.weights.strategy={strategy!r}: supported: 'group', 'channel'")
        if w.get("actorder") not in (None, "static", "weight"):
            raise ValueError(
                f"{g}.weights.actorder={w.get('actorder')!r}: act-order with a permuted g_idx is not supported by "
                "TensorRT-LLM's GPTQ path ('GPTQ with desc_act=True is not implemented'); use actorder weight or none"
            )
        gs = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and gs not in _TRT_GROUP_SIZES:
            raise ValueError(
                f"{g}.weights.group_size={gs}: TensorRT-LLM's group-wise kernels take {list(_TRT_GROUP_SIZES)} "
                "(SmolLM2's 576-wide projections need 64)"
            )
        if w.get("num_bits") == 4 and strategy != "group":
            raise ValueError(f"{g}.weights.strategy={strategy!r} with num_bits=4: W4A16 must be group-wise (group_size 64 or 128)")
        schemes[name] = {
            "bits": int(w["num_bits"]),
            "strategy": strategy,
            "group_size": gs,
            "symmetric": bool(w.get("symmetric", True)),
            "actorder": w.get("actorder"),
            "format": fmt,
        }
    distinct = {json.dumps(s, sort_keys=True) for s in schemes.values()}
    if len(distinct) != 1:
        raise ValueError(
            f"{where}.config_groups use different schemes {schemes}: convert_checkpoint.py takes one "
            "--weight_only_precision per engine, so a mixed W8/W4 checkpoint cannot be converted exactly"
        )
    return next(iter(schemes.values()))


def quantization_plan(
    config: dict[str, Any], build_profile: BuildProfile, algorithm: str | None, where: str = "config.json"
) -> dict[str, Any]:
    """Which converter precision and staging a checkpoint gets, and why (pure; config.json only)."""
    scheme = weight_scheme(config, where)
    plan: dict[str, Any] = {"scheme": scheme, "algorithm": algorithm}
    if scheme is None:
        return {**plan, "weight_only_precision": None, "group_size": None, "staging": "dense", "exact": True,
                "why": f"dense checkpoint: converted in {build_profile.dtype}", "trtllm_quant_algo": None}
    in_features = {int(config["hidden_size"]), int(config["intermediate_size"])}
    if scheme["bits"] == 4:
        gs = scheme["group_size"]
        precision, staging, exact, why = "int4_gptq", "gptq_int4", True, _INT4_WHY
    else:
        precision = build_profile.int8_weight_only_precision
        exact, why = precision == "int8_gptq", _INT8_WHY[precision]
        if precision == "int8_gptq":
            gs = scheme["group_size"] or 64  # channel scales repeated over 64-wide groups
            staging = "gptq_int8"
        else:
            if scheme["strategy"] != "channel" or not scheme["symmetric"]:
                raise ValueError(
                    f"{where} quantization_config: int8 {scheme['strategy']} symmetric={scheme['symmetric']} "
                    "cannot use --weight_only_precision int8 (per-channel symmetric only); set profile "
                    "int8_weight_only_precision=int8_gptq"
                )
            gs, staging = None, "dense_dequantized"
    if gs is not None and any(n % gs for n in in_features):
        raise ValueError(
            f"{where}: hidden_size/intermediate_size {sorted(in_features)} are not multiples of group_size {gs}"
        )
    return {**plan, "weight_only_precision": precision, "group_size": gs, "staging": staging, "exact": exact,
            "why": why, "trtllm_quant_algo": _EXPECTED_QUANT_ALGO[precision]}


# --------------------------------------------------------------------------------------------
# Command lines (pure)
# --------------------------------------------------------------------------------------------


def convert_command(
    quant: dict[str, Any], build_profile: BuildProfile, staging_dir: Path, ckpt_dir: Path, trtllm_src: Path
) -> list[str]:
    """The convert_checkpoint.py command line for a staged checkpoint."""
    cmd = [
        sys.executable, str(Path(trtllm_src) / build_profile.convert_script),
        "--model_dir", str(staging_dir),
        "--output_dir", str(ckpt_dir),
        "--dtype", build_profile.dtype,
    ]
    precision = quant["weight_only_precision"]
    if precision is None:
        return cmd
    # Choice of precision, including why AWQ checkpoints get int4_gptq: see quant["why"] / _INT4_WHY.
    cmd += ["--use_weight_only", "--weight_only_precision", precision]
    if precision.endswith("_gptq"):
        cmd += [
            "--per_group", "--group_size", str(quant["group_size"]),
            # the staged GPTQ tensors; loads them as stored (legacy loader and ModelWeightsLoader alike)
            "--quant_ckpt_path", str(Path(staging_dir) / "model.safetensors"),
        ]
    return cmd


def build_command(build_profile: BuildProfile, ckpt_dir: Path, engine_dir: Path, gather_context_logits: bool) -> list[str]:
    """The trtllm-build command line (as `python -m tensorrt_llm.commands.build`, the same entry point)."""
    p = build_profile
    on = {True: "enable", False: "disable"}
    cmd = [
        # the trtllm-build console script is often not on PATH on Jetson (~/.local/bin); the module is
        sys.executable, "-m", "tensorrt_llm.commands.build",
        "--checkpoint_dir", str(ckpt_dir),
        "--output_dir", str(engine_dir),
        "--max_batch_size", str(p.max_batch_size),
        "--max_input_len", str(p.max_input_len),
        "--max_seq_len", str(p.max_seq_len),
        "--max_num_tokens", str(p.max_num_tokens),
        "--max_beam_width", str(p.max_beam_width),
        "--gemm_plugin", p.gemm_plugin,
        "--gpt_attention_plugin", p.gpt_attention_plugin,
        "--context_fmha", on[p.context_fmha],
        "--remove_input_padding", on[p.remove_input_padding],
    ]
    if p.kv_cache_flag == "paged_kv_cache":
        cmd += ["--paged_kv_cache", on[p.paged_kv_cache]]
    else:
        cmd += ["--kv_cache_type", "paged" if p.paged_kv_cache else "continuous"]
    cmd += [
        "--tokens_per_block", str(p.tokens_per_block),
        "--use_paged_context_fmha", on[p.use_paged_context_fmha],
        "--workers", str(p.workers),
    ]
    if gather_context_logits:
        cmd.append("--gather_context_logits")
    return cmd


def trtllm_src_dir(options: dict[str, Any]) -> Path:
    """TensorRT-LLM source tree: profile tensorrt_llm_src, else $EDGEFLOW_TRTLLM_SRC, else /opt/TensorRT-LLM."""
    return Path(options.get("tensorrt_llm_src") or os.environ.get(TRTLLM_SRC_ENV) or DEFAULT_TRTLLM_SRC)


def plan_build(checkpoint_dir: Path, profile: dict | None, out_dir: Path | None = None) -> dict[str, Any]:
    """Validate profile + checkpoint and return the exact command lines and metadata, without running anything."""
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path("engine")
    name, build_profile, options = resolve_profile(profile)
    config = _read_config(checkpoint_dir)
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in (config.get("architectures") or []):
        raise ValueError(
            f"{checkpoint_dir}/config.json model_type={config.get('model_type')!r}: this backend converts Llama-architecture "
            "checkpoints (examples/llama)"
        )
    limit = int(config.get("max_position_embeddings") or 0)
    if limit and build_profile.max_seq_len > limit:
        raise ValueError(
            f"profile max_seq_len={build_profile.max_seq_len} exceeds the model's max_position_embeddings={limit}; "
            f"lower max_seq_len to <= {limit}"
        )
    recipe = recipe_algorithm(checkpoint_dir)
    algorithm, source = options["algorithm"], "profile"
    if algorithm is None:
        algorithm, source = recipe, ("recipe.yaml" if recipe else None)
    elif recipe is not None and recipe != algorithm:
        raise ValueError(
            f"profile algorithm={algorithm!r} but {checkpoint_dir}/recipe.yaml describes {recipe!r}; pass the recipe "
            "that produced this checkpoint (or drop algorithm to use recipe.yaml)"
        )
    quant = quantization_plan(config, build_profile, algorithm, f"{checkpoint_dir}/config.json")
    quant["algorithm_source"] = source

    work = out_dir.with_name(out_dir.name + ".work")
    staging, ckpt = work / "staging", work / "tllm_checkpoint"
    src = trtllm_src_dir(options)
    gather = build_profile.gather_context_logits
    commands = {
        "convert": convert_command(quant, build_profile, staging, ckpt, src),
        "build": build_command(build_profile, ckpt, out_dir, gather_context_logits=gather == "serving"),
        "build_score": build_command(build_profile, ckpt, out_dir / SCORE_SUBDIR, True) if gather == "score_engine" else None,
    }
    return {
        "backend": BACKEND,
        "build_profile_name": name,
        "build_profile": build_profile.model_dump(),
        "quantization": quant,
        "commands": commands,
        "paths": {"work": str(work), "staging": str(staging), "tllm_checkpoint": str(ckpt), "engine": str(out_dir),
                  "score_engine": str(out_dir / SCORE_SUBDIR) if commands["build_score"] else None,
                  "tensorrt_llm_src": str(src)},
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


# --------------------------------------------------------------------------------------------
# Device fingerprint, compatibility, cache key
# --------------------------------------------------------------------------------------------


def _dist_version(*names: str) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def parse_nv_tegra_release(text: str) -> str | None:
    """'# R36 (release), REVISION: 4.0, ...' -> '36.4.0' (the L4T release of a Jetson)."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def _nvidia_smi() -> dict[str, str] | None:
    """compute_cap, name, driver_version of the first visible GPU, or None (no nvidia-smi / N/A fields)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    # nvidia-smi ignores CUDA_VISIBLE_DEVICES; -i takes the same index or UUID
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = [exe, "--query-gpu=compute_cap,name,driver_version", "--format=csv,noheader"] + (["-i", visible] if visible else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if not lines:
        return None
    parts = [p.strip() for p in lines[0].split(",")]
    if len(parts) < 3 or not re.fullmatch(r"\d+\.\d+", parts[0]):
        return None  # Jetson's nvidia-smi answers [N/A] for some fields
    return {"compute_cap": parts[0], "name": parts[1], "driver_version": parts[2]}


def _cuda_toolkit_version() -> str | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads(Path("/usr/local/cuda/version.json").read_text())["cuda"]["version"]
    return None


def device_fingerprint() -> dict[str, Any]:
    """SM, GPU name, driver, CUDA/TensorRT/TensorRT-LLM versions and Jetson L4T/JetPack of this machine."""
    fp: dict[str, Any] = {
        "cuda_available": False, "sm": None, "device_name": None, "driver_version": None,
        "cuda_version": _cuda_toolkit_version(),
        "tensorrt": _dist_version("tensorrt", "tensorrt-cu12", "tensorrt_cu12"),
        "tensorrt_llm": _dist_version("tensorrt_llm", "tensorrt-llm"),
        "l4t_release": None, "jetpack": None, "reason": None,
    }
    with contextlib.suppress(OSError):
        fp["l4t_release"] = parse_nv_tegra_release(Path("/etc/nv_tegra_release").read_text())
        fp["jetpack"] = _JETPACK_BY_L4T.get(fp["l4t_release"] or "")
    if fp["tensorrt"] is None and importlib.util.find_spec("tensorrt") is not None:
        # JetPack installs TensorRT's Python bindings from apt, without pip metadata
        with contextlib.suppress(Exception):
            import tensorrt

            fp["tensorrt"] = tensorrt.__version__
    smi = _nvidia_smi()
    if smi is not None:
        fp.update(cuda_available=True, sm="sm" + smi["compute_cap"].replace(".", ""), device_name=smi["name"],
                  driver_version=smi["driver_version"])
        return fp
    if importlib.util.find_spec("torch") is None:
        fp["reason"] = "no nvidia-smi answer and no torch to query CUDA"
        return fp
    try:
        import torch

        if not torch.cuda.is_available():
            fp["reason"] = "torch.cuda.is_available() is False"
            return fp
        major, minor = torch.cuda.get_device_capability(0)
        fp.update(cuda_available=True, sm=f"sm{major}{minor}", device_name=torch.cuda.get_device_name(0),
                  cuda_version=fp["cuda_version"] or torch.version.cuda)
    except Exception as e:  # a broken CUDA install must read as "no CUDA", never crash the caller
        fp["reason"] = f"CUDA query failed: {type(e).__name__}: {e}"
    return fp


def _mmp(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return tuple(int(x) for x in m.groups()) if m else None


def compare(engine_meta: dict[str, Any], device: dict[str, Any]) -> None:
    """Raise EngineIncompatibleError naming both sides if `device` cannot run the engine described by engine_meta."""
    backend = engine_meta.get("backend")
    if backend != BACKEND:
        raise EngineIncompatibleError(
            f"engine backend is {backend!r}; this backend runs {BACKEND!r} engines (load it with the {backend!r} backend)"
        )
    e_sm, e_llm, e_trt = engine_meta.get("sm"), engine_meta.get("tensorrt_llm"), engine_meta.get("tensorrt")
    built = f"engine built for {e_sm} with TensorRT-LLM {e_llm}"
    fix = f"Fix: rebuild the engine on this device (build() with a build profile whose target is {device.get('sm')})"
    if not device.get("cuda_available") or not device.get("sm"):
        raise EngineIncompatibleError(
            f"{built}; this device has no CUDA GPU ({device.get('reason') or 'none found'}). "
            f"Fix: run it on an {e_sm} device with TensorRT-LLM {e_llm}, or serve the cpu backend here"
        )
    d_sm, d_llm, d_trt = device["sm"], device.get("tensorrt_llm"), device.get("tensorrt")
    if d_sm != e_sm:
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} with {d_llm or 'no TensorRT-LLM'}: a TensorRT engine holds kernels for "
            f"the GPU architecture that built it. {fix}"
        )
    if d_llm is None:
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} with no TensorRT-LLM installed (tensorrt_llm not importable). "
            f"Fix: install TensorRT-LLM {e_llm} here"
        )
    if _mmp(d_llm) != _mmp(e_llm) or _mmp(e_llm) is None:
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} with {d_llm}: TensorRT-LLM versions must match exactly (major.minor.patch), "
            f"engine plans and plugins are not portable across versions. {fix}, or install TensorRT-LLM {e_llm}"
        )
    if d_trt is None:
        raise EngineIncompatibleError(
            f"{built} and TensorRT {e_trt}; this device ({d_sm}) has no TensorRT Python bindings. Fix: install TensorRT {e_trt}"
        )
    if _mmp(d_trt) != _mmp(e_trt) or _mmp(e_trt) is None:
        raise EngineIncompatibleError(
            f"{built} and TensorRT {e_trt}; this device ({d_sm}) has TensorRT {d_trt}: a serialized TensorRT plan "
            f"only deserializes with the TensorRT version that built it. {fix}"
        )


# Fingerprint fields an engine depends on: architecture, the exact software that compiled it, and
# the Jetson OS image. The driver is left out (engines do not depend on it), so a driver update
# alone does not trigger a rebuild.
DEVICE_KEY_FIELDS = ("sm", "device_name", "cuda_version", "tensorrt", "tensorrt_llm", "l4t_release", "jetpack")


def cache_key(checkpoint_sha256: str, build_profile: dict, device: dict) -> str:
    """Device engine cache key: same checkpoint + build profile + device fingerprint -> same key (reuse)."""
    return sha256_json({
        "backend": BACKEND,
        "checkpoint_sha256": checkpoint_sha256,
        "build_profile": build_profile,
        "device": {k: device.get(k) for k in DEVICE_KEY_FIELDS},
    })


def read_engine_json(engine_dir: Path) -> dict[str, Any]:
    """engine.json of an engine directory (EngineIncompatibleError if it is not an edgeflow engine)."""
    path = Path(engine_dir) / ENGINE_JSON
    if not path.exists():
        raise EngineIncompatibleError(f"{engine_dir}: no {ENGINE_JSON}; not an edgeflow engine directory (build it with engine.build)")
    return json.loads(path.read_text())


def write_engine_json(out_dir: Path, meta: dict[str, Any]) -> Path:
    """Write engine.json (the last file a build writes: its presence marks a complete engine)."""
    path = Path(out_dir) / ENGINE_JSON
    path.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    return path


def missing_engine_files(engine_dir: Path, meta: dict[str, Any]) -> list[str]:
    """Engine files engine.json lists that are not on disk."""
    return [f for f in meta.get("engine_files", []) if not (Path(engine_dir) / f).exists()]


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the GPU architecture and the
    TensorRT / TensorRT-LLM / L4T versions (a TensorRT engine runs only where it was built)."""
    fp = device_fingerprint()
    return (f"{BACKEND} {fp['sm']}, TensorRT {fp['tensorrt']}, TensorRT-LLM {fp['tensorrt_llm']}, "
            f"L4T {fp['l4t_release']}")


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = read_engine_json(engine_dir)
    if meta.get("backend") == BACKEND:
        if not meta.get("engine_files"):
            raise EngineIncompatibleError(f"{engine_dir}/{ENGINE_JSON} lists no engine_files; rebuild the engine")
        missing = missing_engine_files(engine_dir, meta)
        if missing:
            raise EngineIncompatibleError(f"{engine_dir}: engine files missing: {missing} (copy the whole engine directory or rebuild)")
    compare(meta, device_fingerprint())


# --------------------------------------------------------------------------------------------
# Staging: checkpoint -> a directory the converter reads exactly
# --------------------------------------------------------------------------------------------


def legacy_hf_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json as TensorRT-LLM's LLaMAConfig.from_hugging_face reads it (transformers-4 keys, no quantization).

    transformers 5 writes `rope_parameters` and `dtype`; TensorRT-LLM reads `rope_theta` (default 10000.0:
    SmolLM2 uses 100000, a silent wrong RoPE), `rope_scaling` and `torch_dtype` via getattr. The quantization
    is given on the convert command line; an HF `quantization_config` left in place would be re-read by newer
    converters (update_quant_config_from_hf) and override it.
    """
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    rope = out.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in out:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    out.setdefault("torch_dtype", out.get("dtype") or dtype)
    return out


def _load_tensors_np(checkpoint_dir: Path) -> dict[str, np.ndarray]:
    """All *.safetensors tensors as numpy (bfloat16 widened exactly to float32)."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_dir}: no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as fh:
                for k in fh.keys():
                    tensors[k] = fh.get_tensor(k)
        except Exception:  # bfloat16 has no numpy dtype: read through torch (real I/O errors re-raise there)
            from safetensors.torch import load_file

            for k, t in load_file(str(f)).items():
                tensors[k] = (t.float() if t.is_floating_point() else t).numpy()
    return tensors


def _unpack_int32_le(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words packing 32/bits unsigned values along the last dim, value k at bits k*bits (little-endian)."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    vals = (np.ascontiguousarray(words, dtype=np.int32).view(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)


def _pack_int32_le(values: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of _unpack_int32_le along the last dim (length a multiple of 32/bits) -> int32."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(*values.shape[:-1], values.shape[-1] // per, per)
    words = (v << np.arange(0, 32, bits, dtype=np.uint32)).sum(-1, dtype=np.uint64).astype(np.uint32)
    return words.view(np.int32)


def _tensor_parts(tensors: dict[str, np.ndarray], where: Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """(dense tensors, prefixes of quantized linears); ValueError for anything TensorRT-LLM cannot take."""
    leaves = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    dense = {k: v for k, v in tensors.items() if k.rpartition(".")[2] not in leaves}
    prefixes = sorted({k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")})
    if not prefixes:
        raise ValueError(f"{where}: quantization_config present but no *.weight_packed tensors found")
    for p in prefixes:
        if not _LINEAR_RE.match(p):
            raise ValueError(f"{where}: quantized tensor {p} is not a Llama decoder linear layer")
    for k in dense:
        prefix, _, leaf = k.rpartition(".")
        if leaf == "weight" and _LINEAR_RE.match(prefix):
            raise ValueError(
                f"{where}: decoder linear {prefix} is stored dense while others are quantized; one converter "
                "precision covers every linear layer"
            )
    return dense, prefixes


def _layer_q(tensors: dict[str, np.ndarray], prefix: str, scheme: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unsigned integers [out, in], unsigned zero points [out, groups], float32 scales [out, groups]) of one layer."""
    bits = scheme["bits"]
    offset = 1 << (bits - 1)
    packed = tensors[f"{prefix}.weight_packed"]
    shape = tensors.get(f"{prefix}.weight_shape")
    n_out, n_in = (int(shape[0]), int(shape[1])) if shape is not None else (packed.shape[0], packed.shape[1] * 32 // bits)
    q = _unpack_int32_le(packed, bits)[:, :n_in]
    scale = tensors[f"{prefix}.weight_scale"].astype(np.float32).reshape(n_out, -1)
    g_idx = tensors.get(f"{prefix}.weight_g_idx")
    gs = scheme["group_size"] or n_in
    if g_idx is not None and not np.array_equal(g_idx.astype(np.int64), np.arange(n_in) // gs):
        raise ValueError(f"{prefix}: act-order weight_g_idx (non-contiguous groups) is not representable")
    if q.shape != (n_out, n_in) or scale.shape[1] != n_in // gs:
        raise ValueError(f"{prefix}: packed {packed.shape} / scale {scale.shape} do not match weight [{n_out}, {n_in}], group {gs}")
    if scheme["symmetric"]:
        zp = np.full(scale.shape, offset, dtype=np.uint8)
    else:
        zp = _unpack_int32_le(tensors[f"{prefix}.weight_zero_point"].T.copy(), bits)[:, :n_out].T.copy()
    return q, zp, scale


def _stage_dense(tensors: dict[str, np.ndarray], config: dict, dtype: str, out: Path, tied: bool) -> dict[str, Any]:
    """Write a dense HF checkpoint the converter reads (lm_head written out when tied)."""
    from safetensors.numpy import save_file

    add_head = tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    if add_head:  # older converters read lm_head.weight unconditionally; same values as the tied embedding
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(legacy_hf_config(config, dtype), indent=2))
    return {"tensors": len(tensors), "lm_head_written": add_head}


def stage_checkpoint(checkpoint_dir: Path, staging: Path, quant: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Write what convert_checkpoint.py reads for this plan; integers stay exactly those of the checkpoint."""
    checkpoint_dir, staging = Path(checkpoint_dir), Path(staging)
    config = _read_config(checkpoint_dir)
    tied = bool(config.get("tie_word_embeddings", False))
    kind, scheme = quant["staging"], quant["scheme"]
    shutil.rmtree(staging, ignore_errors=True)
    if kind == "dense":
        stats = _stage_dense(_load_tensors_np(checkpoint_dir), config, dtype, staging, tied)
    elif kind == "gptq_int4":
        # bit-exact repack to AutoGPTQ's layout (qweight/qzeros(zp-1)/scales/g_idx), shared with the cpu backend
        qs = QuantScheme(4, int(scheme["group_size"]), bool(scheme["symmetric"]), scheme["format"])
        stats = repack_compressed_tensors(checkpoint_dir, staging, qs)
        stats.update(_finish_gptq_staging(staging, config, dtype, tied, bits=4))
    elif kind in ("gptq_int8", "dense_dequantized"):
        tensors = _load_tensors_np(checkpoint_dir)
        dense, prefixes = _tensor_parts(tensors, checkpoint_dir)
        out: dict[str, np.ndarray] = dict(dense)
        for prefix in prefixes:
            q, zp, scale = _layer_q(tensors, prefix, scheme)
            n_out, n_in = q.shape
            if kind == "dense_dequantized":
                reps = n_in // scale.shape[1]
                out[f"{prefix}.weight"] = (q.astype(np.float32) - np.repeat(zp, reps, 1)) * np.repeat(scale, reps, 1)
                continue
            gs = int(quant["group_size"])
            groups = n_in // gs
            # per-channel scales/zero points repeated over 64-wide groups: the same arithmetic
            scale_g, zp_g = (np.repeat(a, groups, axis=1) if a.shape[1] == 1 else a for a in (scale, zp))
            if scale_g.shape[1] != groups:
                raise ValueError(f"{prefix}: {scale.shape[1]} scale groups cannot be expressed as {groups} groups of {gs}")
            # AutoGPTQ int8 layout as TensorRT-LLM's W8A16_GPTQ loader reads it: qweight int32 [in/4, out]
            # (bytes = q+128 along the input dim, i.e. weight_packed transposed), qzeros int32 [groups, out/4]
            # (bytes = zp-1 along the output dim), scales [groups, out]
            out[f"{prefix}.qweight"] = np.ascontiguousarray(_pack_int32_le(q, 8).T)
            out[f"{prefix}.qzeros"] = _pack_int32_le(np.ascontiguousarray(_zp_minus_one(zp_g, 8, prefix).T), 8)
            out[f"{prefix}.scales"] = np.ascontiguousarray(scale_g.T)
            out[f"{prefix}.g_idx"] = (np.arange(n_in) // gs).astype(np.int32)
        staging.mkdir(parents=True, exist_ok=True)
        stats = _stage_dense(out, config, dtype, staging, tied)
        stats["linear_layers"] = len(prefixes)
        if kind == "gptq_int8":
            stats.update(_finish_gptq_staging(staging, config, dtype, tied, bits=8))
    else:  # pragma: no cover - quantization_plan only produces the kinds above
        raise ValueError(f"unknown staging kind {kind!r}")
    _copy_tokenizer_files(checkpoint_dir, staging)
    return {"kind": kind, **stats}


def _zp_minus_one(zp: np.ndarray, bits: int, prefix: str) -> np.ndarray:
    """GPTQ stores zero point - 1 (the loaders add 1 back); a zero point of 0 cannot be stored."""
    if (zp == 0).any():
        raise ValueError(
            f"{prefix}: {int((zp == 0).sum())} group(s) have unsigned zero point 0, which the GPTQ layout stores as -1 "
            "and TensorRT-LLM reads back as 2**bits; not representable exactly (re-quantize symmetric)"
        )
    return (zp.astype(np.int32) - 1).astype(np.uint8)


def _finish_gptq_staging(staging: Path, config: dict, dtype: str, tied: bool, bits: int) -> dict[str, Any]:
    """Make a GPTQ staging dir converter-ready: engine-dtype scales, explicit lm_head, legacy config.json, zero-point check."""
    from safetensors.numpy import save_file

    tensors = _load_tensors_np(staging)
    scale_dtype = np.float16 if dtype == "float16" else np.float32  # numpy has no bfloat16; the loader casts
    for k in list(tensors):
        if k.endswith(".scales"):
            # the engine computes in `dtype`; TensorRT-LLM's loader casts scales to it too (one rounding)
            tensors[k] = tensors[k].astype(scale_dtype)
        elif k.endswith(".qzeros") and bits == 4:
            stored = _unpack_int32_le(tensors[k], 4)
            if (stored == 15).any():  # zp - 1 == -1 -> zero point 0, read back as 16
                raise ValueError(
                    f"{k}: {int((stored == 15).sum())} group(s) have unsigned zero point 0; TensorRT-LLM's GPTQ loader "
                    "reads it as 16 (not representable exactly; re-quantize symmetric)"
                )
    if tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(legacy_hf_config(config, dtype), indent=2))
    return {"scales_dtype": np.dtype(scale_dtype).name, "lm_head_written": tied}


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def check_build_environment(plan: dict[str, Any], device: dict[str, Any]) -> None:
    """Refuse to build (before running anything) unless this host is the profile's target with its TensorRT-LLM."""
    bp = plan["build_profile"]
    target, want = bp["target"], bp["tensorrt_llm_version"]
    name = plan["build_profile_name"]
    have = device.get("tensorrt_llm")  # from the installed distribution's metadata (device_fingerprint)
    if have is None:
        raise RuntimeError(
            f"build profile {name!r} needs TensorRT-LLM {want} ({bp['tensorrt_llm_branch']}); tensorrt_llm is not "
            f"importable here. Fix: build on the {target} target with TensorRT-LLM {want} installed"
        )
    if not device.get("cuda_available"):
        raise EngineIncompatibleError(
            f"build profile {name!r} targets {target}; this host has no CUDA GPU ({device.get('reason')}). "
            f"Fix: build on the {target} device itself (engines only run on the architecture that built them)"
        )
    if device["sm"] != target:
        raise EngineIncompatibleError(
            f"build profile {name!r} targets {target} with TensorRT-LLM {want}; this device is {device['sm']} with {have}: "
            "an engine built here would only run on this architecture. Fix: build on the target device, or pick the "
            f"profile for {device['sm']}"
        )
    if _mmp(have) is None or _mmp(have)[:2] != _mmp(want)[:2]:
        raise EngineIncompatibleError(
            f"build profile {name!r} was written for TensorRT-LLM {want} ({bp['tensorrt_llm_branch']}); this device "
            f"has {have}: its converter and trtllm-build flags differ. Fix: install {want} or use a profile for {have}"
        )
    if bp.get("jetpack") and device.get("jetpack") and device["jetpack"] != bp["jetpack"]:
        raise EngineIncompatibleError(
            f"build profile {name!r} needs JetPack {bp['jetpack']}; this device runs JetPack {device['jetpack']} "
            f"(L4T {device.get('l4t_release')}). Fix: flash JetPack {bp['jetpack']} or use a matching profile"
        )
    script = Path(plan["commands"]["convert"][1])
    if not script.exists():
        raise RuntimeError(
            f"{script} not found: convert_checkpoint.py ships in the TensorRT-LLM source tree, not the wheel. Fix: "
            f"check out {bp['tensorrt_llm_branch']} and set profile tensorrt_llm_src or ${TRTLLM_SRC_ENV}"
        )


def check_converted_quantization(tllm_config: dict[str, Any], quant: dict[str, Any]) -> None:
    """The converter's checkpoint config must hold the quantization we asked for (RuntimeError naming the field)."""
    got = tllm_config.get("quantization") or {}
    want_algo = _EXPECTED_QUANT_ALGO[quant["weight_only_precision"]]
    if got.get("quant_algo") != want_algo:
        raise RuntimeError(f"converted checkpoint quantization.quant_algo={got.get('quant_algo')!r}, expected {want_algo!r}")
    if quant["weight_only_precision"] and quant["weight_only_precision"].endswith("_gptq"):
        if got.get("group_size") != quant["group_size"]:
            raise RuntimeError(f"converted checkpoint quantization.group_size={got.get('group_size')}, expected {quant['group_size']}")
        if got.get("has_zero_point") is not True or got.get("pre_quant_scale"):
            raise RuntimeError(
                f"converted checkpoint quantization has_zero_point={got.get('has_zero_point')} "
                f"pre_quant_scale={got.get('pre_quant_scale')}; expected zero points and no pre_quant_scale"
            )


def check_engine_config(engine_config: dict[str, Any], build_profile: dict[str, Any], gather_context_logits: bool) -> None:
    """The built engine's config.json must reflect the profile (catches flags a branch silently ignores)."""
    bc = engine_config.get("build_config") or {}
    pc = bc.get("plugin_config") or {}
    expected = {
        ("build_config", "max_batch_size"): (bc.get("max_batch_size"), build_profile["max_batch_size"]),
        ("build_config", "max_input_len"): (bc.get("max_input_len"), build_profile["max_input_len"]),
        ("build_config", "max_seq_len"): (bc.get("max_seq_len"), build_profile["max_seq_len"]),
        ("plugin_config", "tokens_per_block"): (pc.get("tokens_per_block"), build_profile["tokens_per_block"]),
        ("plugin_config", "use_paged_context_fmha"): (pc.get("use_paged_context_fmha"), build_profile["use_paged_context_fmha"]),
        ("plugin_config", "remove_input_padding"): (pc.get("remove_input_padding"), build_profile["remove_input_padding"]),
        ("build_config", "gather_context_logits"): (bc.get("gather_context_logits"), gather_context_logits),
    }
    wrong = {f"{a}.{b}": {"engine": got, "profile": want} for (a, b), (got, want) in expected.items() if got is not None and got != want}
    if wrong:
        raise RuntimeError(f"built engine config.json differs from the build profile: {wrong}")


def _run(name: str, cmd: list[str], log: Path) -> None:
    """Run one build step, appending its output to `log`; RuntimeError with the log tail on failure."""
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"{name} failed (exit {rc}); last lines of {log}:\n{tail}")


def _engine_files(engine_dir: Path, rel: str = "") -> list[str]:
    return sorted(f"{rel}{p.name}" for p in Path(engine_dir).iterdir() if p.suffix == ".engine" or p.name == "config.json")


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Convert and compile a dense or compressed-tensors checkpoint into a TensorRT-LLM engine dir on the target GPU."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    plan = plan_build(checkpoint_dir, profile, out_dir)  # ValueError for profile/scheme problems, before any work
    device = device_fingerprint()
    check_build_environment(plan, device)  # refuses before anything runs
    bp, quant = plan["build_profile"], plan["quantization"]
    work = Path(plan["paths"]["work"])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:  # tensor-level ValueErrors (e.g. a zero point GPTQ cannot store) come before out_dir is touched
        staging = stage_checkpoint(checkpoint_dir, Path(plan["paths"]["staging"]), quant, bp["dtype"])
    except Exception:
        shutil.rmtree(work, ignore_errors=True)
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENGINE_JSON).unlink(missing_ok=True)  # a failed rebuild must not look like a valid engine
    log = out_dir / "build.log"
    log.write_text("")
    _run("convert_checkpoint.py", plan["commands"]["convert"], log)
    tllm_config = json.loads((Path(plan["paths"]["tllm_checkpoint"]) / "config.json").read_text())
    check_converted_quantization(tllm_config, quant)
    _run("trtllm-build", plan["commands"]["build"], log)
    engine_config = json.loads((out_dir / "config.json").read_text())
    check_engine_config(engine_config, bp, bp["gather_context_logits"] == "serving")
    files = _engine_files(out_dir)
    if plan["commands"]["build_score"]:
        _run("trtllm-build (score engine)", plan["commands"]["build_score"], log)
        check_engine_config(json.loads((out_dir / SCORE_SUBDIR / "config.json").read_text()), bp, True)
        files += _engine_files(out_dir / SCORE_SUBDIR, f"{SCORE_SUBDIR}/")
    copied = _copy_tokenizer_files(checkpoint_dir, out_dir)
    end_id, pad_id = special_token_ids(out_dir)
    checkpoint_sha = sha256_tree(checkpoint_dir)
    meta = engine_meta(plan, device, checkpoint_dir, checkpoint_sha, engine_config, staging, files, copied, end_id, pad_id)
    write_engine_json(out_dir, meta)
    shutil.rmtree(work, ignore_errors=True)  # kept on failure, for the log's paths
    return meta


def engine_meta(
    plan: dict[str, Any], device: dict[str, Any], checkpoint_dir: Path, checkpoint_sha256: str,
    engine_config: dict[str, Any], staging: dict[str, Any], engine_files: list[str], tokenizer_files: list[str],
    end_id: int | None, pad_id: int | None,
) -> dict[str, Any]:
    """engine.json contents: what was built, how (every flag), on what, from which checkpoint."""
    return {
        "backend": BACKEND,
        # versions and device the engine is bound to (compared by check_compatible)
        "tensorrt_llm": device.get("tensorrt_llm"),
        "tensorrt": device.get("tensorrt"),
        "cuda": device.get("cuda_version"),
        "sm": device.get("sm"),
        "device_name": device.get("device_name"),
        "l4t_release": device.get("l4t_release"),
        "jetpack": device.get("jetpack"),
        "device": device,
        "engine_config_version": engine_config.get("version"),
        "engine_quantization": (engine_config.get("pretrained_config") or {}).get("quantization"),
        "build_profile_name": plan["build_profile_name"],
        "build_profile": plan["build_profile"],
        "commands": plan["commands"],
        "quantization": plan["quantization"],
        "staging": staging,
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "checkpoint_sha256": checkpoint_sha256,
        "cache_key": cache_key(checkpoint_sha256, plan["build_profile"], device),
        "engine_files": engine_files,
        "score_engine": SCORE_SUBDIR if plan["commands"]["build_score"] else (
            "." if plan["build_profile"]["gather_context_logits"] == "serving" else None),
        "tokenizer_files": tokenizer_files,
        "end_id": end_id,
        "pad_id": pad_id,
        "sampling": {"method": "TensorRT-LLM's own sampler (SamplingConfig) on the engine's logits",
                     "parameters": sorted(SAMPLING_SUPPORT)},
    }


# --------------------------------------------------------------------------------------------
# Runtime (GPU only; unverified on hardware here)
# --------------------------------------------------------------------------------------------


def _token_id(engine_dir: Path, token: Any) -> int | None:
    """Id of a special token given as a string or an AddedToken dict, from tokenizer.json."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    path = Path(engine_dir) / "tokenizer.json"
    if not path.exists():
        return None
    tok = json.loads(path.read_text())
    for added in tok.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def special_token_ids(engine_dir: Path) -> tuple[int | None, int | None]:
    """(end_id, pad_id) from generation_config.json, else tokenizer_config.json + tokenizer.json; pad falls back to end."""
    engine_dir = Path(engine_dir)
    gen, tok = {}, {}
    with contextlib.suppress(OSError, ValueError):
        gen = json.loads((engine_dir / "generation_config.json").read_text())
    with contextlib.suppress(OSError, ValueError):
        tok = json.loads((engine_dir / "tokenizer_config.json").read_text())
    end = gen.get("eos_token_id")
    if isinstance(end, list):
        end = end[0] if end else None
    if end is None:
        end = _token_id(engine_dir, tok.get("eos_token"))
    pad = gen.get("pad_token_id")
    if pad is None:
        pad = _token_id(engine_dir, tok.get("pad_token"))
    end = int(end) if end is not None else None
    return end, (int(pad) if pad is not None else end)


@dataclass
class TrtLlmSession:
    """Opaque handle returned by `load`: the runner (C++ executor or Python session) and facts about it."""

    engine_dir: Path
    meta: dict[str, Any]
    runner: Any
    runtime: str  # "cpp" (ModelRunnerCpp / executor, in-flight batching) or "python" (ModelRunner)
    end_id: int
    pad_id: int
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    _score_runner: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)  # python runner + lazy score runner


def _runner(engine_dir: Path, bp: dict[str, Any], score: bool = False) -> tuple[Any, str]:
    """A ModelRunnerCpp (C++ executor) if the bindings exist and the profile wants in-flight batching, else ModelRunner."""
    from tensorrt_llm.runtime import PYTHON_BINDINGS, ModelRunner

    if PYTHON_BINDINGS and bp.get("in_flight_batching", True):
        from tensorrt_llm.runtime import ModelRunnerCpp

        # Orin's GPU shares 32/64 GB with the CPU: the default KV-cache grab (90% of free memory) would
        # starve the host, so the profile's fraction applies and the cache is capped at what the build
        # limits can use (max_batch_size full-length sequences).
        slots = 1 if score else int(bp["max_batch_size"])
        runner = ModelRunnerCpp.from_dir(
            engine_dir=str(engine_dir),
            rank=0,
            max_batch_size=slots,
            kv_cache_free_gpu_memory_fraction=float(bp["kv_cache_free_gpu_memory_fraction"]),
            max_tokens_in_paged_kv_cache=slots * int(bp["max_seq_len"]),
        )
        return runner, "cpp"
    return ModelRunner.from_dir(engine_dir=str(engine_dir), rank=0), "python"


def load(engine_dir: Path) -> TrtLlmSession:
    """Check compatibility, then load the engine into a runner (GPU only; unverified on hardware here)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = read_engine_json(engine_dir)
    runner, runtime = _runner(engine_dir, meta["build_profile"])
    end_id, pad_id = meta.get("end_id"), meta.get("pad_id")
    if end_id is None:
        end_id, pad_id = special_token_ids(engine_dir)
    if end_id is None:
        raise ValueError(f"{engine_dir}: no eos token id in generation_config.json / tokenizer files (needed as end_id)")
    bp = meta["build_profile"]
    return TrtLlmSession(
        engine_dir=engine_dir, meta=meta, runner=runner, runtime=runtime, end_id=int(end_id),
        pad_id=int(pad_id if pad_id is not None else end_id), vocab_size=int(runner.vocab_size),
        max_input_len=int(bp["max_input_len"]), max_seq_len=int(bp["max_seq_len"]),
    )


def _executor(runner: Any) -> Any:
    # ModelRunnerCpp keeps the trtllm.Executor as .executor (mainline) or .session (0.10-0.12)
    return getattr(runner, "executor", None) or runner.session


def _check_lengths(session: TrtLlmSession, n_input: int, max_new_tokens: int) -> None:
    if n_input == 0:
        raise ValueError("input_ids is empty")
    if n_input > session.max_input_len:
        raise ValueError(f"{n_input} input tokens exceed the engine's max_input_len={session.max_input_len} (rebuild with a larger one)")
    if n_input + max_new_tokens > session.max_seq_len:
        raise ValueError(
            f"{n_input} input + {max_new_tokens} new tokens exceed the engine's max_seq_len={session.max_seq_len}"
        )


# What the runtime's own sampler (SamplingConfig) is given; logprobs are not wired through (400 at the server).
SAMPLING_SUPPORT = frozenset({"temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                              "repetition_penalty"})


def sampling_support() -> frozenset[str]:
    """The parameters TensorRT-LLM's sampler takes from a request (logprobs and top_logprobs are not wired)."""
    return SAMPLING_SUPPORT


def sampling_kwargs(sampling: SamplingParams | None) -> dict[str, Any]:
    """SamplingConfig / ModelRunner.generate keyword arguments for a request (top_k=1 is greedy).

    The seed's keyword is `random_seed` in the v0.12.0-jetson runtime and `seed` in mainline; the caller
    maps it (`_with_seed`). Penalties are passed only when set, so a greedy request stays `top_k=1`."""
    if sampling is None or sampling.temperature == 0:
        kw: dict[str, Any] = {"top_k": 1}
    else:
        kw = {"temperature": float(sampling.temperature)}
        if sampling.top_k > 0:
            kw["top_k"] = int(sampling.top_k)
        if sampling.top_p < 1.0:
            kw["top_p"] = float(sampling.top_p)
    if sampling is not None:
        if sampling.seed is not None:
            kw["seed"] = int(sampling.seed) & ((1 << 64) - 1)
        if sampling.repetition_penalty != 1:
            kw["repetition_penalty"] = float(sampling.repetition_penalty)
        if sampling.presence_penalty:
            kw["presence_penalty"] = float(sampling.presence_penalty)
        if sampling.frequency_penalty:
            kw["frequency_penalty"] = float(sampling.frequency_penalty)
    return kw


def _with_seed(factory: Any, kw: dict[str, Any]) -> Any:
    """Call `factory(**kw)`, renaming `seed` to `random_seed` for runtimes that spell it so."""
    try:
        return factory(**kw)
    except TypeError:
        if "seed" not in kw:
            raise
        kw = {("random_seed" if k == "seed" else k): v for k, v in kw.items()}
        return factory(**kw)


def generate(
    session: TrtLlmSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Streaming decode; yields each new token id, stopping before any stop id (GPU only; unverified here).
    Greedy (top_k=1) unless `sampling` asks otherwise; sampling runs in the runtime's sampler (`sampling_kwargs`).

    C++ runtime: one executor request per call (streaming, top_k=1), awaited by its own id, so concurrent
    calls from several threads are batched in flight by the executor. The request's end_id is the first
    stop id (else the tokenizer's eos) and the other stop ids are stop words; the Python-side check
    guarantees no stop id is ever yielded whichever way the runtime reports it. Closing the generator
    early cancels the request. Unlike the cpu backend, an eos that is not among the stop ids does not
    end the stream (the executor has one end_id, and it is given the caller's first stop id).
    """
    if max_new_tokens <= 0:
        if not input_ids:
            raise ValueError("input_ids is empty")
        return
    _check_lengths(session, len(input_ids), max_new_tokens)
    stops = [int(t) for t in stop_token_ids]
    stop_set = set(stops)
    end_id = stops[0] if stops else session.end_id
    if session.runtime == "python":
        yield from _generate_python(session, input_ids, max_new_tokens, end_id, stop_set, sampling)
        return
    import tensorrt_llm.bindings.executor as trtllm

    executor = _executor(session.runner)
    request = trtllm.Request(
        [int(t) for t in input_ids],
        int(max_new_tokens),  # positional: named max_new_tokens in 0.12, max_tokens in mainline
        streaming=True,
        sampling_config=_with_seed(trtllm.SamplingConfig, {"beam_width": 1, **sampling_kwargs(sampling)}),
        output_config=trtllm.OutputConfig(),
        end_id=end_id,
        pad_id=session.pad_id,
        stop_words=[[t] for t in stops[1:]] or None,
    )
    request_id = executor.enqueue_request(request)
    final = False
    try:
        while not final:
            for response in executor.await_responses(request_id):
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {request_id} failed: {response.error_msg}")
                result = response.result
                for token in result.output_token_ids[0]:  # streaming: only this step's new tokens
                    if int(token) in stop_set:
                        return  # the finally cancels the rest of the request
                    yield int(token)
                final = final or bool(result.is_final)
    finally:
        if not final:  # stop token, consumer closed the stream, or an error: free the batch slot
            with contextlib.suppress(Exception):
                executor.cancel_request(request_id)


def _generate_python(session: TrtLlmSession, input_ids: list[int], max_new_tokens: int, end_id: int, stops: set[int],
                     sampling: SamplingParams | None = None) -> Iterator[int]:
    """ModelRunner (Python session) fallback: one call at a time per session, streaming dicts of growing output_ids."""
    import torch

    with session._lock:
        kw = {"random_seed" if k == "seed" else k: v for k, v in sampling_kwargs(sampling).items()}
        outputs = session.runner.generate(
            [torch.tensor(input_ids, dtype=torch.int32)], max_new_tokens=max_new_tokens, end_id=end_id,
            pad_id=session.pad_id, num_beams=1, streaming=True, return_dict=True, output_sequence_lengths=True, **kw,
        )
        emitted = len(input_ids)
        for step in outputs:
            length = int(step["sequence_lengths"][0][0])
            new = step["output_ids"][0][0][emitted:length].tolist()
            for token in new:
                if int(token) in stops:
                    return
                yield int(token)
            emitted = length


def _score_runner(session: TrtLlmSession) -> tuple[Any, str]:
    where = session.meta.get("score_engine")
    if where is None:
        raise RuntimeError(
            f"{session.engine_dir}: built with gather_context_logits=off, so it cannot return logits for every position; "
            "rebuild with gather_context_logits=score_engine"
        )
    if where == ".":
        return session.runner, session.runtime
    with session._lock:
        if session._score_runner is None:
            session._score_runner = _runner(session.engine_dir / where, session.meta["build_profile"], score=True)
        return session._score_runner


def score(session: TrtLlmSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position, float32 [len(input_ids), vocab] (GPU only; unverified here).

    One context pass with return_context_logits on the engine built with --gather_context_logits
    (score/ by default: same converted checkpoint and flags as the serving engine, plus that flag).
    """
    _check_lengths(session, len(input_ids), 1)
    runner, runtime = _score_runner(session)
    if runtime == "cpp":
        import tensorrt_llm.bindings.executor as trtllm

        executor = _executor(runner)
        request = trtllm.Request(
            [int(t) for t in input_ids], 1, streaming=False,
            sampling_config=trtllm.SamplingConfig(beam_width=1, top_k=1),
            output_config=trtllm.OutputConfig(return_context_logits=True),
            end_id=session.end_id, pad_id=session.pad_id,
        )
        request_id = executor.enqueue_request(request)
        logits = None
        while logits is None:
            for response in executor.await_responses(request_id):
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {request_id} failed: {response.error_msg}")
                if response.result.is_final:
                    logits = response.result.context_logits
                    if logits is None:
                        raise RuntimeError("no context logits returned: was the score engine built with --gather_context_logits?")
    else:
        import torch

        with session._lock:
            out = runner.generate([torch.tensor(input_ids, dtype=torch.int32)], max_new_tokens=1, end_id=session.end_id,
                                  pad_id=session.pad_id, top_k=1, num_beams=1, return_dict=True)
        logits = out["context_logits"]
        logits = logits[0] if isinstance(logits, list) or getattr(logits, "ndim", 2) == 3 else logits
    arr = logits.float().cpu().numpy() if hasattr(logits, "float") else np.asarray(logits, dtype=np.float32)
    arr = arr[: len(input_ids), : session.vocab_size]
    if arr.shape != (len(input_ids), session.vocab_size):
        raise RuntimeError(f"engine returned context logits of shape {arr.shape} for {len(input_ids)} tokens")
    return np.ascontiguousarray(arr, dtype=np.float32)
