"""Build planning for the tensorrt_llm backend (pure: no GPU, no TensorRT-LLM, nothing written).

    python -c "from edgeflow.engines.tensorrt_llm.plan import plan_build; print(plan_build('ckpt', {})['commands'])"

Build profiles (deployments/engine-profiles/*.yaml, overridable per release), which converter precision a
checkpoint gets and why, the exact convert_checkpoint.py / trtllm-build command lines, and the checks of
what the converter and the builder wrote against what was asked for.

Every profile names the TensorRT-LLM API generation it drives (`api`, see API_GENERATIONS): this backend
drives "tensorrt-engine" (convert_checkpoint.py + trtllm-build + ModelRunnerCpp), which TensorRT-LLM
removed in 1.3.0rc21; a profile pinned at or past that release is refused when it loads.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from edgeflow.model.architecture import backends_for, describe, require
from edgeflow.engines.checkpoint import checkpoint_algorithm, read_config, weight_schemes
from edgeflow.engines.tensorrt_llm.versions import (API_GENERATIONS, BACKEND_API, check_api_version, version_order)
from edgeflow.paths import REPO_ROOT

BACKEND = "tensorrt_llm"

SCORE_SUBDIR = "score"

PROFILES_DIR = REPO_ROOT / "deployments" / "engine-profiles"

# Where the TensorRT-LLM source checkout lives on the build host: convert_checkpoint.py ships with
# the examples, not in the wheel. /opt/TensorRT-LLM is where NVIDIA's jetson-containers image puts it.
TRTLLM_SRC_ENV = "EDGEFLOW_TRTLLM_SRC"
DEFAULT_TRTLLM_SRC = "/opt/TensorRT-LLM"

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


class BuildProfile(BaseModel):
    """One TensorRT-LLM build + runtime configuration (deployments/engine-profiles/<name>.yaml)."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(description="What the profile is for, in one line.")
    api: str = Field(
        default=BACKEND_API,
        description="TensorRT-LLM API generation the profile drives; this backend implements 'tensorrt-engine' "
        "(convert_checkpoint.py + trtllm-build + ModelRunnerCpp, TensorRT-LLM >=0.12.0,<1.3.0rc21).",
    )
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
        if self.api != BACKEND_API:
            known = {k: g.range() for k, g in API_GENERATIONS.items()}
            raise ValueError(
                f"api={self.api!r}: this backend builds and runs {BACKEND_API!r} engines (API generations: {known}); "
                "TensorRT-LLM's PyTorch/LLM API path loads checkpoints without an engine build and is not driven "
                f"here. Fix: set api {BACKEND_API!r} with a TensorRT-LLM {API_GENERATIONS[BACKEND_API].range()}, "
                "or serve the checkpoint with the vllm backend"
            )
        check_api_version(self.api, self.tensorrt_llm_version)
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


def _override(name: str) -> tuple[Any, Any]:
    f = BuildProfile.model_fields[name]
    return (f.annotation | None, Field(default=None, description=f"Overrides the build profile's {name}: {f.description}"))


_Options = create_model(
    "_Options",
    __config__=ConfigDict(extra="forbid"),
    build_profile=(str, Field(default="orin-agx", description="Name of deployments/engine-profiles/<name>.yaml; "
                              "Orin is the deployment target.")),
    algorithm=(Literal["awq", "gptq", "rtn"] | None, Field(
        default=None, description="Recipe that produced the checkpoint (config.json does not say); None reads the "
        "checkpoint's recipe.yaml if present. Recorded in engine.json; it does not change the converter flags.")),
    tensorrt_llm_src=(str | None, Field(default=None, description="TensorRT-LLM source tree holding the convert "
                                        f"script; None -> ${TRTLLM_SRC_ENV} or {DEFAULT_TRTLLM_SRC}.")),
    **{name: _override(name) for name in BuildProfile.model_fields},
)


# Caller-facing keys besides the BuildProfile fields (which override the named build profile), with their defaults.
DEFAULT_PROFILE: dict[str, Any] = {k: _Options.model_fields[k].default for k in ("build_profile", "algorithm", "tensorrt_llm_src")}


class Profile(_Options):
    """`engine.profile` of the tensorrt_llm backend: a named build profile plus per-field overrides.

    Validated when the edgeflow profile loads: the named YAML must exist and the merged build profile
    must be valid (every BuildProfile check), so a typo fails then, not hours later on the target.
    """

    @model_validator(mode="after")
    def _merged_build_profile_is_valid(self) -> Profile:
        self.build_profile_model()
        return self

    def overrides(self) -> dict[str, Any]:
        """The BuildProfile fields given explicitly."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if k in BuildProfile.model_fields}

    def build_profile_model(self) -> BuildProfile:
        """The named build profile with the overrides applied (ValueError naming the profile and the field)."""
        overrides = self.overrides()
        merged = {**load_build_profile(self.build_profile), **overrides}
        try:
            return BuildProfile(**merged)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'profile'}: {err['msg'].removeprefix('Value error, ')}"
                                 for err in e.errors())
            raise ValueError(f"build profile {self.build_profile!r} (with overrides {sorted(overrides)}) is invalid: "
                             f"{problems}") from None


def available_build_profiles() -> list[str]:
    """Names of the YAML build profiles under deployments/engine-profiles/ that are TensorRT-LLM profiles (they
    have a tensorrt_llm_version key; the directory also holds other backends' profiles)."""
    out = []
    for p in sorted(PROFILES_DIR.glob("*.yaml")):
        data = yaml.safe_load(p.read_text()) or {}
        if isinstance(data, dict) and "tensorrt_llm_version" in data:
            out.append(p.stem)
    return out


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
    from edgeflow.engines import validate_profile

    p = validate_profile(BACKEND, profile)
    options = {k: getattr(p, k) for k in DEFAULT_PROFILE}
    return p.build_profile, p.build_profile_model(), options


def weight_scheme(config: dict[str, Any], where: str = "config.json") -> dict[str, Any] | None:
    """None for a dense checkpoint; the one weight-only scheme TensorRT-LLM's converter takes; else ValueError."""
    schemes = weight_schemes(config, where, engine="tensorrt_llm")
    if schemes is None:
        return None
    where = f"{where} quantization_config"
    ignore = config["quantization_config"].get("ignore") or []
    if "lm_head" not in ignore:
        raise ValueError(
            f"{where}.ignore={ignore}: the lm_head is quantized; TensorRT-LLM's weight-only converters keep it "
            "dense (re-quantize with ignore: [lm_head])"
        )
    out = {}
    for name, s in schemes.items():
        g = f"{where}.config_groups.{name}"
        if s.format != "pack-quantized":
            raise ValueError(f"{g}.format={s.format!r}: only 'pack-quantized' weights are repacked for TensorRT-LLM")
        if s.type != "int" or s.bits not in (4, 8):
            raise ValueError(f"{g}.weights: type={s.type!r} num_bits={s.bits}; supported: int, 4 or 8 bits")
        if s.strategy not in ("group", "channel"):
            raise ValueError(f"{g}.weights.strategy={s.strategy!r}: supported: 'group', 'channel'")
        if s.actorder not in (None, "static", "weight"):
            raise ValueError(
                f"{g}.weights.actorder={s.actorder!r}: act-order with a permuted g_idx is not supported by "
                "TensorRT-LLM's GPTQ path ('GPTQ with desc_act=True is not implemented'); use actorder weight or none"
            )
        if s.strategy == "group" and s.group_size not in _TRT_GROUP_SIZES:
            raise ValueError(
                f"{g}.weights.group_size={s.group_size}: TensorRT-LLM's group-wise kernels take {list(_TRT_GROUP_SIZES)} "
                "(SmolLM2's 576-wide projections need 64)"
            )
        if s.bits == 4 and s.strategy != "group":
            raise ValueError(f"{g}.weights.strategy={s.strategy!r} with num_bits=4: W4A16 must be group-wise (group_size 64 or 128)")
        out[name] = s.model_dump(include={"bits", "strategy", "group_size", "symmetric", "actorder", "format"})
    distinct = {json.dumps(s, sort_keys=True) for s in out.values()}
    if len(distinct) != 1:
        raise ValueError(
            f"{where}.config_groups use different schemes {out}: convert_checkpoint.py takes one "
            "--weight_only_precision per engine, so a mixed W8/W4 checkpoint cannot be converted exactly"
        )
    return next(iter(out.values()))


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


def convert_command(
    quant: dict[str, Any], build_profile: BuildProfile, staging_dir: Path, ckpt_dir: Path, trtllm_src: Path,
    conv: Converter | None = None,
) -> list[str]:
    """The convert_checkpoint.py command line for a staged checkpoint (the gemma converter spells its flags with
    hyphens and takes --ckpt-type: examples/gemma/convert_checkpoint.py)."""
    conv = conv or CONVERTERS["llama"]
    script = str(Path(trtllm_src) / convert_script(build_profile, conv))
    if conv.example == "gemma":
        return [sys.executable, script, "--ckpt-type", "hf", "--model-dir", str(staging_dir), "--output-model-dir",
                str(ckpt_dir), "--dtype", build_profile.dtype]
    cmd = [
        sys.executable, script,
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


class Converter(BaseModel):
    """How TensorRT-LLM's engine flow converts one family: its example's convert_checkpoint.py and since when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    example: Literal["llama", "qwen", "gemma"] = Field(description="The examples/ directory (examples/models/core/ "
                                                        "from 1.0) whose convert_checkpoint.py converts the family.")
    since: str = Field(description="First TensorRT-LLM release whose converter takes the family (its release notes).")
    exact_int4: bool = Field(description="Whether edgeflow stages int4 checkpoints for this converter exactly "
                             "(--quant_ckpt_path with AutoGPTQ tensors); else only dense checkpoints convert.")
    source: str = Field(description="Where `since` was read.")


# Per family (transformers model_type). Release notes (docs/source/release-notes.md): 0.12.0 "Supported LLaMA 3.1",
# "Supported Qwen 2"; 0.13.0 "Supported Gemma 2"; 0.19.0 "Gemma3 text-only model support"; 1.0 "TensorRT-Engine Qwen3
# (dense)". Only the llama converter takes --quant_ckpt_path (staged AutoGPTQ int4, exact). The qwen converter reads
# GPTQ weights from the Hugging Face quantization_config (not staged here yet), and the gemma converter offers only
# re-quantizing int4 or ModelOpt AWQ (--use-weight-only-with-precision int4 | w4a16_awq): int4 checkpoints of those
# families are refused rather than re-quantized. Mistral (the llama converter) is not converted: TensorRT-LLM's
# sliding-window attention is a runtime setting edgeflow does not drive.
CONVERTERS: dict[str, Converter] = {
    "llama": Converter(example="llama", since="0.12.0", exact_int4=True, source="release notes 0.12.0: LLaMA 3.1"),
    "qwen2": Converter(example="qwen", since="0.12.0", exact_int4=False, source="release notes 0.12.0: Qwen 2"),
    "qwen3": Converter(example="qwen", since="1.0.0", exact_int4=False, source="release notes 1.0: TensorRT-Engine Qwen3"),
    "gemma2": Converter(example="gemma", since="0.13.0", exact_int4=False, source="release notes 0.13.0: Gemma 2"),
    "gemma3_text": Converter(example="gemma", since="0.19.0", exact_int4=False,
                             source="release notes 0.19.0: Gemma3 text-only"),
}


def converter_for(config: dict[str, Any], build_profile: BuildProfile, name: str, where: str) -> Converter:
    """The family's converter at the build profile's TensorRT-LLM version, or a ValueError naming the family, the
    version it needs, the profile's version and the backends that run it (before any work)."""
    arch = require(config, "tensorrt_llm", where)
    conv = CONVERTERS[arch.model_type]
    if version_order(build_profile.tensorrt_llm_version) < version_order(conv.since):
        others = ", ".join(b for b in backends_for(arch.model_type) if b != "tensorrt_llm")
        raise ValueError(
            f"{where}: the {arch.family} family converts from TensorRT-LLM {conv.since} ({conv.source}); build profile "
            f"{name!r} uses {build_profile.tensorrt_llm_version} ({build_profile.tensorrt_llm_branch}). Fix: a build "
            f"profile at {conv.since} or later (a100: 1.2.1), or engine.backend one of: {others}")
    return conv


def check_model(config: dict[str, Any], profile: dict | None, where: str = "config.json") -> None:
    """edgeflow.engines.check_model's hook: the family's converter exists at the profile's TensorRT-LLM version."""
    name, build_profile, _ = resolve_profile(profile)
    converter_for(config, build_profile, name, where)


def convert_script(build_profile: BuildProfile, conv: Converter) -> str:
    """The family's convert_checkpoint.py: the profile's llama one with the family's example directory."""
    return str(Path(build_profile.convert_script).parent.parent / conv.example / "convert_checkpoint.py")


def plan_build(checkpoint_dir: Path, profile: dict | None, out_dir: Path | None = None) -> dict[str, Any]:
    """Validate profile + checkpoint and return the exact command lines and metadata, without running anything."""
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path("engine")
    name, build_profile, options = resolve_profile(profile)
    config = read_config(checkpoint_dir)
    conv = converter_for(config, build_profile, name, f"{checkpoint_dir}/config.json")
    limit = int(config.get("max_position_embeddings") or 0)
    if limit and build_profile.max_seq_len > limit:
        raise ValueError(
            f"profile max_seq_len={build_profile.max_seq_len} exceeds the model's max_position_embeddings={limit}; "
            f"lower max_seq_len to <= {limit}"
        )
    algorithm, source = checkpoint_algorithm(checkpoint_dir, options["algorithm"])
    quant = quantization_plan(config, build_profile, algorithm, f"{checkpoint_dir}/config.json")
    quant["algorithm_source"] = source
    if quant["weight_only_precision"] is not None and not conv.exact_int4:
        arch = describe(config)
        raise ValueError(
            f"{checkpoint_dir}/config.json: a {quant['scheme']['bits']}-bit {arch.family} checkpoint: TensorRT-LLM's "
            f"{conv.example} converter takes no pre-quantized weights edgeflow stages exactly (it would re-quantize). "
            f"Fix: build the dense checkpoint here, or serve this one with engine.backend one of: "
            f"{', '.join(b for b in backends_for(arch.model_type) if b != 'tensorrt_llm')}")

    work = out_dir.with_name(out_dir.name + ".work")
    staging, ckpt = work / "staging", work / "tllm_checkpoint"
    src = trtllm_src_dir(options)
    gather = build_profile.gather_context_logits
    commands = {
        "convert": convert_command(quant, build_profile, staging, ckpt, src, conv),
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
