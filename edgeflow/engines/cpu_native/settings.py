"""The cpu_native backend's settings: its name and format version, the kernels' compiler flags and ISA, the
engine.profile model, and the layout constants the build and the runtime share.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


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


# (64 against 16: 11-16 % faster prefill of 128-1,024 tokens, BENCHMARKS.md#prefill-by-length;
# 64-row steps"; a prompt's whole prefill runs between two decode steps whatever the chunk, so live streams wait no
# longer)
IDLE_EXIT_S = 2.0  # an idle scheduler thread ends after this long (restarted by the next generate)


FIX = "use engine.backend: cpu (onnxruntime) for this checkpoint or machine"


SPIN_ENV = "EDGEFLOW_ENGINE_SPIN_US"


# How long an idle team worker spins (yielding its core to anything runnable every ~64 pauses) before it
# sleeps. Measured on the 2-core Intel VM, 30-layer int4 model, 1 stream (BENCHMARKS.md#thread-team):
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


# Per layer, what layer_t (q4.c) holds past the four fused linears: where each optional tensor comes from in the
# checkpoint (norms get the family's offset folded in once, here).
_COLUMNS = ("ln1", "qkv_w", "qkv_s", "qkv_z", "o_w", "o_s", "o_z", "ln2", "gu_w", "gu_s", "gu_z", "dn_w", "dn_s", "dn_z",
            "kind", "window", "qkv_b", "o_b", "q_norm", "k_norm", "post_attn", "post_ffn", "cos", "sin")
