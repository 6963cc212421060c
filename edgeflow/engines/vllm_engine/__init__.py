"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

vLLM engine backend for A100 hosts: serves and gates edgeflow checkpoints with vLLM, which reads
llm-compressor compressed-tensors checkpoints natively (W4A16 pack-quantized, W8A16, mixed W8/W4, dense)
and runs their integer weights with Marlin kernels (repacked at load, nothing re-quantized).

What it does, per interface function (see `edgeflow/engines/__init__.py`):

* `build` = `plan_build` (pure: the profile, every config group checked against vLLM 0.34's
  compressed-tensors loader and Marlin's types and group sizes, max_model_len / max_logprobs / tensor
  parallelism against config.json; refusals name the config group and field) + the engine directory: the
  checkpoint's config.json and safetensors hard-linked, its tokenizer files copied, and engine.json
  (precision from the quantization_config, checkpoint sha256, the vLLM release and minimum SM it needs, the
  validated profile and the exact engine arguments `load` passes). vLLM compiles nothing ahead of time, so
  this runs on any CPU.
* `check_compatible` compares engine.json with `device_fingerprint()` (edgeflow.engines.gpu_host plus the
  installed vLLM) through the pure `compare`: CUDA present, SM at least the engine's min_sm, vLLM major.minor
  equal to the recorded release.
* `load` / `generate` / `score` run vLLM's AsyncLLM (in-flight batching across concurrent calls) with the
  recorded arguments; `generate` streams tokens (greedy, or vLLM's sampler through `sampling_kwargs`, with
  logprobs when asked); `score` reads full-vocabulary prompt log-probabilities (`dense_logprobs`): logits up
  to a per-position constant, which is all the gate's softmax, KL, top-1 and perplexity need. These need a
  GPU with vLLM; they are written against vLLM 0.34.0's API and unverified on hardware here.
* `device_memory_used` / `device_utilization`: NVML (per-process memory of vLLM's engine processes), else
  torch.cuda.mem_get_info; None without a GPU.

The package splits into `plan` (pure), `device` (fingerprint, compatibility, build identity), `engine` (the
build and engine.json) and `runtime` (load, generate, score, the device hooks). vLLM and torch are imported
only inside the functions that need them: importing this package and building work on a CPU-only machine.
"""
from __future__ import annotations

from edgeflow.engines.vllm_engine import device, engine, plan, runtime  # (the package's parts)
from edgeflow.engines.vllm_engine.device import (
    build_identity,
    check_build_host,
    check_compatible,
    compare,
    device_fingerprint,
)
from edgeflow.engines.vllm_engine.engine import build, engine_meta
from edgeflow.engines.vllm_engine.plan import (
    BACKEND,
    FORMAT_VERSION,
    MARLIN_GROUP_SIZES,
    VLLM_VERSION,
    Profile,
    engine_args,
    marlin_refusal,
    plan_build,
    precision,
    quantization_plan,
)
from edgeflow.engines.vllm_engine.runtime import (
    SAMPLING_SUPPORT,
    VllmSession,
    dense_logprobs,
    device_memory_used,
    device_utilization,
    generate,
    load,
    logprob_rows,
    sampling_kwargs,
    sampling_support,
    score,
    score_kwargs,
    to_token,
)

__all__ = [
    "device",
    "engine",
    "plan",
    "runtime",
    "BACKEND",
    "FORMAT_VERSION",
    "MARLIN_GROUP_SIZES",
    "Profile",
    "SAMPLING_SUPPORT",
    "VLLM_VERSION",
    "VllmSession",
    "build",
    "build_identity",
    "check_build_host",
    "check_compatible",
    "compare",
    "dense_logprobs",
    "device_fingerprint",
    "device_memory_used",
    "device_utilization",
    "engine_args",
    "engine_meta",
    "generate",
    "load",
    "logprob_rows",
    "marlin_refusal",
    "plan_build",
    "precision",
    "quantization_plan",
    "sampling_kwargs",
    "sampling_support",
    "score",
    "score_kwargs",
    "to_token",
]
