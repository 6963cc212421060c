"""build(Path("ckpt"), Path("eng"), {"build_profile": "orin-agx"}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

TensorRT-LLM engine backend: TensorRT engines built on the target GPU (Jetson AGX Orin sm87 with the
`v0.12.0-jetson` branch, or an A100 sm80 with TensorRT-LLM 1.2.1) from edgeflow checkpoints.

It drives TensorRT-LLM's "tensorrt-engine" API generation (convert_checkpoint.py + trtllm-build + ModelRunnerCpp),
which exists in TensorRT-LLM >=0.12.0,<1.3.0rc21: v1.3.0rc20 was the last release with the TensorRT backend, and
1.2.1 the last stable one. Build profiles and engine.json name it (`api`); a profile pinned at or past 1.3.0rc21
is refused when it loads, and `check_compatible` names the API generation of the engine and of the device (an
engine.json without `api`, from older builds, reads as this legacy flow). TensorRT-LLM 1.3.0rc21 and later load
checkpoints through the PyTorch backend / LLM API without an engine: on such hosts use the vllm backend.

What it does, per interface function (see `edgeflow/engines/__init__.py`):

* `build` = `plan_build` (pure: validates the profile and the checkpoint's quantization, returns the
  exact `convert_checkpoint.py` and `trtllm-build` command lines; runs on any CPU) + an environment
  check (TensorRT-LLM installed at the profile's version, a CUDA device whose SM is the profile's
  target: a TensorRT plan only runs on the architecture and TensorRT version that built it, so builds
  happen on the target) + staging, conversion, engine build and `engine.json`.
  - llm-compressor checkpoints (compressed-tensors "pack-quantized", W4A16 group-wise) are repacked
    bit-exactly into the AutoGPTQ layout (`edgeflow.engines.checkpoint.write_gptq_int4`) and converted with
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
    repeated over 64-wide groups; needs a TensorRT-LLM with W8A16_GPTQ: the a100 profile's 1.2.1).
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

The package splits along those lines: `plan` (pure: profiles, the checkpoint's converter precision,
command lines, checks of the converter's and builder's outputs), `device` (fingerprint, compatibility,
cache key), `staging` (checkpoint -> what convert_checkpoint.py reads exactly), `engine` (the build
itself and engine.json) and `runtime` (load, generate, score, the device hooks).

`tensorrt_llm`, `tensorrt` and torch are imported only inside the functions that need them, so
importing this package (and planning a build) works on a CPU-only machine.
"""
from __future__ import annotations

from edgeflow.engines.tensorrt_llm import device, engine, plan, runtime, staging  # (the package's parts)
from edgeflow.engines.tensorrt_llm.device import (
    DEVICE_KEY_FIELDS,
    build_identity,
    cache_key,
    check_build_environment,
    check_compatible,
    compare,
    device_fingerprint,
    engine_api,
    parse_nv_tegra_release,
)
from edgeflow.engines.tensorrt_llm.engine import build, engine_meta
from edgeflow.engines.tensorrt_llm.plan import (
    BACKEND,
    DEFAULT_PROFILE,
    SCORE_SUBDIR,
    BuildProfile,
    Profile,
    available_build_profiles,
    check_converted_quantization,
    check_model,
    check_engine_config,
    load_build_profile,
    plan_build,
    quantization_plan,
    resolve_profile,
    weight_scheme,
)
from edgeflow.engines.tensorrt_llm.versions import (
    API_GENERATIONS,
    BACKEND_API,
    ApiGeneration,
    api_generation_of,
    check_api_version,
    version_order,
)
from edgeflow.engines.tensorrt_llm.runtime import (
    SAMPLING_SUPPORT,
    TrtLlmSession,
    device_memory_used,
    device_utilization,
    generate,
    load,
    sampling_kwargs,
    sampling_support,
    score,
    special_token_ids,
)
from edgeflow.engines.tensorrt_llm.staging import legacy_hf_config, stage_checkpoint

__all__ = [
    "device",
    "engine",
    "plan",
    "runtime",
    "staging",
    "API_GENERATIONS",
    "ApiGeneration",
    "BACKEND",
    "BACKEND_API",
    "BuildProfile",
    "DEFAULT_PROFILE",
    "DEVICE_KEY_FIELDS",
    "Profile",
    "SAMPLING_SUPPORT",
    "SCORE_SUBDIR",
    "TrtLlmSession",
    "api_generation_of",
    "available_build_profiles",
    "build",
    "build_identity",
    "cache_key",
    "check_api_version",
    "check_build_environment",
    "check_compatible",
    "check_converted_quantization",
    "check_engine_config",
    "compare",
    "device_fingerprint",
    "device_memory_used",
    "device_utilization",
    "engine_api",
    "engine_meta",
    "generate",
    "legacy_hf_config",
    "load",
    "load_build_profile",
    "parse_nv_tegra_release",
    "plan_build",
    "check_model",
    "quantization_plan",
    "resolve_profile",
    "sampling_kwargs",
    "sampling_support",
    "score",
    "special_token_ids",
    "stage_checkpoint",
    "version_order",
    "weight_scheme",
]
