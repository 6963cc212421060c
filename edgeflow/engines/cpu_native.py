"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

Native CPU engine backend: one decoder in C (AVX2 + FMA, `native/q4.c`) driven through ctypes, for every family
edgeflow/model/architecture.py describes (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3).

* The int4 body runs the checkpoint's own integers: y = sum_g s * xs * sum_k (q - z) * xq, with the
  activations quantized to int16 per 64-element group (xq, scale xs: 15 bits, where fp16 keeps 11), so
  every group's dot product is an exact integer (AVX2 vpmaddwd) and only the activation rounding and the
  fp32 sum over groups differ from the fake-quantized HF model (logits within 0.5e-4 to 2.5e-4 of their
  largest magnitude, the same greedy tokens; BENCHMARKS.md). Unpacking int4 this way takes 2.75 ALU ops
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
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgeflow.model.architecture import Architecture, check_backend, describe
from edgeflow.tracking.artifacts import sha256_tree
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.engines import EngineIncompatibleError, engine_dir as edir, validate_profile
from edgeflow.engines.checkpoint import (
    InexactWeights,
    WeightScheme,
    copy_tokenizer_files,
    layer,
    layer_scheme,
    load_dequantized,
    load_tensors,
    read_config,
    weight_schemes,
)
from edgeflow.engines.cpu_host import ISA_FLAGS, cpu_flags as _cpu_flags, device_fingerprint, int_from_env, threads_from_env
from edgeflow.engines.hooks import device_memory_used, device_utilization  # noqa: F401  (backend API: CPU defaults)
from edgeflow.engines.sampling import (
    GREEDY, NUCLEUS_ROWS, PARAMETERS, REDRAWS, REJECTION_TRIES, TAIL_LOG, Sampler, SamplingParams, Token, Universe,
)

BACKEND = "cpu_native"
WEIGHTS = "weights.safetensors"
# 2: int4 words of 4 nibbles for the int16-activation kernels; row-major int8 head. 3: the family description in
# engine.json's "architecture" (edgeflow/model/architecture.py), norms with their offset folded in, biases and q/k norms.
# 4: int8 weights (W8A16, the 8-bit half of mixed recipes) row-major with int16 zero points; scales per 64 columns.
FORMAT_VERSION = 4
SOURCE = Path(__file__).resolve().parent / "native" / "q4.c"
CACHE_ENV = "EDGEFLOW_NATIVE_CACHE"
CC_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-pthread", "-shared", "-fPIC")
REQUIRED_ISA = ("avx2", "fma", "f16c")
GROUP = 64
MAX_ROWS = 4  # streams decoded together (one row each per step): q4.c's DECODE_ROWS, its widest row kernel
STEP_ROWS = 64  # rows one llama_step call carries (q4.c's STEP_ROWS): prefill chunks of one or several prompts
# (64 against 16: 11-16 % faster prefill of 128-1,024 tokens, BENCHMARKS.md "Prefill: panels, attention by KV group,
# 64-row steps"; a prompt's whole prefill runs between two decode steps whatever the chunk, so live streams wait no
# longer)
IDLE_EXIT_S = 2.0  # an idle scheduler thread ends after this long (restarted by the next generate)
FIX = "use engine.backend: cpu (onnxruntime) for this checkpoint or machine"
SPIN_ENV = "EDGEFLOW_ENGINE_SPIN_US"
# How long an idle team worker spins (yielding its core to anything runnable every ~64 pauses) before it
# sleeps. Measured on the 2-core Intel VM, 30-layer int4 model, 1 stream (BENCHMARKS.md "thread team"):
# sleeping at once costs a futex wake-up of an idle vCPU per region (~200 regions a token); a spin that
# outlasts the gaps between regions and between tokens (~0.1 ms of Python) avoids them, and a longer one
# buys nothing on a quiet machine and costs CPU on a busy one.
SPIN_US_DEFAULT = 200

class Profile(BaseModel):
    """`engine.profile` of the cpu_native backend (validated when the edgeflow profile loads)."""

    model_config = ConfigDict(extra="forbid")

    inexact_weights: Literal["dequantize", "error"] = Field(
        default="dequantize", description="Quantized weights the int4/int8 kernels cannot hold exactly (another bit "
        "width, groups that are not a multiple of 64 columns, act-order): 'dequantize' runs the exactly dequantized fp32 weights (same "
        "numbers, dense speed; recorded under 'dequantized' in engine.json); 'error' refuses the checkpoint.")
    max_candidates: int = Field(
        default=4096, ge=0, description="Exact-argmax head: above this many candidate rows one full fp32 pass runs "
        "instead of rescoring (rows are rescored one by one; past ~4k a single SGEMM over the head is cheaper).")


DEFAULT_PROFILE: dict[str, Any] = Profile().model_dump()

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_FUSED = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
          ("gu", ("mlp.gate_proj", "mlp.up_proj")), ("dn", ("mlp.down_proj",)))
# q4.c's per-linear kinds by the stored weight's dtype: int4 words, fp32, int8
_KINDS = {np.dtype(np.uint16): 0, np.dtype(np.float32): 1, np.dtype(np.int8): 2}


# --------------------------------------------------------------------------------------------
# Compiling and loading the kernels
# --------------------------------------------------------------------------------------------


def kernel_sha256() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def _compiler() -> tuple[str, str]:
    """(path, first line of --version) of the C compiler ($CC or cc); EngineIncompatibleError if none."""
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise EngineIncompatibleError(
            f"cpu_native needs a C compiler to build its kernels, but {name!r} is not on PATH on this machine "
            f"(install gcc, or set $CC); or {FIX}"
        )
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return path, (out.stdout.splitlines() or [""])[0].strip()


def _require_isa() -> None:
    have = _cpu_flags()
    missing = [f for f in REQUIRED_ISA if f not in have]
    if missing:
        raise EngineIncompatibleError(
            f"cpu_native kernels need CPU flags {list(REQUIRED_ISA)}; this CPU lacks {missing} "
            f"(has {sorted(f for f in ISA_FLAGS if f in have)}); {FIX}"
        )


_LIBS: dict[str, ctypes.CDLL] = {}
_LIB_LOCK = threading.Lock()


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgeflow" / "native")


def compile_kernels() -> tuple[Path, dict[str, Any]]:
    """Compile native/q4.c (once per source/compiler/flags) and return (library path, build facts)."""
    _require_isa()
    cc, version = _compiler()
    src_sha = kernel_sha256()
    key = hashlib.sha256("\n".join([src_sha, cc, version, *CC_FLAGS]).encode()).hexdigest()[:20]
    lib = _cache_root() / key / "libedgeflow_q4.so"
    facts = {"kernel_sha256": src_sha, "compiler": version, "compiler_path": cc, "compile_flags": list(CC_FLAGS)}
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [cc, *CC_FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            raise EngineIncompatibleError(
                f"compiling the cpu_native kernels failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}\n{FIX}"
            )
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written library
    return lib, facts


def _library() -> ctypes.CDLL:
    path, _ = compile_kernels()
    with _LIB_LOCK:
        if str(path) not in _LIBS:
            lib = ctypes.CDLL(str(path))
            P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
            L = ctypes.c_long
            # every kernel's last argument is the session's team (team_create), or None for one thread
            lib.q4i_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.q8w_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.f32_gemm.argtypes = [P, I, I, I, P, P, P]
            lib.head_argmax.argtypes = [P, I, I, I, I, P, P, P, P, P, P, P, I, P, P, P]
            lib.q8i_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.head_bounds.argtypes = [P, I, I, I, P, P, P, P, P, P, P, P]
            lib.head_rows.argtypes = [P, I, P, P, I, P, P]
            lib.head_envelope.argtypes = [P, I, ctypes.c_double, ctypes.c_double, P, P, P, P]
            lib.head_envelope.restype = I
            D = ctypes.c_double
            lib.sample_bounded.argtypes = [P, I, P, P, P, I, D, D, I, P, P, P, I, D, D, I, I, I, L, P, I, P, P, P, P, P, P,
                                           P]
            lib.sample_bounded.restype = I
            lib.llama_scratch_floats.argtypes = [I, I, I, I, I, I, I]
            lib.llama_scratch_floats.restype = L
            lib.llama_step.argtypes = [I, P, P, P, P, I, I, I, I, I, I, F, P, P, P, I, I, P, P, P, P]
            for name in ("q4i_gemm", "q8w_gemm", "f32_gemm", "head_argmax", "head_bounds", "head_rows", "q8i_gemm", "llama_step",
                         "team_destroy"):
                getattr(lib, name).restype = None
            lib.team_create.argtypes, lib.team_create.restype = [I, L], P
            lib.team_destroy.argtypes = [P]
            for name in ("team_threads", "team_spinning", "team_regions", "team_sleeps", "team_probes", "team_probes_spin"):
                getattr(lib, name).argtypes = [P]
                getattr(lib, name).restype = I if name in ("team_threads", "team_spinning") else L
            lib.llama_step_rows.argtypes = []
            if lib.llama_step_rows() != STEP_ROWS:  # the scratch buffers are sized by it
                raise RuntimeError(f"{path}: q4.c carries {lib.llama_step_rows()} rows per step, this module {STEP_ROWS}")
            _LIBS[str(path)] = lib
        return _LIBS[str(path)]


# --------------------------------------------------------------------------------------------
# Weight layout
# --------------------------------------------------------------------------------------------


def pack_int4(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q uint8 [N, K] in 0..15, s fp32 [N, K/64], z uint8 [N, K/64] -> the q4i_gemm layout (w, s, z int16).

    Word i of a row's group holds q[i], q[16+i], q[32+i], q[48+i] in its four nibbles (low to high), so
    the kernel gets four int16 vectors of q with three shifts and three masks.
    """
    n, k = q.shape
    g = k // GROUP
    qq = q.astype(np.uint16).reshape(n, g, 4, 16)
    w = qq[:, :, 0] | (qq[:, :, 1] << 4) | (qq[:, :, 2] << 8) | (qq[:, :, 3] << 12)  # [N, G, 16]
    return np.ascontiguousarray(w), np.ascontiguousarray(s, np.float32), np.ascontiguousarray(z, np.int16)


def int8_head(E: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row int8 copy of the fp32 head (row-major, rows padded to a multiple of 4 and columns to a
    multiple of 64 with zeros) and the per-row norms the exact-argmax bound needs: dn = ||E_r - Ehat_r||,
    en = ||E_r||."""
    v, k = E.shape
    vp, kp = -(-v // 4) * 4, -(-k // GROUP) * GROUP
    amax = np.abs(E).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(E / scale[:, None]), -127, 127).astype(np.int8)
    E64 = E.astype(np.float64)
    dn = np.linalg.norm(E64 - q.astype(np.float64) * scale[:, None].astype(np.float64), axis=1) * (1 + 1e-6)
    en = np.linalg.norm(E64, axis=1)
    qp = np.zeros((vp, kp), np.int8)
    qp[:v, :k] = q
    sp = np.ones(vp, np.float32)
    sp[:v] = scale
    return {"head.q8": qp, "head.q8_scale": sp, "head.dn": dn.astype(np.float32), "head.en": en.astype(np.float32)}


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _arch(config: dict[str, Any], where: Path) -> Architecture:
    """The model's description (edgeflow/model/architecture.py), with this kernel's shape rules; ValueError naming the field."""
    arch = describe(config, f"{where}/config.json")
    check_backend(arch, BACKEND, f"{where}/config.json")
    if arch.mlp_bias:
        raise ValueError(f"{where}/config.json: mlp_bias=true: the cpu_native engine has no MLP biases; {FIX}")
    hd, heads, kv = arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    if hd % 16:
        raise ValueError(f"{where}/config.json: head_dim={hd} must be a multiple of 16 (the attention kernel's width)")
    if arch.hidden_size % 8 or arch.intermediate_size % 8:
        raise ValueError(f"{where}/config.json: hidden_size={arch.hidden_size}, intermediate_size={arch.intermediate_size} "
                         "must be multiples of 8")
    return arch


# Per layer, what layer_t (q4.c) holds past the four fused linears: where each optional tensor comes from in the
# checkpoint (norms get the family's offset folded in once, here).
_COLUMNS = ("ln1", "qkv_w", "qkv_s", "qkv_z", "o_w", "o_s", "o_z", "ln2", "gu_w", "gu_s", "gu_z", "dn_w", "dn_s", "dn_z",
            "kind", "window", "qkv_b", "o_b", "q_norm", "k_norm", "post_attn", "post_ffn", "cos", "sin")


def _norms_and_biases(dense: dict[str, np.ndarray], arch: Architecture, i: int) -> dict[str, np.ndarray]:
    """Layer i's norm weights (offset folded: Gemma's 1 + w, in fp32 as transformers adds it) and biases, by layer_t name."""
    p = f"model.layers.{i}."
    off = np.float32(arch.norm_offset)

    def norm(name: str) -> np.ndarray:
        return (dense[p + name + ".weight"].astype(np.float32) + off).astype(np.float32)

    out = {"ln1": norm("input_layernorm")}
    if arch.sandwich_norms:
        out |= {"ln2": norm("pre_feedforward_layernorm"), "post_attn": norm("post_attention_layernorm"),
                "post_ffn": norm("post_feedforward_layernorm")}
    else:
        out["ln2"] = norm("post_attention_layernorm")
    if arch.qk_norm:
        out |= {"q_norm": norm("self_attn.q_norm"), "k_norm": norm("self_attn.k_norm")}
    if arch.qkv_bias:
        out["qkv_b"] = np.concatenate([dense[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]).astype(np.float32)
    if arch.o_bias:
        out["o_b"] = dense[f"{p}self_attn.o_proj.bias"].astype(np.float32)
    return out


def native_schemes(schemes: dict[str, WeightScheme], where: str) -> dict[str, WeightScheme]:
    """The checkpoint's config groups, if the kernels run every one exactly: pack-quantized integers of 4 or 8 bits,
    per channel or in groups of a multiple of 64 columns (repeated into 64-column groups at build), contiguous groups.
    InexactWeights naming the config group and field otherwise."""
    for name, sc in schemes.items():
        g = f"{where} quantization_config.config_groups.{name}"
        if sc.format != "pack-quantized":
            raise InexactWeights(f"{g}.format={sc.format!r}: only 'pack-quantized' integers repack into the cpu_native kernels")
        if sc.bits not in (4, 8) or sc.type != "int":
            raise InexactWeights(f"{g}.weights: num_bits={sc.bits} type={sc.type!r}; cpu_native runs 4- and 8-bit int weights")
        if sc.strategy not in ("group", "channel") or (sc.strategy == "group" and (sc.group_size or 0) % GROUP):
            raise InexactWeights(f"{g}.weights: strategy={sc.strategy!r} group_size={sc.group_size}; cpu_native runs "
                                 f"per-channel scales or groups of a multiple of {GROUP} columns; this one is not representable")
        if sc.actorder not in (None, "static", "weight"):
            raise InexactWeights(f"{g}.weights.actorder={sc.actorder!r}: act-order with a permuted g_idx is not "
                                 "representable by cpu_native's contiguous groups (use actorder weight or none)")
    return schemes


def _quantized_linear(tensors: dict[str, np.ndarray], prefix: str, schemes: dict[str, WeightScheme]) -> tuple[int, np.ndarray, ...]:
    """(bits, q uint8 [out, in], s fp32 [out, in/64], z uint8 [out, in/64]) of one linear layer as the checkpoint
    stores it (edgeflow.engines.checkpoint.layer: q - z is exact), its scales and zero points repeated to every 64-column
    group, with the kernels' shape rule: whole 64-column groups and 8-row words."""
    try:
        scheme = layer_scheme(tensors, prefix, schemes) if len(schemes) > 1 else next(iter(schemes.values()))
        q = layer(tensors, prefix, scheme)
    except InexactWeights:
        raise
    except ValueError as e:
        raise ValueError(f"{e}; {FIX}") from e
    n_out, n_in = q.q.shape
    if n_in % GROUP or n_out % 8:
        raise ValueError(f"{prefix}: weight [{n_out}, {n_in}] is not whole {GROUP}-column groups / 8-row words")
    rep = q.group_size // GROUP
    return scheme.bits, q.q, np.repeat(q.scale, rep, axis=1), np.repeat(q.zero, rep, axis=1)


def pack_int8(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q uint8 [N, K] as stored (signed + 128), s fp32 [N, K/64], z uint8 [N, K/64] -> the q8w_gemm layout: w int8
    = q - 128, s, z int16 = z - 128 (w - z = q - z exactly)."""
    return (np.ascontiguousarray((q.astype(np.int16) - 128).astype(np.int8)), np.ascontiguousarray(s, np.float32),
            np.ascontiguousarray(z.astype(np.int16) - 128))


def _dense_weights(checkpoint_dir: Path, dequantize: bool) -> dict[str, np.ndarray]:
    """fp32 state dict as numpy: the checkpoint's tensors, or its exactly dequantized weights."""
    if dequantize:
        return {k: v.detach().float().contiguous().numpy() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in load_tensors(checkpoint_dir).items()}


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Write the native engine: packed int4 (or fp32) layers, fp32 tables, int8 head, engine.json."""
    from safetensors.numpy import save_file

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    prof = validate_profile(BACKEND, profile)
    config = read_config(checkpoint_dir)
    arch = _arch(config, checkpoint_dir)
    lib_path, kernel = compile_kernels()  # fail early on a machine that cannot run the engine

    dequantized: str | None = None
    try:
        schemes = detect_schemes(checkpoint_dir)
    except InexactWeights as e:
        if prof.inexact_weights == "error":
            raise ValueError(f"{checkpoint_dir}: {e}; cpu_native runs 4- and 8-bit weights in 64-column groups exactly; "
                             f"{FIX}, or profile inexact_weights: dequantize") from e
        schemes, dequantized = None, str(e)

    out: dict[str, np.ndarray] = {}
    bits_used: set[int] = set()
    if schemes is not None:
        tensors = load_tensors(checkpoint_dir)
        if any(k.startswith("lm_head.weight_") for k in tensors):
            raise ValueError(f"{checkpoint_dir}: the lm_head is quantized; cpu_native runs an fp32 lm_head only; {FIX}")
        try:
            for i in range(arch.num_hidden_layers):
                parts = {n: _quantized_linear(tensors, f"model.layers.{i}.{n}", schemes) for n in _LINEARS}
                for fused, names in _FUSED:
                    bits = {parts[n][0] for n in names}
                    if len(bits) != 1:
                        raise InexactWeights(f"layer {i}: {', '.join(names)} mix {sorted(bits)}-bit weights; cpu_native "
                                             "runs them as one fused matrix of one width")
                    q, sc, z = (np.concatenate([parts[n][j] for n in names]) for j in (1, 2, 3))
                    w, si, zi = (pack_int4 if bits == {4} else pack_int8)(q, sc, z)
                    out[f"layers.{i}.{fused}.w"], out[f"layers.{i}.{fused}.s"], out[f"layers.{i}.{fused}.z"] = w, si, zi
                    bits_used |= bits
        except InexactWeights as e:  # found in the tensors (act-order g_idx, mixed widths in a fused matrix)
            if prof.inexact_weights == "error":
                raise ValueError(f"{checkpoint_dir}: {e}; {FIX}, or profile inexact_weights: dequantize") from e
            schemes, dequantized, out, bits_used = None, str(e), {}, set()
        else:
            dense = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()
                     if not k.rpartition(".")[2].startswith("weight_")}
    if schemes is None:
        dense = _dense_weights(checkpoint_dir, dequantize=dequantized is not None)
        for i in range(arch.num_hidden_layers):
            for fused, names in _FUSED:
                w = np.concatenate([dense[f"model.layers.{i}.{n}.weight"] for n in names])
                if w.shape[0] % 4 or w.shape[1] % 8:
                    raise ValueError(f"layer {i} {fused}: weight {w.shape} needs out % 4 == 0 and in % 8 == 0")
                out[f"layers.{i}.{fused}.w"] = np.ascontiguousarray(w, np.float32)
    for i in range(arch.num_hidden_layers):
        out |= {f"layers.{i}.{k}": v for k, v in _norms_and_biases(dense, arch, i).items()}
    out["norm"] = (dense["model.norm.weight"].astype(np.float32) + np.float32(arch.norm_offset)).astype(np.float32)
    embed = dense["model.embed_tokens.weight"]
    out["embed"] = embed
    head = embed if arch.tie_word_embeddings or "lm_head.weight" not in dense else dense["lm_head.weight"]
    if head is not embed:
        out["head.fp32"] = head
    if head.shape[1] % 8:
        raise ValueError(f"lm_head width {head.shape[1]} must be a multiple of 8")
    out.update(int8_head(head))
    out = {k: np.ascontiguousarray(v) for k, v in out.items()}

    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    save_file(out, str(out_dir / WEIGHTS))
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    return edir.write_meta(out_dir, edir.EngineMeta(
        backend=BACKEND,
        format=f"cpu_native weights v{FORMAT_VERSION}",
        precision="+".join(f"int{b}" for b in sorted(bits_used)) or "fp32",  # what the layers compute with (report column)
        checkpoint_sha256=sha256_tree(checkpoint_dir),
        dequantized=dequantized and {"reason": dequantized, "checkpoint_quantization": config["quantization_config"]},
        files=[WEIGHTS],
        tokenizer_files=copied,
        build_identity=build_identity(),
        format_version=FORMAT_VERSION,
        **kernel,
        numpy=np.__version__,
        required_isa=list(REQUIRED_ISA),
        weights="+".join(f"int{b}" for b in sorted(bits_used)) + "-g64" if bits_used else "fp32",
        # what the int4/int8 and head kernels multiply the weights with (fp32 weights take fp32 activations)
        activations="int16 per 64-group" if bits_used else "fp32",
        quantization=_summary(schemes) if schemes else None,
        lm_head={"exact_argmax": "int8 per-row bound + fp32 rescoring", "score": "fp32",
                 "tied": head is embed, "vocab_size": int(head.shape[0])},
        sampling={"method": "exact: the distribution of the fp32 logits (rejection sampling against the int8 per-row "
                            "upper bounds, each proposal rescored in fp32; top_k among the rescored rows that can hold it; "
                            "top_p membership decided by the bounds and rescored rows); the full fp32 head for logprobs "
                            "and whenever a step would rescore more than max_candidates rows",
                  "rejection_tries": REJECTION_TRIES, "parameters": list(PARAMETERS)},
        architecture=arch.summary(),
        profile=prof.model_dump(),
        checkpoint=str(checkpoint_dir.resolve()),
        device=device_fingerprint(),
    ))


def detect_schemes(checkpoint_dir: Path) -> dict[str, WeightScheme] | None:
    """None for a dense checkpoint; its config groups if the kernels run each exactly (native_schemes).

    InexactWeights for other weight-only schemes; ValueError naming the field for anything no engine builds.
    """
    where = f"{checkpoint_dir}/config.json"
    schemes = weight_schemes(read_config(checkpoint_dir), where, engine="cpu_native")
    return None if schemes is None else native_schemes(schemes, where)


def _summary(schemes: dict[str, WeightScheme]) -> dict[str, Any]:
    """engine.json "quantization": the one scheme's summary, or each config group's for a mixed recipe."""
    if len(set(schemes.values())) == 1:
        return next(iter(schemes.values())).summary()
    return {name: sc.summary() for name, sc in schemes.items()}


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: its format and the kernel source."""
    return f"{BACKEND} format {FORMAT_VERSION}, kernel source {kernel_sha256()[:16]}"


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.check_meta(engine_dir, BACKEND).model_dump(mode="json")
    if meta.get("format_version") != FORMAT_VERSION:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine format_version {meta.get('format_version')!r}, this runtime reads {FORMAT_VERSION} (rebuild the engine)"
        )
    have = kernel_sha256()
    if meta.get("kernel_sha256") != have:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine built for kernel source sha256 {meta.get('kernel_sha256')}, this runtime's "
            f"{SOURCE.name} is {have} (the weight layout may differ; rebuild the engine)"
        )
    flags = _cpu_flags()
    missing = [f for f in meta.get("required_isa", REQUIRED_ISA) if f not in flags]
    if missing:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine needs CPU flags {meta.get('required_isa')}, this CPU "
            f"({device_fingerprint()['cpu_model'] or 'unknown'}) lacks {missing}; {FIX}"
        )
    _compiler()  # the kernels are compiled on this machine (once, cached): no compiler, no engine


@dataclass
class NativeSession:
    """Opaque handle returned by `load`: weights, layer pointer table and the kernels (read-only after load),
    plus the session's `_Scheduler`. Every `generate` call is a request to that one scheduler thread, which
    owns the decoder and its shared KV cache (MAX_ROWS slots, grown when a stream needs more positions);
    `score` builds a decoder and KV cache of its own per call. Concurrent calls of both are safe."""

    lib: Any
    engine_dir: Path
    meta: dict[str, Any]
    arch: Architecture
    tensors: dict[str, np.ndarray]
    layers: np.ndarray  # int64 [n_layers, len(_COLUMNS)]: pointers + kind + window, see layer_t in q4.c (cos/sin: 0)
    family: Any  # _FamilyT: what the family adds to a Llama step (activation, attention scale and softcap)
    threads: int
    team: int | None  # q4.c's team_t* (None: one thread); destroyed when the session is collected
    max_candidates: int
    vocab_size: int
    context_length: int
    stats: dict[str, int] = field(default_factory=lambda: {"head_calls": 0, "candidates": 0, "max_candidates_seen": 0, "full_passes": 0,
                                                         "scheduler_steps": 0, "max_streams_in_step": 0, "prefill_tokens": 0,
                                                         "prefill_ns": 0, "layers_ns": 0, "head_ns": 0, "scheduler_ns": 0,
                                                         "sampled": 0, "sampled_candidates": 0, "sampled_full_passes": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _scheduler: Any = None  # the session's _Scheduler, created by the first generate call
    _rope: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # kind -> (cos, sin) [n, head_dim]

    def rope_tables(self, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """cos/sin [>= n, head_dim] per attention kind, computed up to the longest length asked so far (a decoder keeps
        the arrays it was given, so growing them never moves a table under a running step)."""
        with self._lock:
            if not self._rope or len(next(iter(self._rope.values()))[0]) < n:
                self._rope = {kind: _rope_tables(r.inv_freq(self.arch.head_dim), n) for kind, r in self.arch.rope.items()}
            return self._rope

    def logits(self, raw: np.ndarray) -> np.ndarray:
        """The model's output logits from the head's x . E_r: Gemma 2's final softcap (cap * tanh(l / cap), in fp32 as
        transformers computes it), else unchanged. Monotone, so the exact argmax of the raw logits is the model's."""
        cap = self.arch.final_softcap
        if not cap:
            return raw
        c = np.float32(cap)
        return (np.tanh((np.asarray(raw, np.float32) / c).astype(np.float32)) * c).astype(np.float32)

    def team_stats(self) -> dict[str, int]:
        """The thread team's counters: parallel regions run, waits that ended asleep, wait-policy probes
        (and how many chose spinning), and the policy now in force (1: spin first)."""
        lib, t = self.lib, self.team
        return {"threads": self.threads, "regions": lib.team_regions(t), "sleeps": lib.team_sleeps(t),
                "probes": lib.team_probes(t), "probes_spin": lib.team_probes_spin(t), "spinning": lib.team_spinning(t)}

    @property
    def embed(self) -> np.ndarray:
        return self.tensors["embed"]

    @property
    def head(self) -> np.ndarray:
        return self.tensors.get("head.fp32", self.tensors["embed"])


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _FamilyT(ctypes.Structure):
    """q4.c's family_t."""

    _fields_ = [("act", ctypes.c_int), ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
                ("pad", ctypes.c_float)]


def _rope_tables(inv: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n, head_dim] from the inverse frequencies, as transformers computes them (fp32)."""
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=1)
    return np.ascontiguousarray(np.cos(emb), np.float32), np.ascontiguousarray(np.sin(emb), np.float32)


def load(engine_dir: Path) -> NativeSession:
    """Check compatibility, compile (or reuse) the kernels, and map the weights once."""
    from safetensors.numpy import load_file

    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    lib = _library()
    t = {k: np.ascontiguousarray(v) for k, v in load_file(str(engine_dir / WEIGHTS)).items()}
    arch = Architecture.model_validate(meta["architecture"])
    rows = []
    for i in range(arch.num_hidden_layers):
        # q4.c's layer_t.kind: 2 bits per fused linear, told by how it is stored (uint16 int4 words, int8, fp32)
        kind = sum(_KINDS[t[f"layers.{i}.{f}.w"].dtype] << (2 * j) for j, (f, _) in enumerate(_FUSED))
        row = dict.fromkeys(_COLUMNS, 0) | {"kind": kind, "window": arch.window(i) or 0}
        for col in _COLUMNS:  # linears are stored as "qkv.w", "qkv.s", ...; the rest by their layer_t name
            name = f"layers.{i}." + (col.replace("_", ".") if col[-2:] in ("_w", "_s", "_z") else col)
            if name in t:
                row[col] = _ptr(t[name])  # cos/sin: per decoder (_Decoder); absent optional tensors stay 0
        rows.append([row[k] for k in _COLUMNS])
    threads = threads_from_env()
    team = lib.team_create(threads, spin_us_from_env() * 1000)
    session = NativeSession(
        lib=lib, engine_dir=engine_dir, meta=meta, arch=arch, tensors=t, layers=np.asarray(rows, dtype=np.int64),
        family=_FamilyT(act={"silu": 0, "gelu_tanh": 1}[arch.activation], attn_scale=arch.attn_scale,
                        attn_softcap=arch.attn_softcap or 0.0),
        threads=lib.team_threads(team), team=team, max_candidates=int(meta["profile"]["max_candidates"]),
        vocab_size=int(meta["lm_head"]["vocab_size"]), context_length=arch.context_length,
    )
    if team:
        weakref.finalize(session, lib.team_destroy, team)  # the workers stop and are joined with the session
    return session


def spin_us_from_env() -> int:
    """$EDGEFLOW_ENGINE_SPIN_US (0: workers sleep at once), else SPIN_US_DEFAULT."""
    spin = int_from_env(SPIN_ENV, lo=0, hi=1_000_000,
                        meaning=f"microseconds an idle engine thread spins before it sleeps; default {SPIN_US_DEFAULT}")
    return SPIN_US_DEFAULT if spin is None else spin


class _Decoder:
    """KV cache + scratch for `slots` streams of at most `max_len` positions (one per call: thread-safe)."""

    def __init__(self, session: NativeSession, slots: int, max_len: int):
        a = session.arch
        if max_len > session.context_length:
            raise ValueError(f"{max_len} tokens exceed the engine's context length {session.context_length}")
        self.s, self.a = session, a
        self.slots, self.max_len = slots, max_len
        shape = (a.num_hidden_layers, slots, a.num_key_value_heads, max_len, a.head_dim)
        self.kc = np.empty(shape, np.float32)
        self.vc = np.empty(shape, np.float32)
        n = session.lib.llama_scratch_floats(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                             a.head_dim, a.intermediate_size, max_len, session.threads)
        self.scratch = np.empty(n, np.float32)
        self.head = _HeadBuffers(session, slots)
        # this decoder's layer table: the session's, with each layer's RoPE table (held here, so it outlives the decoder)
        self.rope = session.rope_tables(max_len)
        self.layers = session.layers.copy()
        cos, sin = _COLUMNS.index("cos"), _COLUMNS.index("sin")
        for i, kind in enumerate(a.layer_types):
            self.layers[i, cos], self.layers[i, sin] = _ptr(self.rope[kind][0]), _ptr(self.rope[kind][1])
        self.embed_scale = np.float32(a.embed_scale)

    def step(self, ids: Sequence[int], pos: Sequence[int], slots: Sequence[int]) -> np.ndarray:
        """One decoder pass over <= STEP_ROWS rows; returns the final-normed hidden states [M, hidden]."""
        s, a = self.s, self.a
        m = len(ids)
        h = np.ascontiguousarray(s.embed[np.asarray(ids, dtype=np.int64)], np.float32)
        if self.embed_scale != 1:
            h *= self.embed_scale  # Gemma: embeddings times sqrt(hidden), in fp32 as transformers does
        out = np.empty_like(h)
        p = np.asarray(pos, dtype=np.int32)
        sl = np.asarray(slots, dtype=np.int32)
        s.lib.llama_step(m, _ptr(p), _ptr(sl), _ptr(h), _ptr(self.layers), a.num_hidden_layers,
                         a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         a.intermediate_size, a.rms_norm_eps, ctypes.addressof(s.family), _ptr(self.kc), _ptr(self.vc),
                         self.slots, self.max_len, _ptr(s.tensors["norm"]), _ptr(out), _ptr(self.scratch), s.team)
        return out

    def prefill(self, ids: Sequence[int], slot: int) -> np.ndarray:
        """Run a prompt from position 0; returns the hidden states of every position."""
        return self.prefill_many([(ids, slot)])[0]

    def prefill_many(self, prompts: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Run several prompts (ids, slot) from position 0 together, STEP_ROWS rows per step (each slot's
        rows stay consecutive and in order); returns each prompt's hidden states [len(ids), hidden]."""
        rows = [(t, p, slot, n) for n, (ids, slot) in enumerate(prompts) for p, t in enumerate(ids)]
        hs = []
        for i in range(0, len(rows), STEP_ROWS):
            chunk = rows[i:i + STEP_ROWS]
            hs.append(self.step([r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk]))
        h = np.concatenate(hs)
        owner = np.asarray([r[3] for r in rows])
        return [h[owner == n] for n in range(len(prompts))]


class _HeadBuffers:
    """Scratch for head_argmax and head_sample, kept by a decoder so a step does not map (and page-fault) fresh
    vocabulary-sized arrays for every row: 0.24 ms of head_sample's 0.9 ms on the demo student before it had its own
    (BENCHMARKS.md). The arrays a sampled step hands to Sampler are views of these, valid until the next step."""

    def __init__(self, session: NativeSession, rows: int):
        vp, v = session.tensors["head.q8_scale"].shape[0], session.vocab_size
        self.rows = rows
        self.logits = np.zeros((rows, vp), np.float32)
        self.cand = np.zeros((rows, v), np.int32)
        self.tok = np.zeros(rows, np.int32)
        self.nc = np.zeros(rows, np.int32)
        # head_sample: the bounds, then the universe (ids, envelope weights, their running sum; q4.c head_envelope)
        self.lower, self.upper = np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.ids = np.zeros(v, np.int32)
        self.weight, self.cum = np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.envelope = np.zeros(2, np.float64)
        # sample_bounded: exact logits by universe row, the nucleus test's gaps and their selection, its counters
        self.pen, self.gap, self.sel = np.zeros(v, np.float64), np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.sample_stats = np.zeros(2, np.int64)


def head_argmax(session: NativeSession, x: np.ndarray, max_candidates: int | None = None,
                buffers: _HeadBuffers | None = None) -> tuple[list[int], list[int], list[list[int]]]:
    """Exact argmax_r x[m] . E_r for each row of x [M, hidden].

    Returns (tokens, ncand, candidates): ncand[m] >= 0 is how many rows were rescored (their ids in
    candidates[m]); a negative ncand[m] = -(count) - 1 means the full fp32 pass ran for that row.
    """
    x = np.ascontiguousarray(x, np.float32)
    m, k = x.shape
    t = session.tensors
    v = session.vocab_size
    vp = t["head.q8_scale"].shape[0]
    cap = session.max_candidates if max_candidates is None else int(max_candidates)
    if buffers is None or buffers.rows < m:
        buffers = _HeadBuffers(session, m)
    scratch, cand, tok, nc = buffers.logits, buffers.cand, buffers.tok, buffers.nc
    session.lib.head_argmax(_ptr(x), m, k, v, vp, _ptr(t["head.q8"]), _ptr(t["head.q8_scale"]), _ptr(t["head.dn"]),
                            _ptr(t["head.en"]), _ptr(session.head), _ptr(scratch), _ptr(cand), cap, _ptr(tok), _ptr(nc),
                            session.team)
    ncand = nc[:m].tolist()
    with session._lock:
        st = session.stats
        st["head_calls"] += m
        st["candidates"] += sum(n if n >= 0 else -n - 1 for n in ncand)
        st["max_candidates_seen"] = max([st["max_candidates_seen"]] + [n if n >= 0 else -n - 1 for n in ncand])
        st["full_passes"] += sum(n < 0 for n in ncand)
    return tok[:m].tolist(), ncand, [cand[i, :n].tolist() if n >= 0 else [] for i, n in enumerate(ncand)]


def head_rows(session: NativeSession, x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """x . E_r in fp32 for the head rows `ids` (every row when None), from one activation row x [1, hidden]: q4.c's
    head_rows, the sum head_argmax rescores with (and on the engine's own threads, not numpy's BLAS pool)."""
    head = session.head
    if ids is None:
        out = np.empty(session.vocab_size, np.float32)
        session.lib.head_rows(_ptr(x), x.shape[1], _ptr(head), None, len(out), _ptr(out), session.team)
        return out
    rows = np.ascontiguousarray(ids, np.int32)
    out = np.empty(len(rows), np.float32)
    session.lib.head_rows(_ptr(x), x.shape[1], _ptr(head), _ptr(rows), len(rows), _ptr(out), session.team)
    return out


def head_universe(session: NativeSession, buffers: _HeadBuffers, up: np.ndarray, t: float, weights: bool) -> Universe:
    """sampling.numpy_universe by q4.c's head_envelope, into `buffers`: the same tokens, zmax and cut, with weights that
    exceed exp(up / t - zmax) by at most 2^-16 (a bound is what the rejection step needs; the draw stays exact)."""
    up = np.ascontiguousarray(up, np.float64)
    b = buffers
    n = session.lib.head_envelope(_ptr(up), len(up), float(t), TAIL_LOG, _ptr(b.ids), _ptr(b.weight) if weights else None,
                                  _ptr(b.cum) if weights else None, _ptr(b.envelope))
    zmax, cut = float(b.envelope[0]), float(b.envelope[1])
    return Universe(b.ids[:n], b.weight[:n] if weights else None, b.cum[:n] if weights else None, zmax, cut)


# Uniforms a sampled step takes from the request's generator for q4.c's sample_bounded: what REJECTION_TRIES rounds can
# use at most (a proposal's draw and its redraw test, REDRAWS + 1 times, and the acceptance test), 10 us of numpy's.
SAMPLE_UNIFORMS = REJECTION_TRIES * (2 * (REDRAWS + 1) + 1)


def _sample_in_c(session: NativeSession, b: _HeadBuffers, x: np.ndarray, sampler: Sampler) -> Token | None:
    """Sampler.draw_bounded by q4.c's sample_bounded from the (penalised) bounds in `b`: one C call instead of a Python
    call per proposal, per nucleus round and per top_k step. None: the step goes to the whole head."""
    p = sampler.params
    u = sampler.uniforms(SAMPLE_UNIFORMS)
    tids, trep, tsub = sampler.penalty_table()
    b.sample_stats[:] = 0
    token = session.lib.sample_bounded(
        _ptr(x), x.shape[1], _ptr(session.head), _ptr(b.lower), _ptr(b.upper), session.vocab_size, p.temperature,
        p.top_p, p.top_k, _ptr(tids), _ptr(trep), _ptr(tsub), len(tids), p.repetition_penalty, TAIL_LOG, REJECTION_TRIES,
        REDRAWS, NUCLEUS_ROWS, session.max_candidates, _ptr(u), len(u), _ptr(b.ids), _ptr(b.weight), _ptr(b.cum),
        _ptr(b.pen), _ptr(b.gap), _ptr(b.sel), _ptr(b.sample_stats))
    sampler.rescored += int(b.sample_stats[0])
    sampler.head_reads += int(b.sample_stats[1])
    return sampler.emit(token) if token >= 0 else None


def head_sample(session: NativeSession, x: np.ndarray, sampler: Sampler, buffers: _HeadBuffers | None = None) -> Token:
    """The next token of one stream whose request samples (or penalises, or asks for logprobs).

    The int8 head gives a_r and, as in head_argmax, a bound e_r with |x . E_r - a_r| <= e_r, so every logit lies in
    [a_r - e_r, a_r + e_r] (q4.c's head_bounds, one pass). `Sampler.draw_bounded` draws from those bounds and the fp32
    logits of the rows it asks for (head_rows), exactly from the distribution the full head gives (rejection sampling,
    see there); q4.c's sample_bounded runs the same draw in one call (the Python one remains for Gemma 2's softcap).
    When that would take more than `max_candidates` rows, and for logprobs (which need the normaliser), the full fp32
    head runs instead.
    """
    x = np.ascontiguousarray(x, np.float32).reshape(1, -1)
    k = x.shape[1]
    t = session.tensors
    v = session.vocab_size
    vp = t["head.q8_scale"].shape[0]
    token = None
    before, reads = sampler.rescored, sampler.head_reads
    if not sampler.params.logprobs:
        b = buffers if buffers is not None else _HeadBuffers(session, 1)
        a, lower, upper = b.logits[0], b.lower, b.upper
        session.lib.head_bounds(_ptr(x), k, v, vp, _ptr(t["head.q8"]), _ptr(t["head.q8_scale"]), _ptr(t["head.dn"]),
                                _ptr(t["head.en"]), _ptr(a), _ptr(lower), _ptr(upper), session.team)
        if not session.arch.final_softcap:
            sampler.penalised_bounds(lower, upper, in_place=True)
            token = _sample_in_c(session, b, x, sampler)
        else:  # monotone: the capped bounds bound the capped logits
            cap = session.arch.final_softcap
            lower, upper = cap * np.tanh(lower / cap), cap * np.tanh(upper / cap)
            token = sampler.draw_bounded(lower, upper, lambda ids: session.logits(head_rows(session, x, ids)),
                                         session.max_candidates, partial(head_universe, session, b), scratch=True)
    full = token is None
    if full:
        token = sampler.choose(np.arange(v), session.logits(head_rows(session, x)))
    with session._lock:
        st = session.stats
        st["sampled"] += 1
        st["sampled_candidates"] += v if full else sampler.rescored - before
        st["sampled_full_passes"] += int(full) + sampler.head_reads - reads
    return token


def _check_ids(session: NativeSession, input_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in input_ids]
    if not ids:
        raise ValueError("input_ids is empty")
    if min(ids) < 0 or max(ids) >= session.embed.shape[0]:
        raise ValueError(f"token id out of range [0, {session.embed.shape[0]})")
    return ids


class _Request:
    """One stream in the scheduler: its prompt, limits, slot and the queue its tokens go to."""

    __slots__ = ("ids", "max_new", "stops", "out", "cancelled", "slot", "produced", "h", "sampler")

    def __init__(self, ids: list[int], max_new: int, stops: set[int], sampling: SamplingParams = GREEDY):
        self.ids, self.max_new, self.stops = ids, max_new, stops
        # None: plain greedy, the exact-argmax head (batched over every greedy stream of the step)
        self.sampler = None if sampling.plain_greedy else Sampler(sampling, ids)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False  # set by the consumer (client went away); the scheduler drops the stream
        self.slot = -1
        self.produced: list[int] = []
        self.h: np.ndarray | None = None  # final-normed hidden state of the last position, [1, hidden]


_DONE = object()


class _Scheduler:
    """In-flight batching for one session: a single thread owns one decoder with MAX_ROWS slots, and
    every step carries one row per live stream, so N concurrent `generate` calls unpack the weights
    once per token instead of N times and never compete for cores (a thread per stream, each with
    all cores, would oversubscribe them). Streams that arrive are prefilled (together, STEP_ROWS rows per step)
    and join at the next step; one that ends frees its slot for the next in line (FIFO)."""

    def __init__(self, session: NativeSession):
        self.s = session
        self.cv = threading.Condition()
        self.pending: deque[_Request] = deque()
        self.thread: threading.Thread | None = None
        self.dec: _Decoder | None = None

    def submit(self, req: _Request) -> None:
        with self.cv:
            self.pending.append(req)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="cpu-native-scheduler", daemon=True)
                self.thread.start()
            self.cv.notify()

    def _capacity(self, live: dict[int, _Request], admit: list[_Request]) -> None:
        """(Re)allocate the KV cache when a stream needs more positions than it holds; copy what is live."""
        need = max(len(r.ids) + r.max_new for r in [*live.values(), *admit])
        if self.dec is not None and self.dec.max_len >= need:
            return
        grown = _Decoder(self.s, MAX_ROWS, max(need, 2 * self.dec.max_len if self.dec else need))
        if self.dec is not None and live:
            n = self.dec.max_len
            grown.kc[:, :, :, :n] = self.dec.kc
            grown.vc[:, :, :, :n] = self.dec.vc
        self.dec = grown

    def _run(self) -> None:
        live: dict[int, _Request] = {}
        while True:
            with self.cv:
                while not self.pending and not live:
                    self.dec = None  # idle: give the KV cache back
                    if not self.cv.wait(timeout=IDLE_EXIT_S) and not self.pending:
                        # Idle for a while: end the thread, so it does not keep the session (and its weights)
                        # alive after the caller dropped it; the next submit starts a new one.
                        self.thread = None
                        return
                admit = []
                while self.pending and len(live) + len(admit) < MAX_ROWS:
                    admit.append(self.pending.popleft())
            loop_start = time.perf_counter_ns()  # idle waiting above is not the engine's time
            try:
                for slot in [k for k, r in live.items() if r.cancelled]:
                    del live[slot]
                admit = [r for r in admit if not r.cancelled]
                if admit:
                    self._capacity(live, admit)
                t0 = time.perf_counter_ns()
                for req in admit:
                    req.slot = min(set(range(MAX_ROWS)) - set(live))
                    live[req.slot] = req
                if admit:  # prompts that arrived together share their prefill steps
                    for req, h in zip(admit, self.dec.prefill_many([(r.ids, r.slot) for r in admit])):
                        req.h = h[-1:]
                if not live:
                    continue
                rows = list(live.values())
                streams = len(rows)
                t1 = time.perf_counter_ns()
                tokens = self._next_tokens(rows)
                t2 = time.perf_counter_ns()
                for req, token in zip(rows, tokens):
                    if token in req.stops:
                        self._finish(live, req)
                        continue
                    req.produced.append(token)
                    req.out.put(token)
                    if len(req.produced) == req.max_new:
                        self._finish(live, req)
                rows = [r for r in rows if r.slot in live and not r.cancelled]
                t3 = t4 = time.perf_counter_ns()
                if rows:
                    h = self.dec.step([r.produced[-1] for r in rows], [len(r.ids) + len(r.produced) - 1 for r in rows],
                                      [r.slot for r in rows])
                    t4 = time.perf_counter_ns()
                    for i, req in enumerate(rows):
                        req.h = h[i:i + 1]
                self._account(streams, sum(len(r.ids) for r in admit), t1 - t0, t2 - t1, t4 - t3, loop_start)
            except BaseException as e:  # noqa: BLE001 - every live stream gets the error; the thread goes on
                for req in [*live.values(), *[r for r in admit if r.slot not in live]]:
                    req.out.put(e)
                live.clear()
                self.dec = None

    def _next_tokens(self, rows: list[_Request]) -> list[int]:
        """One token per live stream: the greedy ones through one batched head_argmax, the others sampled."""
        hs = np.concatenate([r.h for r in rows])
        tokens: list[int] = [0] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.sampler is None]
        if greedy:
            picked = head_argmax(self.s, hs[greedy] if len(greedy) < len(rows) else hs, buffers=self.dec.head)[0]
            for i, tok in zip(greedy, picked):
                tokens[i] = tok
        for i, r in enumerate(rows):
            if r.sampler is not None:
                tokens[i] = head_sample(self.s, hs[i:i + 1], r.sampler, self.dec.head)
        return tokens

    def _account(self, streams: int, prefill_tokens: int, prefill_ns: int, head_ns: int, layers_ns: int, loop_start: int) -> None:
        """The engine's own profile (session.stats): where each scheduler step's time went."""
        st = self.s.stats
        with self.s._lock:
            st["scheduler_steps"] += 1
            st["max_streams_in_step"] = max(st["max_streams_in_step"], streams)
            st["prefill_tokens"] += prefill_tokens
            st["prefill_ns"] += prefill_ns
            st["head_ns"] += head_ns
            st["layers_ns"] += layers_ns
            st["scheduler_ns"] += time.perf_counter_ns() - loop_start - prefill_ns - head_ns - layers_ns

    @staticmethod
    def _finish(live: dict[int, _Request], req: _Request) -> None:
        """The stream is complete: free its slot and tell its consumer."""
        live.pop(req.slot, None)
        req.out.put(_DONE)


def _scheduler(session: NativeSession) -> _Scheduler:
    with session._lock:
        if session._scheduler is None:
            session._scheduler = _Scheduler(session)
        return session._scheduler


def _submit(session: NativeSession, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int],
            sampling: SamplingParams = GREEDY) -> _Request:
    ids = _check_ids(session, input_ids)
    if len(ids) + max_new_tokens > session.context_length:
        raise ValueError(
            f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceed the engine's context length "
            f"{session.context_length}; shorten the prompt or lower max_tokens"
        )
    req = _Request(ids, max_new_tokens, {int(t) for t in stop_token_ids}, sampling or GREEDY)
    if req.sampler is None and session.arch.final_softcap:
        # Softcapped logits can tie where the raw ones do not (tanh saturates in fp32); transformers takes the lowest id
        # among tied ones, so greedy goes through head_sample's capped bounds and Sampler.choose's first maximum.
        req.sampler = Sampler(GREEDY, ids)
    _scheduler(session).submit(req)
    return req


def _tokens(req: _Request) -> Iterator[int]:
    try:
        while True:
            item = req.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        req.cancelled = True


def generate(
    session: NativeSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode; yields each new token id, never a stop id. Without `sampling` (or with plain greedy params)
    the exact fp32 argmax; otherwise `head_sample`'s draw, as `Token`s carrying logprobs when asked.
    Concurrent calls are decoded together by the session's scheduler (one batched step per token for up
    to 4 streams)."""
    if max_new_tokens <= 0:
        _check_ids(session, input_ids)
        return
    yield from _tokens(_submit(session, input_ids, max_new_tokens, stop_token_ids, sampling or GREEDY))


def generate_batch(
    session: NativeSession, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> list[list[int]]:
    """Several prompts submitted together (the scheduler batches up to 4 at a time); the same tokens as
    separate `generate` calls with the same parameters."""
    if max_new_tokens <= 0:
        return [[] for _ in (_check_ids(session, p) for p in prompts)]
    reqs = [_submit(session, p, max_new_tokens, stop_token_ids, sampling or GREEDY) for p in prompts]
    return [list(_tokens(r)) for r in reqs]


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw runs on exact fp32 logits of the candidates (head_sample)."""
    return frozenset(PARAMETERS)


def score(session: NativeSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab], full fp32 head."""
    ids = _check_ids(session, input_ids)
    hidden = _Decoder(session, 1, len(ids)).prefill(ids, 0)
    return np.ascontiguousarray(session.logits(hidden @ session.head.T), dtype=np.float32)
