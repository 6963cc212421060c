"""build(Path("ckpt"), Path("export"), {}) on the export host; build(Path("export"), Path("eng"), {}) on the Orin; s = load(Path("eng"))

TensorRT Edge-LLM engine backend: Jetson AGX Orin (sm87) on JetPack 7.2, Edge-LLM 0.11.x
(github.com/NVIDIA/TensorRT-Edge-LLM; Orin is an "Official" platform on JetPack 7.2 in its support matrix).

What it does, per interface function (see `edgeflow/engines/__init__.py`):

* `build` runs one of two phases, chosen from its input (profile `phase`, default auto; see `engine`):
  - export (x86 export pool, CPU is enough): the checkpoint is staged as what Edge-LLM's exporter reads
    (`staging`) and exported with `python -m tensorrt_edgellm.scripts.export` (= `tensorrt-edgellm-export`)
    into ONNX + sidecars; engine.json says stage "export".
    * W4A16 group-wise int4 with group size 128: rewritten bit-exactly in AutoGPTQ's layout
      (`edgeflow.engines.checkpoint.write_gptq_int4`), read by the exporter as int4_gptq. Symmetric (GPTQ)
      checkpoints are exact; asymmetric (AWQ, RTN) ones only where every q - zero lies in [-8, 7], because
      Edge-LLM's int4 kernel has no zero point (the exporter folds it and clamps): checked per layer.
    * Group size 64 (edgeflow's recipes), W8A16, per-channel, act-order and mixed W8/W4 checkpoints have no
      exact Edge-LLM form: both int4 GEMM plugins hard-code group size 128, and Edge-LLM's INT8 is
      SmoothQuant W8A8. They are refused naming the field (InexactWeights), or built fp16 from the exactly
      dequantized weights with `inexact_weights: dequantize` (recorded under `dequantized`).
    * Dense checkpoints are exported in float16. Activation/KV-cache quantization, sparsity and transforms
      raise ValueError naming the field.
  - engine (on the target only): `check_build_environment` refuses any host but the profile's target
    (sm87, JetPack 7.2 / its L4T release, TensorRT, Edge-LLM release), naming both sides; then
    `llm_build` compiles the export and engine.json (stage "engine") records Edge-LLM, JetPack, L4T,
    TensorRT, SM, the exporter's version, the precision (int4_gptq or fp16) and the API generation.
* `check_compatible` is the pure `compare(engine.json, gpu_fingerprint() + Edge-LLM version)`.
* `load` / `generate` use Edge-LLM's Python bindings (`_edgellm_runtime`, built with
  BUILD_PYTHON_BINDINGS=ON) in this process, streaming through a StreamChannel. `score` raises
  EngineIncompatibleError: the runtime returns no full logits (top-50 logprobs of generated tokens at
  most), so the consistency gate must run on generated tokens or on another backend. `sampling_support`
  is temperature, top_p, top_k. All three need the device and are unverified on hardware here.

The package splits along those lines: `plan` (pure), `device` (fingerprint, compatibility, build
environment), `staging` (checkpoint -> exporter input), `export` (the export phase), `engine` (build(),
the engine phase, engine.json) and `runtime`. Nothing here imports Edge-LLM, TensorRT or torch at
import time.
"""
from __future__ import annotations

from edgeflow.engines.edge_llm import device, engine, export, plan, runtime, staging  # (the package's parts)
from edgeflow.engines.edge_llm.device import (
    DEVICE_KEY_FIELDS,
    build_identity,
    build_identity_of,
    cache_key,
    check_build_environment,
    check_compatible,
    check_export_environment,
    compare,
    device_fingerprint,
    edge_llm_version,
    exporter_version,
    parse_version_file,
)
from edgeflow.engines.edge_llm.engine import ENGINE_FILES, build, engine_meta
from edgeflow.engines.edge_llm.export import run_export
from edgeflow.engines.edge_llm.plan import (
    API_GENERATION,
    BACKEND,
    DEFAULT_PROFILE,
    EDGE_LLM_INT4_GROUP_SIZES,
    BuildProfile,
    Profile,
    available_build_profiles,
    build_command,
    check_engine_config,
    check_export_config,
    export_command,
    exporter_python,
    load_build_profile,
    plan_build,
    quantization_plan,
    resolve_profile,
)
from edgeflow.engines.edge_llm.runtime import (
    SAMPLING_SUPPORT,
    SCORE_UNAVAILABLE,
    EdgeLlmSession,
    device_memory_used,
    device_utilization,
    generate,
    load,
    prompt_text,
    sampler_fields,
    sampling_support,
    score,
    special_token_ids,
)
from edgeflow.engines.edge_llm.staging import check_int4_exact, edge_llm_dequantize, stage_checkpoint

__all__ = [
    "device", "engine", "export", "plan", "runtime", "staging",
    "API_GENERATION", "BACKEND", "BuildProfile", "DEFAULT_PROFILE", "DEVICE_KEY_FIELDS", "EDGE_LLM_INT4_GROUP_SIZES",
    "ENGINE_FILES", "EdgeLlmSession", "Profile", "SAMPLING_SUPPORT", "SCORE_UNAVAILABLE",
    "available_build_profiles", "build", "build_command", "build_identity", "build_identity_of", "cache_key",
    "check_build_environment", "check_compatible", "check_engine_config", "check_export_config",
    "check_export_environment", "check_int4_exact", "compare", "device_fingerprint", "device_memory_used",
    "device_utilization", "edge_llm_dequantize", "edge_llm_version", "engine_meta", "export_command", "exporter_python", "exporter_version", "generate",
    "load", "load_build_profile", "parse_version_file", "plan_build", "prompt_text", "quantization_plan",
    "resolve_profile", "run_export", "sampler_fields", "sampling_support", "score", "special_token_ids",
    "stage_checkpoint",
]
