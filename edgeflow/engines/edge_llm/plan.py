"""Build planning for the edge_llm backend (pure: no GPU, no Edge-LLM, nothing written).

    python -c "from edgeflow.engines.edge_llm.plan import plan_build; print(plan_build('ckpt', {})['commands'])"

Build profiles (deployments/engine-profiles/orin-jp7.yaml, overridable per release), the phase a build()
call runs (export on the x86 export pool, engine on the Orin), what the exporter is given for a checkpoint
and why, and the exact `tensorrt-edgellm-export` / `llm_build` command lines.

Upstream (TensorRT Edge-LLM 0.10.0 source, github.com/NVIDIA/TensorRT-Edge-LLM, read through the fork
Stars1233/TensorRT-Edge-LLM at the "0.10.0 Release" commit; the 0.11.0 docs in NVIDIA/TensorRT-Edge-LLM
gh-pages 0.11.0/user_guide/getting_started/quick-start-guide.html show the same two commands):

* export: `tensorrt-edgellm-export <checkpoint> <output_dir> [--dtype float16] [--int4-gemm-plugin-version 1|2]`
  (console script -> tensorrt_edgellm.scripts.export:main, pyproject.toml [project.scripts]; flags in
  tensorrt_edgellm/scripts/export.py main()). It writes <output_dir>/llm/{model.onnx, config.json,
  embedding.safetensors, tokenizer files}. Pre-quantized input is read from config.json's
  quantization_config: quant_method "gptq" -> int4_gptq, "awq" -> int4_awq, or ModelOpt's quant_algo
  (tensorrt_edgellm/config.py _parse_quant); compressed-tensors is not among them.
* engine: `build/examples/llm/llm_build --onnxDir <dir> --engineDir <dir> --maxBatchSize N --maxInputLen N
  --maxKVCacheCapacity N` (examples/llm/llm_build.cpp; defaults 4 / 1024 / 4096). It writes llm.engine,
  config.json (the export's, plus builder_config), tokenizer files and embedding.safetensors
  (cpp/builder/llmBuilder.cpp).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from edgeflow.model.architecture import require
from edgeflow.engines.checkpoint import InexactWeights, checkpoint_algorithm, int4_group_scheme, read_config, weight_schemes
from edgeflow.paths import REPO_ROOT

BACKEND = "edge_llm"

# Generation of this backend's engine layout and runtime contract (engine.json keys, export/engine
# split, in-process LLMRuntime serving); check_compatible refuses engines of another generation.
API_GENERATION = 1

PROFILES_DIR = REPO_ROOT / "deployments" / "engine-profiles"

# Where the Edge-LLM source tree and its CMake build live on the Orin (llm_build and the pybind module are
# build outputs, not pip-installed). /opt/TensorRT-Edge-LLM is this project's convention, not upstream's.
EDGE_LLM_SRC_ENV = "EDGEFLOW_EDGELLM_SRC"
DEFAULT_EDGE_LLM_SRC = "/opt/TensorRT-Edge-LLM"

# The interpreter the exporter runs in. tensorrt-edgellm 0.11.0's `export` extra pins transformers 5.14.1, onnx 1.19.0
# and numpy 2.2.6 against edgeflow's 5.17 / 1.23 / 2.4, so it lives in a venv of its own (`make edgellm-venv`:
# ~/.cache/edgeflow/venvs/edgellm-<hash>, the export pool's image the same); this names that venv's python.
# Unset: this interpreter (a host that installed tensorrt-edgellm beside edgeflow).
EXPORTER_PYTHON_ENV = "EDGEFLOW_EDGELLM_PYTHON"

# Sub-directory of an export directory holding the exporter's output root (<root>/llm/model.onnx ...).
ONNX_SUBDIR = "onnx"

# The int4 group size Edge-LLM's kernels run. Both int4 GEMM plugins hard-code 128: legacy
# cpp/kernels/int4GroupwiseGemmKernels/int4WoqGemmCuda.cu (`constexpr int G = 128`) and
# int4WoQGemvCuda.cu (`ELLM_CHECK(group_size == 128, ...)`); cuteDSL V2
# cpp/plugins/int4GroupwiseGemmPluginV2/cuteDslInt4Gemm.cpp (`group_size == 128 for these variants`) and
# cuteDslInt4Gemv.cpp (`kGemvGroupSize = 128`). The plugins' shape checks accept K/64 scale rows, so a
# group-64 export would build and then read the wrong scales: refused here.
EDGE_LLM_INT4_GROUP_SIZES = (128,)

# Edge-LLM's int4 GEMM computes (n - 8) * scale with n in [0, 15] and no zero point: the exporter folds a
# GPTQ zero point into the nibbles, n = clamp(q - zero + 8, 0, 15)
# (tensorrt_edgellm/checkpoint/repacking.py repack_gptq_to_plugin), so q - zero must lie in [-8, 7].
INT4_CENTERED_RANGE = (-8, 7)

_INT4_WHY = (
    "int4_gptq: the checkpoint's integers, zero points and scales rewritten in AutoGPTQ's layout "
    "(qweight/qzeros stored zero-1/scales/g_idx, config quant_method gptq); the exporter reads it as "
    "int4_gptq (tensorrt_edgellm/config.py _parse_quant), folds the zero points into the nibbles and runs "
    "(n - 8) * fp16 scale: exact when every q - zero lies in [-8, 7] (always for symmetric checkpoints; "
    "checked per layer for asymmetric ones) and the scales are fp16-representable up to one rounding"
)
_DEQUANT_WHY = (
    "fp16 from the exactly dequantized weights: the checkpoint's scheme has no exact Edge-LLM int4 form "
    "(profile inexact_weights: dequantize); one fp16 rounding of each weight, no int4 speed or memory"
)


class BuildProfile(BaseModel):
    """One Edge-LLM export + engine + runtime configuration (deployments/engine-profiles/<name>.yaml)."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(description="What the profile is for, in one line.")
    target: str = Field(pattern=r"^sm\d{2,3}$", description="GPU architecture the engine is built for and runs on (sm87: Orin).")
    jetpack: str = Field(description="JetPack release the engine is built on (the engine binds to its TensorRT).")
    l4t_release: str | None = Field(
        default=None, pattern=r"^\d+\.\d+(\.\d+)?$",
        description="L4T release of that JetPack when known (None: accept the device when gpu_host names its JetPack).")
    tensorrt_version: str | None = Field(
        default=None, description="TensorRT major.minor the JetPack ships, when known (None: whatever the device has, recorded).")
    cuda_version: str = Field(description="CUDA toolkit of the JetPack (Edge-LLM's CUDA_CTK_VERSION for the target).")
    embedded_target: str = Field(description="Edge-LLM CMake EMBEDDED_TARGET the runtime was built with (jetson-orin).")
    edge_llm_version: str = Field(pattern=r"^\d+\.\d+\.\d+", description="Edge-LLM release whose exporter, llm_build and runtime are used (major.minor.patch).")
    llm_build: str = Field(description="llm_build binary, relative to the Edge-LLM source tree (its CMake build).")
    dtype: Literal["float16"] = Field(description="Export dtype: Edge-LLM's int4 and dense Orin kernels take float16 activations.")
    int4_gemm_plugin_version: Literal[1, 2] = Field(
        description="Exporter --int4-gemm-plugin-version: 2 cuteDSL Int4GroupwiseGemmPluginV2, 1 legacy plugin.")
    max_batch_size: int = Field(gt=0, description="llm_build --maxBatchSize: sequences decoded at once.")
    max_input_len: int = Field(gt=0, description="llm_build --maxInputLen: longest prompt, tokens.")
    max_kv_cache_capacity: int = Field(gt=0, description="llm_build --maxKVCacheCapacity: longest prompt + generation, tokens.")
    inexact_weights: Literal["error", "dequantize"] = Field(
        description="A quantized checkpoint with no exact Edge-LLM int4 form: refuse (error) or build fp16 from its "
        "exactly dequantized weights (dequantize).")

    @model_validator(mode="after")
    def _consistent(self) -> BuildProfile:
        if self.max_kv_cache_capacity <= self.max_input_len:
            raise ValueError(
                f"max_kv_cache_capacity={self.max_kv_cache_capacity} must exceed max_input_len={self.max_input_len} "
                "(room to generate)"
            )
        return self


def _override(name: str) -> tuple[Any, Any]:
    f = BuildProfile.model_fields[name]
    return (f.annotation | None, Field(default=None, description=f"Overrides the build profile's {name}: {f.description}"))


_Options = create_model(
    "_Options",
    __config__=ConfigDict(extra="forbid"),
    build_profile=(str, Field(default="orin-jp7", description="Name of deployments/engine-profiles/<name>.yaml.")),
    phase=(Literal["auto", "export", "engine"], Field(
        default="auto", description="What build() runs: export (checkpoint -> ONNX + sidecars, on the x86 export "
        "pool), engine (an export directory -> TensorRT engine, on the target), or auto (export for a checkpoint, "
        "engine for an export directory).")),
    algorithm=(Literal["awq", "gptq", "rtn"] | None, Field(
        default=None, description="Recipe that produced the checkpoint; recorded in engine.json (None: recipe.yaml "
        "if present). It does not change the exporter's input.")),
    edge_llm_src=(str | None, Field(default=None, description="Edge-LLM source tree with its CMake build (llm_build, "
                                    f"the pybind runtime); None -> ${EDGE_LLM_SRC_ENV} or {DEFAULT_EDGE_LLM_SRC}.")),
    **{name: _override(name) for name in BuildProfile.model_fields},
)

DEFAULT_PROFILE: dict[str, Any] = {k: _Options.model_fields[k].default
                                   for k in ("build_profile", "phase", "algorithm", "edge_llm_src")}


class Profile(_Options):
    """`engine.profile` of the edge_llm backend: a named build profile, the phase, and per-field overrides.

    Validated when the edgeflow profile loads: the named YAML must exist and the merged build profile
    must be valid, so a typo fails then, not after an export on another host.
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
    """Names of the YAML build profiles under deployments/engine-profiles/ that are Edge-LLM profiles."""
    out = []
    for p in sorted(PROFILES_DIR.glob("*.yaml")):
        data = yaml.safe_load(p.read_text()) or {}
        if isinstance(data, dict) and "edge_llm_version" in data:
            out.append(p.stem)
    return out


def load_build_profile(name: str) -> dict[str, Any]:
    """The raw mapping of deployments/engine-profiles/<name>.yaml (ValueError naming the profile if unknown)."""
    names = available_build_profiles()
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"profile build_profile={name!r} is not an Edge-LLM build profile; choose one of {names} "
                         f"(files in {PROFILES_DIR} with an edge_llm_version key)")
    return yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text())


def resolve_profile(profile: dict | None) -> tuple[str, BuildProfile, dict[str, Any]]:
    """(build profile name, validated BuildProfile, caller options) from a build() profile dict."""
    from edgeflow.engines import validate_profile

    p = validate_profile(BACKEND, profile)
    options = {k: getattr(p, k) for k in DEFAULT_PROFILE}
    return p.build_profile, p.build_profile_model(), options


def edge_llm_src_dir(options: dict[str, Any]) -> Path:
    """Edge-LLM source tree: profile edge_llm_src, else $EDGEFLOW_EDGELLM_SRC, else /opt/TensorRT-Edge-LLM."""
    return Path(options.get("edge_llm_src") or os.environ.get(EDGE_LLM_SRC_ENV) or DEFAULT_EDGE_LLM_SRC)


def quantization_plan(config: dict[str, Any], build_profile: BuildProfile, where: str = "config.json") -> dict[str, Any]:
    """What the exporter gets for this checkpoint: dense fp16, the int4 GPTQ repack, or (opt-in) fp16 dequantized.

    ValueError naming the field for what no engine builds (activation / KV-cache quantization, sparsity,
    transforms: edgeflow.engines.checkpoint.weight_schemes); InexactWeights naming the config group and field
    for weight-only schemes Edge-LLM's int4 kernels cannot hold (8-bit, per-channel, group size other than
    128, act-order, mixed W8/W4), unless the profile says inexact_weights: dequantize.
    """
    schemes = weight_schemes(config, where, engine="edge_llm")
    if schemes is None:
        return {"staging": "dense", "precision": "fp16", "exporter_quant_type": "fp16", "scheme": None,
                "group_size": None, "exact": True, "dequantized": None,
                "why": "dense checkpoint exported in float16 (the exporter's --dtype)"}
    try:
        scheme = int4_group_scheme(
            schemes, where, EDGE_LLM_INT4_GROUP_SIZES,
            "Edge-LLM's int4 group-wise kernels (group size 128 only: int4WoqGemmCuda.cu, cuteDslInt4Gemm.cpp)",
        )
    except InexactWeights as e:
        if build_profile.inexact_weights == "error":
            raise InexactWeights(f"{e}. Fix: re-quantize W4A16 symmetric with group_size 128, or set the profile's "
                                 "inexact_weights: dequantize to build fp16 from the dequantized weights") from None
        return {"staging": "dequantized", "precision": "fp16", "exporter_quant_type": "fp16", "scheme": None,
                "group_size": None, "exact": False, "dequantized": str(e), "why": _DEQUANT_WHY}
    hidden = [int(config[k]) for k in ("hidden_size", "intermediate_size") if config.get(k)]
    bad = [n for n in hidden if n % scheme.group_size]
    if bad:
        raise InexactWeights(
            f"{where}: hidden_size/intermediate_size {bad} are not multiples of the group size {scheme.group_size}; "
            "Edge-LLM's int4 kernels need whole groups of 128 along K"
        )
    return {"staging": "gptq_int4", "precision": "int4_gptq", "exporter_quant_type": "int4_gptq",
            "scheme": scheme.model_dump(), "group_size": scheme.group_size, "exact": True, "dequantized": None,
            "why": _INT4_WHY}


def exporter_python() -> str:
    """The interpreter tensorrt-edgellm's exporter runs in: $EDGEFLOW_EDGELLM_PYTHON, else this one."""
    return os.environ.get(EXPORTER_PYTHON_ENV) or sys.executable


def export_command(build_profile: BuildProfile, staging_dir: Path, onnx_root: Path) -> list[str]:
    """The exporter command line (`python -m` the module behind the `tensorrt-edgellm-export` console script)."""
    return [
        # pyproject.toml [project.scripts] tensorrt-edgellm-export = "tensorrt_edgellm.scripts.export:main";
        # the module form works where the console script is not on PATH
        exporter_python(), "-m", "tensorrt_edgellm.scripts.export",
        str(staging_dir), str(onnx_root),  # positional: model, output_dir (tensorrt_edgellm/scripts/export.py)
        "--dtype", build_profile.dtype,
        "--int4-gemm-plugin-version", str(build_profile.int4_gemm_plugin_version),
    ]


def build_command(build_profile: BuildProfile, edge_llm_src: Path, llm_onnx_dir: Path, engine_dir: Path) -> list[str]:
    """The llm_build command line (flags: examples/llm/llm_build.cpp parseLLMBuildArgs)."""
    p = build_profile
    return [
        str(Path(edge_llm_src) / p.llm_build),
        "--onnxDir", str(llm_onnx_dir),
        "--engineDir", str(engine_dir),
        "--maxBatchSize", str(p.max_batch_size),
        "--maxInputLen", str(p.max_input_len),
        "--maxKVCacheCapacity", str(p.max_kv_cache_capacity),
    ]


def export_meta_of(directory: Path) -> dict[str, Any] | None:
    """engine.json of an Edge-LLM export directory (stage "export"), else None."""
    path = Path(directory) / "engine.json"
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError:
        return None
    return meta if meta.get("backend") == BACKEND and meta.get("stage") == "export" else None


def _choose_phase(phase: str, checkpoint_dir: Path, export_meta: dict[str, Any] | None) -> str:
    if phase == "auto":
        return "engine" if export_meta is not None else "export"
    if phase == "export" and export_meta is not None:
        raise ValueError(f"profile phase='export' but {checkpoint_dir} is already an Edge-LLM export; pass the "
                         "checkpoint it came from, or phase: engine to build its engine on the target")
    if phase == "engine" and export_meta is None:
        raise ValueError(f"profile phase='engine' needs an Edge-LLM export directory; {checkpoint_dir} has no "
                         "engine.json with stage 'export'. Fix: run build() with phase export (or auto) on the export "
                         "host first and pass its output here")
    return phase


def plan_build(checkpoint_dir: Path, profile: dict | None, out_dir: Path | None = None) -> dict[str, Any]:
    """Validate profile + input and return the phase, the exact command lines and metadata, without running anything."""
    checkpoint_dir = Path(checkpoint_dir)
    out_dir = Path(out_dir) if out_dir is not None else Path("engine")
    name, bp, options = resolve_profile(profile)
    export_meta = export_meta_of(checkpoint_dir)
    phase = _choose_phase(options["phase"], checkpoint_dir, export_meta)
    src = edge_llm_src_dir(options)
    base = {"backend": BACKEND, "phase": phase, "build_profile_name": name, "build_profile": bp.model_dump()}
    if phase == "engine":
        exported = export_meta.get("edge_llm_exporter")
        if exported != bp.edge_llm_version:
            raise ValueError(
                f"{checkpoint_dir} was exported with Edge-LLM {exported}; build profile {name!r} uses "
                f"edge_llm_version={bp.edge_llm_version} (llm_build rejects exports older than 0.9.0 and warns on any "
                "mismatch: cpp/common/version.cpp checkVersion). Fix: re-export with the profile's version"
            )
        llm_dir = checkpoint_dir / ONNX_SUBDIR / "llm"
        return {**base, "quantization": export_meta.get("quantization"), "export_meta": export_meta,
                "commands": {"export": None, "build": build_command(bp, src, llm_dir, out_dir)},
                "paths": {"export": str(checkpoint_dir), "llm_onnx": str(llm_dir), "engine": str(out_dir),
                          "edge_llm_src": str(src)}}
    config = read_config(checkpoint_dir)
    require(config, "edge_llm", f"{checkpoint_dir}/config.json")  # the families this backend exports, or why not
    limit = int(config.get("max_position_embeddings") or 0)
    if limit and bp.max_kv_cache_capacity > limit:
        raise ValueError(f"profile max_kv_cache_capacity={bp.max_kv_cache_capacity} exceeds the model's "
                         f"max_position_embeddings={limit}; lower it to <= {limit}")
    algorithm, source = checkpoint_algorithm(checkpoint_dir, options["algorithm"])
    quant = {**quantization_plan(config, bp, f"{checkpoint_dir}/config.json"), "algorithm": algorithm,
             "algorithm_source": source}
    work = out_dir.with_name(out_dir.name + ".work")
    staging, onnx_root = work / "staging", out_dir / ONNX_SUBDIR
    return {**base, "quantization": quant, "export_meta": None,
            "commands": {"export": export_command(bp, staging, onnx_root), "build": None},
            "paths": {"work": str(work), "staging": str(staging), "onnx_root": str(onnx_root),
                      "llm_onnx": str(onnx_root / "llm"), "export": str(out_dir), "edge_llm_src": str(src)},
            "tied_embeddings": bool(config.get("tie_word_embeddings", False))}


# Files the exporter writes for an LLM (tensorrt_edgellm/scripts/export.py summary; llmBuilder.cpp copies them).
EXPORT_REQUIRED = ("model.onnx", "config.json", "embedding.safetensors")


def check_export_config(export_config: dict[str, Any], plan: dict[str, Any], source_config: dict[str, Any]) -> None:
    """The exporter's runtime config.json must match the checkpoint and the profile (RuntimeError naming the field)."""
    want = {
        "edgellm_version": plan["build_profile"]["edge_llm_version"],
        "vocab_size": source_config.get("vocab_size"),
        "hidden_size": source_config.get("hidden_size"),
        "num_hidden_layers": source_config.get("num_hidden_layers"),
        "num_key_value_heads": source_config.get("num_key_value_heads"),
    }
    wrong = {k: {"export": export_config.get(k), "expected": v} for k, v in want.items()
             if v is not None and export_config.get(k) != v}
    if wrong:
        raise RuntimeError(f"exported config.json differs from the checkpoint/profile: {wrong}")


def check_engine_config(engine_config: dict[str, Any], build_profile: dict[str, Any]) -> None:
    """llm_build's config.json builder_config must hold the profile's limits (llmBuilder.h LLMBuilderConfig::toJson)."""
    bc = engine_config.get("builder_config") or {}
    want = {"max_batch_size": build_profile["max_batch_size"], "max_input_len": build_profile["max_input_len"],
            "max_kv_cache_capacity": build_profile["max_kv_cache_capacity"]}
    wrong = {k: {"engine": bc.get(k), "profile": v} for k, v in want.items() if bc.get(k) != v}
    if wrong:
        raise RuntimeError(f"built engine config.json builder_config differs from the build profile: {wrong}")
