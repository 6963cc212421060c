"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

llama.cpp engine backend: one GGUF file written from an edgeflow checkpoint, run by llama.cpp through
llama-cpp-python (built from its sdist at install; see docs/concepts/engines.md).

What it does, per interface function (see `edgeflow/engines/__init__.py`):

* `build` writes `model.gguf` (GGUF v3; architecture `llama`, `qwen2`, `qwen3`, `gemma2` or `gemma3`, as GGUF_ARCH
  maps the family) itself, with the `gguf` package: nothing is
  re-quantized. Each llm-compressor layer's stored integers become llama.cpp blocks of 32 weights:
  - int4 asymmetric (AWQ/RTN) -> Q4_1: w = d*q + m with d = scale and m = -scale*zero, both in fp16;
  - int4 symmetric (GPTQ)     -> Q4_0: w = d*(q - 8) with d = scale in fp16;
  - int8 symmetric (W8A16)    -> Q8_0: w = d*q with d = scale in fp16;
  a group of 64 or 128 (or a per-channel row) is 2, 4 (or n/32) blocks sharing one scale. Mixed recipes
  (W8 attention, W4 MLP) keep each layer's own type. The only rounding is the scales (and Q4_1's m) to fp16;
  engine.json records it per block type under `rounding` (0.0 where the checkpoint's scales are fp16 values).
  Schemes blocks cannot hold (asymmetric int8, a group size that is not a multiple of 32, act-order groups)
  build from the exactly dequantized weights (`inexact_weights: dequantize`, recorded under `dequantized`)
  or raise (`error`). The embedding / tied lm_head table is `head` (f32 exact by default), other dense
  linears `dense`; norms and biases stay f32 (Gemma's (1 + w) norms folded to w' = 1 + w). For the `llama` graph
  only, q_proj/k_proj rows are permuted from Hugging Face's rotate-half order to llama.cpp's interleaved rope, as
  llama.cpp's own converter does; what a family's graph cannot compute is refused before any work. Tokenizer metadata comes from
  tokenizer.json (BPE); edgeflow passes token ids, so llama.cpp's tokenizer never encodes a request.
* `generate` evaluates the prompt, then one token per step, on a llama.cpp context (its own KV cache) taken
  from the session's pool: concurrent calls use different contexts over the same memory-mapped weights.
  Greedy picks the argmax of the step's fp32 logits; sampling feeds the same logits to the shared Sampler
  (edgeflow/engines/sampling.py), so every sampling parameter is honoured, seeded draws included.
* `score` evaluates the whole sequence on a context created with logits for every position.

llama.cpp multiplies int8-quantized activations (q8_0/q8_1 blocks of 32) with quantized weights: the gate
measures that, and engine parity (the engine against its own fake-quantized model) shows its cost.
Threads: EDGEFLOW_ENGINE_THREADS, else every CPU this process may use (edgeflow/engines/cpu_host.py).
GPU builds of llama.cpp (GGML_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=87 on Orin, 80 on A100) run the same GGUF
file with `n_gpu_layers`; that path is unverified on a GPU (README "What has run where").

The package: settings.py (names, the engine.profile model, families as GGUF architectures), blocks.py (what the
blocks hold exactly, and the integers written as blocks), gguf.py (the build), runtime.py (llama-cpp-python).
"""
from edgeflow.engines.checkpoint import layer_scheme  # noqa: F401 - the per-layer scheme the blocks are chosen by
from edgeflow.engines.hooks import device_memory_used, device_utilization  # noqa: F401  (backend API: CPU defaults)
from edgeflow.engines.sampling import PARAMETERS  # noqa: F401 - what sampling_support names
from edgeflow.engines.llama_cpp.settings import (  # noqa: F401
    BACKEND,
    BLOCK,
    DEFAULT_PROFILE,
    FORMAT,
    GGUF_ARCH,
    GGUF_FILE,
    GGUF_ROPES,
    INTERLEAVED_ROPE,
    Profile,
    WRITER,
    _gguf_name,
    gguf_arch,
    llama_cpp_attn_scale,
)
from edgeflow.engines.llama_cpp.blocks import _rope_heads, detect_schemes, encode_blocks, permute_rope_rows
from edgeflow.engines.llama_cpp.gguf import build, build_identity, write_gguf
from edgeflow.engines.llama_cpp.runtime import (  # noqa: F401
    LlamaCppSession,
    check_compatible,
    generate,
    load,
    sampling_support,
    score,
)
