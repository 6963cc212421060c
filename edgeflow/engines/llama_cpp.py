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
"""
from __future__ import annotations

import atexit
import json
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.model.architecture import Architecture, Rope, require
from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import EngineIncompatibleError, engine_dir as edir, validate_profile
from edgeflow.engines.checkpoint import (
    QUANT_LEAVES,
    InexactWeights,
    QuantizedLayer,
    WeightScheme,
    copy_tokenizer_files,
    layer,
    layer_scheme,
    load_dequantized,
    load_tensors,
    read_config,
    split_tensors,
    weight_schemes,
)
from edgeflow.engines.cpu_host import device_fingerprint, threads_from_env
from edgeflow.engines.hooks import device_memory_used, device_utilization  # noqa: F401  (backend API: CPU defaults)
from edgeflow.engines.sampling import PARAMETERS, Sampler, SamplingParams

BACKEND = "llama_cpp"
# The writer's own version: bump it when what `build` writes changes (part of build_identity, the cache key).
WRITER = "edgeflow gguf writer 2"  # 2: per-family GGUF architectures
FORMAT = "gguf v3 (llama.cpp)"
GGUF_FILE = "model.gguf"
BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block


class Profile(BaseModel):
    """`engine.profile` of the llama_cpp backend (validated when the edgeflow profile loads)."""

    model_config = ConfigDict(extra="forbid")

    head: Literal["f32", "f16", "q8_0"] = Field(
        default="f32", description="Type of the token embedding table, which is also the lm_head when tied "
        "(llm-compressor leaves it dense): f32 (exact), f16, or q8_0 (re-quantized in blocks of 32 by the gguf "
        "package; llama.cpp's own Q4_0 files use q8_0 here). At 135M parameters the 49152x576 head is ~45% of the "
        "weights read per token.")
    dense: Literal["f32", "f16"] = Field(
        default="f32", description="Type of dense decoder linears: the FP reference row's, and a quantized checkpoint's "
        "built from its dequantized weights. f32 keeps them exact.")
    inexact_weights: Literal["dequantize", "error"] = Field(
        default="dequantize", description="Quantized weights no Q4_0/Q4_1/Q8_0 block holds (asymmetric int8, a group "
        "size that is not a multiple of 32, act-order groups): 'dequantize' builds them dense from their exact "
        "dequantized values (engine.json records it under 'dequantized'); 'error' refuses them.")
    n_ctx: int = Field(
        default=2048, ge=64, le=131072, description="Context (KV cache positions) of each llama.cpp context; a request "
        "whose prompt plus max_tokens exceed it gets a ValueError naming both. Capped at the model's context length.")
    n_batch: int = Field(
        default=512, ge=8, le=8192, description="Tokens per llama.cpp decode call during prefill and scoring "
        "(llama.cpp's default).")
    contexts: int = Field(
        default=2, ge=1, le=64, description="llama.cpp contexts kept per loaded engine, one per concurrent generation "
        "(each holds its own KV cache of n_ctx positions; the weights are shared). Set it to the server's slots.")


DEFAULT_PROFILE: dict[str, Any] = Profile().model_dump()

# What each family is written as: transformers model_type -> the llama.cpp GGUF architecture whose graph computes it
# (llama.cpp's own converter makes the same choices: Mistral is its Llama class). Tensor names come from the gguf
# package's per-architecture table (llama.cpp's tensor-name map), not from a table here.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3"}
# RoPE kinds each GGUF architecture's graph applies, per attention kind: `llama` reads per-dimension factors
# (rope_freqs, which express llama3 scaling) and a linear scale; qwen2/qwen3 a linear scale; gemma3 a linear scale on
# its global layers and its own base on the sliding ones; gemma2 one default table.
GGUF_ROPES = {"llama": {"default", "linear", "llama3"}, "qwen2": {"default", "linear"}, "qwen3": {"default", "linear"},
              "gemma2": {"default"}, "gemma3": {"default", "linear"}}
# GGUF architectures whose llama.cpp graph takes q/k in interleaved pairs (LLAMA_ROPE_TYPE_NORM): rows are permuted
# from Hugging Face's rotate-half order at build. The others are NEOX (rotate-half), as in Hugging Face.
INTERLEAVED_ROPE = {"llama"}


def gguf_arch(config: dict[str, Any]) -> str:
    """The GGUF architecture `config`'s family is written as (KeyError for a family this backend does not write)."""
    return GGUF_ARCH[config["model_type"]]


@lru_cache(maxsize=16)
def _name_map(arch: str, n_blocks: int) -> Any:
    import gguf

    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(kind, n_blocks)


def _gguf_name(hf: str, arch: str = "llama", n_blocks: int = 64) -> str:
    """The GGUF tensor name of a Hugging Face tensor in `arch` (ValueError naming it if llama.cpp's `arch` has none)."""
    name = _name_map(arch, n_blocks).get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"tensor {hf!r} has no place in a llama.cpp {arch!r} GGUF")
    return name


def llama_cpp_attn_scale(arch: Architecture, gguf: str) -> float:
    """The query scale llama.cpp's `gguf` graph applies: 1/sqrt(head_dim), except Gemma 2/3 at the 27B layer counts
    (46 / 62), where Google's reference uses 1/sqrt(hidden / heads) (llama.cpp src/models/gemma2.cpp, gemma3.cpp)."""
    if (gguf, arch.num_hidden_layers) in (("gemma2", 46), ("gemma3", 62)):
        return float(arch.hidden_size // arch.num_attention_heads) ** -0.5
    return float(arch.head_dim) ** -0.5


# --------------------------------------------------------------------------------------------
# What this backend holds exactly
# --------------------------------------------------------------------------------------------


def _block_type(s: WeightScheme, where: str) -> str:
    """'Q4_0' / 'Q4_1' / 'Q8_0' for a scheme llama.cpp blocks hold exactly (up to fp16 scales); InexactWeights else."""
    if s.format != "pack-quantized" or s.type != "int":
        raise InexactWeights(f"{where}: format={s.format!r} type={s.type!r}; only 'pack-quantized' int weights map to "
                             "llama.cpp blocks")
    if s.strategy not in ("group", "channel"):
        raise InexactWeights(f"{where}.weights.strategy={s.strategy!r}: only 'group' or 'channel' scales are blocks")
    if s.strategy == "group" and (s.group_size or 0) % BLOCK:
        raise InexactWeights(f"{where}.weights.group_size={s.group_size}: llama.cpp blocks hold {BLOCK} weights, so "
                             f"a group must be a multiple of {BLOCK}")
    if s.actorder not in (None, "static", "weight"):
        raise InexactWeights(f"{where}.weights.actorder={s.actorder!r}: permuted (act-order) groups are not contiguous "
                             "blocks (use actorder weight or none)")
    if s.bits == 4:
        return "Q4_0" if s.symmetric else "Q4_1"
    if s.bits == 8 and s.symmetric:
        return "Q8_0"
    raise InexactWeights(f"{where}.weights: num_bits={s.bits} symmetric={s.symmetric}; llama.cpp blocks hold int4 "
                         "(either) or symmetric int8")


def detect_schemes(checkpoint_dir: Path) -> dict[str, WeightScheme] | None:
    """None for a dense checkpoint; its config groups if every one maps to a llama.cpp block type.

    InexactWeights for weight-only schemes no block holds; ValueError naming the field for anything no engine
    builds (edgeflow.engines.checkpoint.weight_schemes).
    """
    where = f"{checkpoint_dir}/config.json"
    schemes = weight_schemes(read_config(checkpoint_dir), where, engine=BACKEND)
    if schemes is None:
        return None
    for name, s in schemes.items():
        _block_type(s, f"{where} quantization_config.config_groups.{name}")
    return schemes


# --------------------------------------------------------------------------------------------
# Blocks (the layouts of llama.cpp's ggml-common.h: block_q4_0, block_q4_1, block_q8_0)
# --------------------------------------------------------------------------------------------


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """[rows, blocks] float -> [rows, blocks, 2] little-endian fp16 bytes."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def encode_blocks(q: QuantizedLayer, bits: int, symmetric: bool) -> tuple[str, np.ndarray, dict[str, float]]:
    """(block type, uint8 [rows, bytes per row], rounding) for one layer's stored integers.

    Per block of 32 weights: Q4_0 = fp16 d, then 16 bytes whose low nibbles are weights 0-15 and high nibbles
    16-31, w = d*(nibble - 8); Q4_1 = fp16 d, fp16 m, the same 16 bytes, w = d*nibble + m; Q8_0 = fp16 d, 32
    int8, w = d*int8. compressed-tensors stores q unsigned (signed + 2**(bits-1)), so a symmetric int4 q is the
    Q4_0 nibble as it is. `rounding` is the largest relative change of a scale (and, for Q4_1, of m relative to
    its block's scale) from fp32 to fp16, and the bound it puts on any weight's change.
    """
    rows, cols = q.q.shape
    if cols % BLOCK:
        raise InexactWeights(f"a layer of {cols} input columns is not a whole number of {BLOCK}-weight blocks")
    nb = cols // BLOCK
    per = q.group_size // BLOCK if q.group_size % BLOCK == 0 else 0
    if not per:
        raise InexactWeights(f"group size {q.group_size} is not a multiple of {BLOCK}")
    s = np.repeat(q.scale.astype(np.float32), per, axis=1)  # [rows, nb]
    d16 = s.astype(np.float16)
    if not np.isfinite(d16).all():
        raise ValueError(f"a weight scale of {float(np.abs(s).max()):.6g} exceeds fp16's range (65504); llama.cpp "
                         "blocks store scales in fp16")
    nz = s != 0
    rel_d = float(np.max(np.abs(d16.astype(np.float32) - s)[nz] / np.abs(s[nz]), initial=0.0))
    vals = q.q.reshape(rows, nb, BLOCK)
    if bits == 8:
        qs = (vals.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([_fp16_bytes(d16), qs], axis=2)
        bound = float(np.max(np.abs(d16.astype(np.float32) - s) * 128, initial=0.0))
        return "Q8_0", blocks.reshape(rows, -1), {"scale_rel": rel_d, "weight_abs": bound, "m_rel": 0.0}
    nibbles = (vals[:, :, : BLOCK // 2] | (vals[:, :, BLOCK // 2:] << 4)).astype(np.uint8)
    dscale = np.abs(d16.astype(np.float32) - s)
    if symmetric:
        z = np.repeat(q.zero, per, axis=1)
        if not (z == 8).all():
            raise ValueError("a symmetric int4 layer has zero points other than 8; its checkpoint is inconsistent")
        blocks = np.concatenate([_fp16_bytes(d16), nibbles], axis=2)
        return "Q4_0", blocks.reshape(rows, -1), {"scale_rel": rel_d, "weight_abs": float(np.max(dscale * 8, initial=0.0)),
                                                  "m_rel": 0.0}
    m = -s * np.repeat(q.zero, per, axis=1).astype(np.float32)
    m16 = m.astype(np.float16)
    if not np.isfinite(m16).all():
        raise ValueError("scale*zero of a layer exceeds fp16's range (65504); llama.cpp Q4_1 stores it in fp16")
    dm = np.abs(m16.astype(np.float32) - m)
    rel_m = float(np.max(dm[nz] / np.abs(s[nz]), initial=0.0))
    blocks = np.concatenate([_fp16_bytes(d16), _fp16_bytes(m16), nibbles], axis=2)
    return "Q4_1", blocks.reshape(rows, -1), {"scale_rel": rel_d, "weight_abs": float(np.max(dscale * 15 + dm, initial=0.0)),
                                              "m_rel": rel_m}


def permute_rope_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of q_proj/k_proj (or their per-row integers, zeros and scales) from Hugging Face's rotate-half order to
    llama.cpp's interleaved pairs: the permutation llama.cpp's convert_hf_to_gguf.py applies (rows only, so whole
    input-dim groups move together)."""
    rows = a.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return np.ascontiguousarray(a.reshape(n_head, 2, rows // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))


def _rope_heads(name: str, config: dict[str, Any]) -> int | None:
    """Heads whose rows `name` permutes into llama.cpp's interleaved pairs (q_proj, k_proj of an INTERLEAVED_ROPE
    architecture), else None."""
    if GGUF_ARCH.get(config.get("model_type")) not in INTERLEAVED_ROPE:
        return None
    if name.endswith("self_attn.q_proj"):
        return int(config["num_attention_heads"])
    if name.endswith("self_attn.k_proj"):
        return int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return None


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _check_architecture(config: dict[str, Any], where: str) -> Architecture:
    """The model's Architecture, or a ValueError naming the field, its value and the backends that run it, for what
    the GGUF written here cannot express (edgeflow/model/architecture.py's matrix, then what each GGUF architecture's llama.cpp
    graph computes: its RoPE kinds, a sliding window only where the graph has one, q/k/v biases only)."""
    arch = require(config, BACKEND, where)
    g = GGUF_ARCH[arch.model_type]
    for kind, r in arch.rope.items():
        if r.type not in GGUF_ROPES[g] or (g == "gemma3" and kind == "sliding_attention" and r.type != "default"):
            raise ValueError(f"{where}: {arch.family} with rope_type {r.type!r} on its {kind} layers: llama.cpp's {g!r} "
                             f"graph applies {sorted(GGUF_ROPES[g])}; use engine.backend=cpu_native")
    if arch.sliding_window is not None and not g.startswith("gemma") and arch.sliding_window < arch.context_length:
        raise ValueError(f"{where}: {arch.family} with sliding_window={arch.sliding_window} (shorter than "
                         f"max_position_embeddings={arch.context_length}): llama.cpp's {g!r} graph has no sliding window; "
                         "use engine.backend=cpu_native")
    if g == "gemma2" and not arch.tie_word_embeddings:
        raise ValueError(f"{where}: Gemma 2 with tie_word_embeddings=false: llama.cpp's 'gemma2' graph always reads its "
                         "head from the token embedding; use engine.backend=cpu_native")
    if arch.o_bias or arch.mlp_bias:
        raise ValueError(f"{where}: {arch.family} with an o_proj or MLP bias: the GGUF written here carries q/k/v biases "
                         "only; use engine.backend=cpu_native")
    return arch


def _vocab(checkpoint_dir: Path, n_vocab: int, where: str) -> tuple[list[str], list[int]]:
    """(tokens by id, token types) from tokenizer.json, padded to the model's vocabulary as llama.cpp's converter does."""
    from gguf import TokenType

    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{checkpoint_dir}: no tokenizer.json; the llama_cpp backend needs a fast (BPE) tokenizer file")
    data = json.loads(path.read_text())
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{path} model.type={model.get('type')!r}: the llama_cpp backend writes BPE (gpt2-style) "
                         "tokenizers only")
    by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
    kinds: dict[int, int] = {}
    for added in data.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    if max(by_id, default=-1) >= n_vocab:
        raise ValueError(f"{where}: tokenizer ids reach {max(by_id)} but vocab_size is {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(int(kinds.get(i, TokenType.NORMAL)))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
    return tokens, types


def _dense(x: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """A dense tensor as written: f32 / f16 data, or q8_0 bytes (gguf.quants), with its raw dtype (None: from the array)."""
    from gguf import GGMLQuantizationType, quants

    if kind == "f32":
        return np.ascontiguousarray(x, dtype=np.float32), None
    if kind == "f16":
        return np.ascontiguousarray(x, dtype=np.float16), None
    return quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def write_gguf(checkpoint_dir: Path, out: Path, prof: Profile, dequantized_from: Any = None) -> dict[str, Any]:
    """Write the checkpoint as one llama.cpp GGUF file; returns what was written (types, rounding).

    `dequantized_from`: a dense float32 state dict to use instead of the checkpoint's tensors (a quantized
    checkpoint built dense from its exactly dequantized weights).
    """
    from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter, RopeScalingType, SpecialVocab

    checkpoint_dir = Path(checkpoint_dir)
    where = f"{checkpoint_dir}/config.json"
    config = read_config(checkpoint_dir)
    arch = _check_architecture(config, where)
    g = GGUF_ARCH[arch.model_type]
    schemes = None if dequantized_from is not None else detect_schemes(checkpoint_dir)
    if dequantized_from is not None:
        tensors, prefixes = dequantized_from, []
    else:
        tensors = load_tensors(checkpoint_dir)
        prefixes = split_tensors(tensors, checkpoint_dir)[1] if schemes else []
    n_vocab, heads, head_dim = arch.vocab_size, arch.num_attention_heads, arch.head_dim
    n_layers = arch.num_hidden_layers
    full = arch.rope.get("full_attention") or next(iter(arch.rope.values()))

    w = GGUFWriter(str(out), g)
    w.add_name(str(config.get("_name_or_path") or checkpoint_dir.name) or "edgeflow")
    w.add_context_length(arch.context_length)
    w.add_embedding_length(arch.hidden_size)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(arch.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != arch.hidden_size // heads or g.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(full.theta)
    if full.type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full.factor))
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    if g.startswith("gemma"):  # always the per-layer list: llama.cpp's own default pattern (2 or 6) is not the model's
        w.add_sliding_window_pattern([t == "sliding_attention" for t in arch.layer_types])
        if arch.sliding_window is not None:
            w.add_sliding_window(arch.sliding_window)
            w.add_rope_freq_base_swa((arch.rope.get("sliding_attention") or full).theta)
    if arch.attn_softcap:
        w.add_attn_logit_softcapping(arch.attn_softcap)
    if arch.final_softcap:
        w.add_final_logit_softcapping(arch.final_softcap)
    w.add_vocab_size(n_vocab)
    w.add_quantization_version(2)
    tokens, types = _vocab(checkpoint_dir, n_vocab, where)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    SpecialVocab(checkpoint_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(w, quiet=True)

    types_written: dict[str, int] = {}
    rounding: dict[str, dict[str, float]] = {}
    # Fixed once here, not per token: Gemma's (1 + w) norms become w' = 1 + w, and where llama.cpp's graph scales the
    # queries other than the model does (query_pre_attn_scalar), the ratio is folded into the queries: into q_norm
    # (Gemma 3: RMSNorm output times w') or into q_proj's rows (Gemma 2, whose queries go straight to RoPE, a linear map).
    q_fold = arch.attn_scale / llama_cpp_attn_scale(arch, g)
    q_fold = 1.0 if abs(q_fold - 1.0) < 1e-12 else q_fold

    def add(hf_name: str, data: np.ndarray, raw_dtype: Any, kind: str) -> None:
        w.add_tensor(_gguf_name(hf_name, g, n_layers), data, raw_dtype=raw_dtype)
        types_written[kind] = types_written.get(kind, 0) + 1

    if full.type == "llama3":  # per-dimension divisors of the default frequencies (llama.cpp's rope_freqs)
        default = Rope(type="default", theta=full.theta).inv_freq(head_dim)
        w.add_tensor(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", (default / full.inv_freq(head_dim)).astype(np.float32))
        types_written["f32"] = types_written.get("f32", 0) + 1

    quant_prefixes = set(prefixes)
    for prefix in sorted(quant_prefixes):
        folds_q = q_fold != 1.0 and not arch.qk_norm and prefix.endswith("self_attn.q_proj")
        s = layer_scheme(tensors, prefix, schemes)
        q = layer(tensors, prefix, s)
        if folds_q:
            q = QuantizedLayer(q.q, q.zero, (q.scale * np.float32(q_fold)).astype(q.scale.dtype))
        if (n := _rope_heads(prefix, config)) is not None:
            q = QuantizedLayer(permute_rope_rows(q.q, n), permute_rope_rows(q.zero, n), permute_rope_rows(q.scale, n))
        kind, blocks, r = encode_blocks(q, s.bits, s.symmetric)
        add(f"{prefix}.weight", blocks, getattr(GGMLQuantizationType, kind), kind)
        agg = rounding.setdefault(kind, {"scale_rel": 0.0, "m_rel": 0.0, "weight_abs": 0.0})
        for k, v in r.items():
            agg[k] = max(agg[k], v)
    for name in sorted(tensors):
        prefix, _, leaf = name.rpartition(".")
        if prefix in quant_prefixes and leaf in QUANT_LEAVES:
            continue  # written above from its integers; a quantized layer's bias is written dense, below
        folds_q = q_fold != 1.0 and ((arch.qk_norm and prefix.endswith("self_attn.q_norm"))
                                     or (not arch.qk_norm and prefix.endswith("self_attn.q_proj")))
        x = np.asarray(tensors[name].detach().numpy() if hasattr(tensors[name], "detach") else tensors[name])
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # llama.cpp reads a tied head from token_embd
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            data, raw = _dense(x, prof.head)
            add(name, data, raw, prof.head)
            continue
        if name.endswith("norm.weight") and arch.norm_offset:
            x = x.astype(np.float32) + np.float32(arch.norm_offset)
        if folds_q:
            x = x.astype(np.float32) * np.float32(q_fold)
        if (n := _rope_heads(prefix, config)) is not None:
            x = permute_rope_rows(x, n)  # weights and biases alike: rows
        if x.ndim == 1:  # norms and biases: llama.cpp computes them in f32
            add(name, np.ascontiguousarray(x, dtype=np.float32), None, "f32")
        else:
            data, raw = _dense(x, prof.dense)
            add(name, data, raw, prof.dense)
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{checkpoint_dir}: no model.embed_tokens.weight tensor")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"tensor_types": types_written, "rounding": rounding}


def _versions() -> dict[str, str]:
    import gguf

    versions = {"gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")}
    try:
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        versions["llama_cpp_python"] = "not installed"
    return versions


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Write a dense or compressed-tensors checkpoint as a llama.cpp GGUF engine directory."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    prof = validate_profile(BACKEND, profile)
    config = read_config(checkpoint_dir)
    _check_architecture(config, f"{checkpoint_dir}/config.json")
    dequantized: str | None = None
    try:
        schemes = detect_schemes(checkpoint_dir)  # raises ValueError before any work for unsupported schemes
    except InexactWeights as e:
        if prof.inexact_weights == "error":
            raise
        schemes, dequantized = None, str(e)
    checkpoint_sha = sha256_tree(checkpoint_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    dense_state = None
    if dequantized:
        dense_state = {k: v.float() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
    try:
        written = write_gguf(checkpoint_dir, out_dir / GGUF_FILE, prof, dense_state)
    except InexactWeights as e:  # a layer's shapes no block holds: the same fallback, decided per checkpoint
        if prof.inexact_weights == "error":
            raise
        dequantized = str(e)
        dense_state = {k: v.float() for k, v in load_dequantized(checkpoint_dir).state_dict().items()}
        written = write_gguf(checkpoint_dir, out_dir / GGUF_FILE, prof, dense_state)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    # the report's engine column: the decoder linears' block types ("q4_1", "q4_0+q8_0"), or the dense type
    blocks = sorted(t.lower() for t in written["tensor_types"] if t.startswith("Q"))
    precision = "+".join(blocks) if schemes else {"f32": "fp32", "f16": "fp16"}[prof.dense]
    return edir.write_meta(out_dir, edir.EngineMeta(
        backend=BACKEND,
        format=FORMAT,
        precision=precision,
        checkpoint_sha256=checkpoint_sha,
        dequantized=dequantized and {"reason": dequantized, "checkpoint_quantization": config["quantization_config"]},
        files=[GGUF_FILE],
        tokenizer_files=copied,
        build_identity=build_identity(),
        **_versions(),
        writer=WRITER,
        profile=prof.model_dump(),
        quantization={name: s.summary() for name, s in (schemes or {}).items()} or None,
        tensor_types=written["tensor_types"],
        rounding=written["rounding"],
        sampling={"method": "exact: the full fp32 logits of each step (llama_get_logits_ith)", "parameters": list(PARAMETERS)},
        checkpoint=str(checkpoint_dir.resolve()),
        device=device_fingerprint(),
    ))


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the writer and the llama.cpp it targets."""
    v = _versions()
    return f"{BACKEND} {WRITER}, gguf {v['gguf']}, llama-cpp-python {v['llama_cpp_python']}"


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.check_meta(engine_dir, BACKEND)
    if meta.extra("writer") != WRITER:
        raise EngineIncompatibleError(f"{engine_dir}: engine written by {meta.extra('writer')!r}, this device reads "
                                      f"{WRITER!r} (rebuild the engine)")
    have = _versions()["llama_cpp_python"]
    if have == "not installed":
        raise EngineIncompatibleError(f"{engine_dir}: engine needs llama-cpp-python (built with "
                                      f"{meta.extra('llama_cpp_python')}); this device has none (pip install -e .)")
    # No ISA requirement: the GGUF file holds no machine code; the llama.cpp library picks its kernels.


@dataclass
class LlamaCppSession:
    """Opaque handle returned by `load`: llama.cpp contexts over one memory-mapped GGUF file."""

    model_path: Path
    engine_dir: Path
    meta: dict[str, Any]
    vocab_size: int
    context_length: int
    threads: int
    n_batch: int
    contexts: int
    _idle: queue.LifoQueue = field(default_factory=queue.LifoQueue)
    _created: int = 0
    _scorer: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    score_lock: threading.Lock = field(default_factory=threading.Lock)

    def _new(self, logits_all: bool) -> Any:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise RuntimeError(f"engine.backend llama_cpp needs llama-cpp-python ({e}); install the `llamacpp` extra: "
                               "pip install -e '.[llamacpp]' (make test installs it; make demo does not)") from None

        return Llama(model_path=str(self.model_path), n_ctx=self.context_length, n_batch=self.n_batch,
                     n_ubatch=self.n_batch, n_threads=self.threads, n_threads_batch=self.threads,
                     logits_all=logits_all, verbose=False)

    def acquire(self) -> Any:
        """An idle generation context, or a new one while fewer than `contexts` exist (else wait for one)."""
        with self._lock:
            if self._idle.empty() and self._created < self.contexts:
                self._created += 1
                return self._new(False)
        return self._idle.get()

    def release(self, llm: Any) -> None:
        self._idle.put(llm)

    def close(self) -> None:
        """Free every llama.cpp context now (at interpreter exit llama-cpp-python's own finalizers find ctypes gone)."""
        with self._lock:
            contexts = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
            if self._scorer is not None:
                contexts.append(self._scorer)
            self._scorer, self._created = None, 0
        for llm in contexts:
            llm.close()

    def scorer(self) -> Any:
        """The context that keeps logits for every position (created on first use)."""
        with self._lock:
            if self._scorer is None:
                self._scorer = self._new(True)
            return self._scorer


def load(engine_dir: Path) -> LlamaCppSession:
    """Check compatibility; contexts are created on first use (a generation context per concurrent call)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    prof = Profile.model_validate(meta.get("profile") or {})
    vocab, trained_ctx = _gguf_sizes(engine_dir / GGUF_FILE)
    session = LlamaCppSession(
        model_path=engine_dir / GGUF_FILE, engine_dir=engine_dir, meta=meta, vocab_size=vocab,
        context_length=min(prof.n_ctx, trained_ctx),
        threads=threads_from_env(), n_batch=prof.n_batch, contexts=prof.contexts,
    )
    session.release(session.acquire())  # one context now: a broken file fails the load, not the first request
    atexit.register(session.close)
    return session


def _gguf_sizes(path: Path) -> tuple[int, int]:
    """(vocabulary, trained context length) as the GGUF file states them (the engine directory has no config.json)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    g = field.contents() if field is not None else "llama"
    vocab, ctx = reader.get_field(f"{g}.vocab_size"), reader.get_field(f"{g}.context_length")
    if vocab is None or ctx is None:
        raise EngineIncompatibleError(f"{path}: no {g}.vocab_size / {g}.context_length; rebuild the engine")
    return int(vocab.contents()), int(ctx.contents())


def _last_logits(llm: Any, n_vocab: int) -> np.ndarray:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)


def generate(
    session: LlamaCppSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode with the KV cache of a pooled context; yields each new token id (never a stop id)."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens <= 0:
        return
    if len(input_ids) + max_new_tokens > session.context_length:
        raise ValueError(f"{len(input_ids)} prompt tokens + {max_new_tokens} new tokens exceed the engine's context "
                         f"length {session.context_length} (engine.profile.n_ctx)")
    stops = set(int(t) for t in stop_token_ids)
    llm = session.acquire()
    try:
        llm.reset()
        llm.eval(list(map(int, input_ids)))
        sampler = None if sampling is None or sampling.plain_greedy else Sampler(sampling, input_ids)
        ids = np.arange(session.vocab_size)
        for i in range(max_new_tokens):
            logits = _last_logits(llm, session.vocab_size)
            token = int(np.argmax(logits)) if sampler is None else sampler.choose(ids, logits)
            if token in stops:
                break
            yield token
            if i + 1 < max_new_tokens:
                llm.eval([int(token)])
    finally:
        session.release(llm)


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw reads the full fp32 logits of each step."""
    return frozenset(PARAMETERS)


def score(session: LlamaCppSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab]."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if len(input_ids) > session.context_length:
        raise ValueError(f"{len(input_ids)} tokens exceed the engine's context length {session.context_length}")
    llm = session.scorer()
    with session.score_lock:  # one scoring context: calls take turns
        llm.reset()
        llm.eval(list(map(int, input_ids)))
        return np.array(llm.scores[: len(input_ids), : session.vocab_size], dtype=np.float32)
