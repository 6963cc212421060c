"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

Native CPU engine backend: one decoder in C (AVX2 + FMA, `native/q4.c`) driven through ctypes, for every family
edgeflow/model/architecture.py describes (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3).

* The int4 body runs the checkpoint's own integers: y = sum_g s * xs * sum_k (q - z) * xq, with the
  activations quantized to int16 per 64-element group (xq, scale xs: 15 bits, where fp16 keeps 11), so
  every group's dot product is an exact integer (AVX2 vpmaddwd) and only the activation rounding and the
  fp32 sum over groups differ from the fake-quantized HF model (logits within 0.5e-4 to 2.5e-4 of their
  largest magnitude, the same greedy tokens; BENCHMARKS.md#cpu-native-vs-hf). Unpacking int4 this way takes 2.75 ALU ops
  per 16 weights, shared by every stream in the step, so a second stream adds only its multiply-adds.
  8-bit weights (W8A16, the 8-bit half of mixed recipes) run the same way through an int8 kernel
  (q4.c's q8w_gemm): each linear takes the kernel of its own width. Per-channel scales and groups of a
  multiple of 64 columns are repeated into 64-column groups at build, so they run exactly too.
  Dense checkpoints, and quantized schemes the kernels cannot hold (other widths, groups that are not a
  multiple of 64, act-order) with `inexact_weights: dequantize`, run fp32 weights and fp32 activations
  through an fp32 kernel of the same shape; engine.json says so under "dequantized".
* Greedy decoding uses an exact-argmax lm_head: an int8 per-row copy of the fp32 head (times the int16
  activations) gives approximate logits, a per-row Cauchy-Schwarz bound (which includes the activation
  rounding) selects every row that could be the argmax, and those are rescored in fp32 against the
  original table (one full fp32 pass when there are more than `max_candidates`). The chosen token is
  the fp32 argmax, not an approximation of it.
* Sampling (temperature > 0, penalties) draws exactly from the fp32 head's distribution without reading
  it: the same bound gives every logit an interval, and `Sampler.draw_bounded`'s algorithm (in C: q4.c's
  sample_bounded, one call a step; Gemma 2's softcap keeps the Python one) proposes a token from the
  upper bounds, rescores that one row in fp32 and accepts it with the exact ratio (rejection sampling);
  top_k rescores the rows that can hold the top k, top_p decides a token's membership from the bounds
  and the rows that keep it open. Logprobs, and a step that would rescore more than `max_candidates`
  rows, read the full fp32 head. engine.json states the method under "sampling". Every fp32 logit,
  rescored or full, is q4.c's head_rows (the greedy head's own sum, on the session's team, never numpy's
  BLAS threads), and the proposal's envelope is q4.c's head_envelope (sampling.Universe).
* `score` runs the full fp32 head (one SGEMM over all positions).
* One decoder step carries up to 64 rows: prefill chunks of the prompts that arrived together, or
  one decode row per stream (up to 4 streams); `generate_batch` decodes several prompts together in
  one step per token.

Architecture scope: what `edgeflow.model.architecture.describe` reads from config.json. A family is a description, not a
fork: the one step in q4.c takes each layer's optional tensors (q/k/v and o biases, per-head q/k norms, Gemma's
post-attention and post-feedforward norms), its sliding window and RoPE table, and the family's activation (SiLU or
GELU-tanh), attention scale and softcap; the int4 kernels and the thread team are the same for every family.
Weights are fixed once at build: Gemma's (1 + w) norms are folded into w, q/k/v are fused. The embedding scale
(Gemma) is applied to the looked-up rows, Gemma 2's final softcap to the head's logits (`NativeSession.logits`).
Hidden and intermediate sizes must be multiples of 64 (int4) or 8 (fp32), head_dim a multiple of 16; MLP biases
are refused. Anything else raises ValueError at build time naming the field.

The C source is compiled once per (source, compiler, flags) into $EDGEFLOW_NATIVE_CACHE (default
~/.cache/edgeflow/native) with `cc -O3 -mavx2 -mfma -mf16c -pthread -shared -fPIC`; engine.json
records the source's sha256 and `check_compatible` refuses an engine built from another source, or a
CPU without AVX2/FMA. `load`, `generate` and `score` use numpy and ctypes only (no torch import).
Threads: $EDGEFLOW_ENGINE_THREADS, else every CPU this process may use; each session owns a team of them
(q4.c's team_*), whose idle workers spin for $EDGEFLOW_ENGINE_SPIN_US microseconds (yielding the core to
anything else runnable) before they sleep. `SPIN_US_DEFAULT` says why the default is what it is.

The package: settings.py (names, versions, flags, the engine.profile model), kernels.py (q4.c compiled and
loaded), layout.py (how weights are stored), builder.py (the build), runtime.py (the session, a step, the head),
scheduler.py (requests in flight together; generate, generate_batch, score).
"""
from edgeflow.engines.cpu_host import cpu_flags as _cpu_flags  # noqa: F401 - what kernels.py and runtime.py check the ISA with
from edgeflow.engines.hooks import device_memory_used, device_utilization  # noqa: F401  (backend API: CPU defaults)
from edgeflow.engines.cpu_native.settings import (  # noqa: F401
    BACKEND,
    CACHE_ENV,
    CC_FLAGS,
    DEFAULT_PROFILE,
    FIX,
    FORMAT_VERSION,
    GROUP,
    IDLE_EXIT_S,
    MAX_ROWS,
    Profile,
    REQUIRED_ISA,
    SOURCE,
    SPIN_ENV,
    SPIN_US_DEFAULT,
    STEP_ROWS,
    WEIGHTS,
)
from edgeflow.engines.cpu_native.kernels import _library, compile_kernels, kernel_sha256
from edgeflow.engines.cpu_native.layout import int8_head, pack_int4, pack_int8
from edgeflow.engines.cpu_native.builder import build, build_identity, detect_schemes, native_schemes
from edgeflow.engines.cpu_native.runtime import (  # noqa: F401
    NativeSession,
    SAMPLE_UNIFORMS,
    _Decoder,
    _HeadBuffers,
    _ptr,
    check_compatible,
    head_argmax,
    head_rows,
    head_sample,
    head_universe,
    load,
    spin_us_from_env,
)
from edgeflow.engines.cpu_native.scheduler import generate, generate_batch, sampling_support, score
