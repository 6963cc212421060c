"""build(Path("ckpt"), Path("eng"), {}); s = load(Path("eng")); print(list(generate(s, [1, 9690], 8, [2])))

CPU engine backend: onnxruntime-genai models (int4 MatMulNBits, or fp32) built from edgeflow checkpoints.

What it does, per interface function (see `tasks/engines/__init__.py`):

* `build` turns a checkpoint into an onnxruntime-genai model directory with the model builder
  shipped inside onnxruntime-genai (`onnxruntime_genai.models.builder`).
  - Dense checkpoints (the FP reference row) build in fp32: CPUs have no fast fp16/bf16 GEMM
    path in ORT's CPU EP, and fp32 keeps the reference exact against HF (logits within ~1e-4).
  - llm-compressor checkpoints (compressed-tensors, format "pack-quantized", W4A16, group-wise)
    cannot be read by the builder directly (its compressed-tensors loader is a CUDA-only
    NVFP4/FP8 path), but the packed int4 tensors repack *bit-exactly* into the GPTQ layout the
    builder's GPTQ loader reads (`repack_compressed_tensors`), so the int4 ONNX model runs the
    very integers and scales llm-compressor chose: nothing is re-quantized.
  - Weight-only schemes int4 MatMulNBits cannot hold exactly (8-bit, per-channel, act-order g_idx,
    a mixed W8/W4 recipe) build, by default (`inexact_weights: dequantize`), as an fp32 engine from
    the exactly dequantized weights: the gate still measures the checkpoint's own numbers, and
    engine.json says so under "dequantized" (the report's engine column shows it). With
    `inexact_weights: error` they raise. Quantized activations, KV cache, sparsity or transforms
    always raise ValueError: dequantizing would change the model.
* `score` returns logits for every position. onnxruntime-genai's Generator exposes only the last
  step's logits through `get_logits()`, and the served decoder is built with `prune_lm_head` (the
  prefill computes the 49152-wide lm_head for the last position only, halving TTFT). So `build`
  also writes `score.onnx`, the same graph minus the two prune nodes, sharing model.onnx.data; on
  its first call `score` loads it as a second og.Model and returns `generator.get_output("logits")`
  after one prefill `append_tokens` of the whole sequence: the same kernels and weights as
  `generate` (logits within 3e-4 of HF for exact builds; verified in the tests).
* `generate` is greedy decoding with one `og.Generator` (own KV cache) per call; the `og.Model`
  (weights, ORT session) is shared, and concurrent calls from several Python threads are safe
  and give the same tokens as sequential ones (tested). onnxruntime-genai 0.18's Python binding
  keeps the GIL during `append_tokens`/`generate_next_token`, so two streams interleave step by
  step rather than run in parallel; each step already uses all intra-op threads, so on a small
  CPU the aggregate throughput of 2 streams is about that of 1 (see the benchmark).

Threads: ORT's intra_op_num_threads is set at `load` time to EDGEFLOW_ENGINE_THREADS, or to the
number of CPUs this process may use, through an `og.Config.overlay` of the genai config (the
engine dir is not modified; og's own default ran one thread on the 2-core box, 1.7x slower).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.artifacts import sha256_tree
from tasks.engines.sampling import PARAMETERS, Sampler, SamplingParams
from tasks.engines import EngineIncompatibleError

if TYPE_CHECKING:  # torch is imported lazily: loading an engine does not need it
    import torch

BACKEND = "cpu"
ENGINE_JSON = "engine.json"
THREADS_ENV = "EDGEFLOW_ENGINE_THREADS"

# Build profile keys and their defaults; `profile` passed to `build` overrides any of them.
# Measured on the 10-layer student (RTN int4 asym g64), AMD EPYC 2 cores AVX2 without VNNI, 2 ORT
# threads: greedy token agreement vs the fake-quantized HF model (5 chat prompts x 32 tokens),
# teacher-forced top-1 agreement, decode tok/s (128 tokens; benchmarks/engine_cpu_results.md):
#   accuracy_level=1, lm_head=fp32   100% agreement (max |dlogit| 3e-4)  ~71-78 tok/s  <- default
#   accuracy_level=1, lm_head=int8    88% agreement (top-1 99.7%)        ~105 tok/s
#   accuracy_level=4, lm_head=fp32    24% agreement (top-1 83%)          ~97 tok/s
#   accuracy_level=4, lm_head=int8    24% agreement (top-1 82%)          ~177 tok/s
#   accuracy_level=4, lm_head=int4    18% agreement (top-1 66%)          ~182 tok/s
#   (dense fp32 engine ~61-63 tok/s, HF eager fp32 ~20 tok/s)
# accuracy_level 4 quantizes activations to int8 per 64-wide block (~1-2% relative error per
# MatMul, measured equal to ideal block quantization); on undistilled layer-dropped students and
# even on the 30-layer teacher (41% agreement, top-1 93%) that flips greedy tokens, so the default
# is the fastest setting that keeps parity >= 98%: exact fp32 activations and an fp32 lm_head.
DEFAULT_PROFILE: dict[str, Any] = {
    # MatMulNBits compute precision of the int4 body: 1=fp32 (exact w.r.t. the W4A16 checkpoint),
    # 4=int8 activations (block-wise; 2-3x faster decode, not parity-grade). 2/3 (fp16/bf16) have
    # no AVX2 kernels and run as 1.
    "accuracy_level": 1,
    # The tied lm_head, left dense by llm-compressor (ignore: [lm_head]): "fp32" (exact; shares the
    # fp32 table with the embedding Gather, -108 MB on disk), "int8" or "int4" (block-wise RTN by
    # the builder, symmetric). At 135M parameters the 49152x576 lm_head is ~45% of the weights read
    # per token, so it is what an int8/int4 head speeds up.
    "lm_head": "fp32",
    # Accuracy level of a quantized lm_head. int8 MatMulNBits has no fp32-compute CPU kernel
    # (accuracy_level 1 measured 294 ms vs 8.7 ms at level 4 per lm_head call), so it runs at 4.
    "lm_head_accuracy_level": 4,
    # Block size for weights the builder quantizes itself (only a quantized lm_head).
    "lm_head_block_size": 32,
    # Build the decoder with prune_lm_head: prefill computes the lm_head for the last position only.
    # With a 49152-wide vocab, full-sequence logits dominate prefill: TTFT for a 43-token prompt
    # 73 -> 35 ms and for 200 tokens 280 -> 90 ms (3-layer student). `score` needs every position,
    # so the build also writes score.onnx (same weights file, prune nodes removed), loaded lazily.
    "prune_lm_head": True,
    # Precision of dense checkpoints (the FP reference row): fp32 only; the CPU EP has no fast
    # fp16/bf16 GEMMs on AVX2 and fp32 matches HF eager within 1e-4.
    "dense_precision": "fp32",
    # Quantized weights that int4 MatMulNBits cannot hold exactly: 8-bit (W8A16, the W8 half of a
    # mixed recipe), per-channel scales, act-order groups, several schemes in one checkpoint.
    # "dequantize" builds an fp32 engine from the exactly dequantized weights: the same numbers as
    # the checkpoint (parity holds), at dense size and speed; engine.json records it under
    # "dequantized". Why not int8 MatMulNBits: ORT's CPU EP has no fp32-compute int8 kernel (294 ms
    # vs 8.7 ms per lm_head call, see lm_head_accuracy_level), and its int8-activation kernel is not
    # parity-grade. "error" refuses such checkpoints instead.
    "inexact_weights": "dequantize",
    # Extra builder KEY=VALUE options, passed through last (override the above; recorded in engine.json).
    "extra_options": {},
}

# Tokenizer/chat files copied next to the ONNX model so the engine dir is self-contained.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

# MatMulNBits block sizes (power of two, >= 16) supported by ORT's CPU kernels.
_BLOCK_SIZES = (16, 32, 64, 128, 256)
# Decoder linear layers the Llama builder reads from a GPTQ-format checkpoint.
_LINEAR_RE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")


# --------------------------------------------------------------------------------------------
# Quantization scheme detection and repacking
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantScheme:
    """What a compressed-tensors checkpoint stores, as far as the int4 engine cares."""

    bits: int
    group_size: int
    symmetric: bool
    format: str

    def as_dict(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric, "format": self.format}


class NotInt4Exact(ValueError):
    """The checkpoint's weights are quantized in a way int4 MatMulNBits blocks cannot hold exactly."""


def _read_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{checkpoint_dir}: no config.json; not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def detect_scheme(checkpoint_dir: Path) -> QuantScheme | None:
    """None for a dense checkpoint; the scheme of a supported compressed-tensors one; else ValueError.

    Raises ValueError naming the field and why the int4 CPU engine cannot represent it exactly.
    """
    config = _read_config(checkpoint_dir)
    qc = config.get("quantization_config")
    if not qc:
        return None
    where = f"{checkpoint_dir}/config.json quantization_config"
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"{where}.quant_method={method!r} is not supported by the cpu engine: only llm-compressor "
            "'compressed-tensors' checkpoints (or dense ones) are built; refusing to guess at another format"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"{where}.kv_cache_scheme={qc['kv_cache_scheme']!r}: quantized KV cache is not supported")
    if qc.get("sparsity_config"):
        raise ValueError(f"{where}.sparsity_config is set: sparse compressed checkpoints are not supported")
    if qc.get("transform_config"):
        raise ValueError(f"{where}.transform_config is set: rotated (transformed) checkpoints are not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: cannot tell what the weights are")
    for name, group in groups.items():  # checks that no engine mode can honour come first
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(
                f"{where}.config_groups.{name}: activation quantization is set; the cpu engine supports "
                "weight-only schemes (W4A16, W8A16)"
            )
        if (group.get("weights") or {}).get("dynamic"):
            raise ValueError(f"{where}.config_groups.{name}.weights.dynamic=true: dynamic weight quantization is not supported")
    schemes = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        g = f"{where}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise NotInt4Exact(f"{g}.format={fmt!r}: only 'pack-quantized' int4 weights repack into MatMulNBits")
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise NotInt4Exact(
                f"{g}.weights: num_bits={w.get('num_bits')} type={w.get('type')!r}; MatMulNBits int4 holds "
                "4-bit int weights only"
            )
        if w.get("strategy") != "group":
            raise NotInt4Exact(
                f"{g}.weights.strategy={w.get('strategy')!r}: only 'group' is supported (per-channel/tensor "
                "scales are not MatMulNBits blocks)"
            )
        gs = w.get("group_size")
        if gs not in _BLOCK_SIZES:
            raise NotInt4Exact(
                f"{g}.weights.group_size={gs}: MatMulNBits block sizes are {_BLOCK_SIZES}; "
                "this group size is not representable"
            )
        if w.get("actorder") not in (None, "static", "weight"):
            raise NotInt4Exact(
                f"{g}.weights.actorder={w.get('actorder')!r}: act-order with a permuted g_idx is not "
                "representable by MatMulNBits contiguous blocks (use actorder weight or none)"
            )
        schemes.add(QuantScheme(4, int(gs), bool(w.get("symmetric", True)), "pack-quantized"))
    if len(schemes) != 1:
        raise NotInt4Exact(f"{where}: config groups use different schemes {sorted(map(str, schemes))}; expected one")
    return schemes.pop()


def _load_safetensors(checkpoint_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint_dir}: no *.safetensors weights")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _unpack_int4_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """Unpack int32 words packing 8 nibbles along dim 1 (nibble i of a word at bits 4i) -> uint8 [n, rows]."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    out = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift is fine: we mask 4 bits
    return out.reshape(packed.shape[0], -1)[:, :rows].to(torch.uint8)


def _pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_int4_rows`: uint8 [n, m] (m % 8 == 0) -> int32 [n, m / 8]."""
    import torch

    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (v << shifts).sum(-1)  # in [0, 2**32): reinterpret the top bit as the int32 sign
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def repack_compressed_tensors(checkpoint_dir: Path, out_dir: Path, scheme: QuantScheme) -> dict[str, int]:
    """Rewrite a compressed-tensors pack-quantized checkpoint in the GPTQ layout (bit-exact).

    compressed-tensors (pack_to_int32) stores, per Linear [out, in]:
      weight_packed     int32 [out, in/8]   nibble k of word j = q[o, 8j+k] + 8 (signed -> unsigned)
      weight_scale      float [out, in/gs]
      weight_zero_point int32 [out/8, in/gs] (asymmetric only) packed along the *output* dim, +8
    dequant: w = (q_unsigned - zp_unsigned) * scale   (zp_unsigned = 8 when symmetric)

    GPTQ (what the builder's GPTQ loader reads, AutoGPTQ v1 convention):
      qweight int32 [in/8, out]   packed along the input dim, same nibble order -> weight_packed.T
      scales  float [in/gs, out]                                                  -> weight_scale.T
      qzeros  int32 [in/gs, out/8] packed along the output dim, stores zp - 1 (the loader adds 1 back)
      g_idx   int32 [in] = column // group_size (trivial: act-order is rejected in `detect_scheme`)
    Returns counts of what was written.
    """
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _load_safetensors(checkpoint_dir)
    gs = scheme.group_size
    out: dict[str, torch.Tensor] = {}
    n_linear = 0
    prefixes = sorted({k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")})
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"):
            continue
        if leaf == "weight" and _LINEAR_RE.match(prefix):
            raise ValueError(
                f"{checkpoint_dir}: decoder linear {prefix} is stored dense while the others are int4 "
                "(mixed dense/int4 decoders are not supported by the GPTQ-format builder path)"
            )
        out[name] = t
    for prefix in prefixes:
        if not _LINEAR_RE.match(prefix):
            raise ValueError(f"{checkpoint_dir}: quantized tensor {prefix} is not a Llama decoder linear layer")
        packed = tensors[f"{prefix}.weight_packed"]
        scale = tensors[f"{prefix}.weight_scale"]
        shape = tensors.get(f"{prefix}.weight_shape")
        n_out, n_in = (int(shape[0]), int(shape[1])) if shape is not None else (packed.shape[0], packed.shape[1] * 8)
        if n_in % gs or n_in % 8 or n_out % 8 or packed.shape != (n_out, n_in // 8):
            raise ValueError(
                f"{prefix}: weight [{n_out}, {n_in}] (packed {tuple(packed.shape)}) is not a whole number of "
                f"{gs}-column groups / 8-nibble words"
            )
        g_idx_key = f"{prefix}.weight_g_idx"
        trivial = torch.arange(n_in, dtype=torch.int32) // gs
        if g_idx_key in tensors and not torch.equal(tensors[g_idx_key].to(torch.int32), trivial):
            raise ValueError(f"{prefix}: act-order weight_g_idx (non-contiguous groups) is not representable")
        if scale.shape != (n_out, n_in // gs):
            raise ValueError(f"{prefix}: weight_scale shape {tuple(scale.shape)} != ({n_out}, {n_in // gs})")
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            # the builder divides by the scales when it re-derives the integers (see module docstring)
            raise ValueError(f"{prefix}: weight_scale has zero, negative or non-finite entries")
        if scheme.symmetric:
            zp_u = torch.full((n_out, n_in // gs), 8, dtype=torch.uint8)
        else:
            zp_packed = tensors[f"{prefix}.weight_zero_point"]
            zp_u = _unpack_int4_rows(zp_packed.T.contiguous(), n_out).T.contiguous()  # [out, groups]
        # GPTQ qzeros: (zp - 1) mod 16, packed along the output dim -> [groups, out/8]
        qzeros = _pack_int4_rows(((zp_u.to(torch.int16) - 1) & 0xF).T.contiguous())
        out[f"{prefix}.qweight"] = packed.T.contiguous()
        out[f"{prefix}.scales"] = scale.T.contiguous().to(torch.float32)
        out[f"{prefix}.qzeros"] = qzeros.contiguous()
        out[f"{prefix}.g_idx"] = trivial
        n_linear += 1
    if n_linear == 0:
        raise ValueError(f"{checkpoint_dir}: quantization_config present but no *.weight_packed tensors found")
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = _read_config(checkpoint_dir)
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": scheme.bits,
        "group_size": gs,
        "sym": scheme.symmetric,
        "desc_act": False,
        "checkpoint_format": "gptq",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer_files(checkpoint_dir, out_dir)
    return {"linear_layers": n_linear, "tensors": len(out)}


def _write_dequantized(checkpoint_dir: Path, out_dir: Path) -> None:
    """Save the checkpoint's exactly dequantized weights as a dense fp32 checkpoint the builder reads."""
    from tasks.quantize import load_dequantized

    load_dequantized(checkpoint_dir).save_pretrained(out_dir)
    _copy_tokenizer_files(checkpoint_dir, out_dir)


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference dequantization of a GPTQ-format layer -> float32 [out, in] (used by the tests)."""
    import torch

    q = _unpack_int4_rows(qweight.T.contiguous(), qweight.shape[0] * 8).to(torch.float32)  # [out, in]
    z = ((_unpack_int4_rows(qzeros, qzeros.shape[1] * 8).to(torch.int16) + 1) & 0xF).to(torch.float32)  # [groups, out]
    s = scales.to(torch.float32)  # [groups, out]
    z_full = z.T.repeat_interleave(group_size, dim=1)
    s_full = s.T.repeat_interleave(group_size, dim=1)
    return (q - z_full) * s_full


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in _TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    import onnxruntime
    import onnxruntime_genai as og

    return {"onnxruntime_genai": og.__version__, "onnxruntime": onnxruntime.__version__}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ISA extensions ORT's MLAS picks kernels by; the engine files are ISA-independent (kernels are
# chosen at session creation), so they are recorded for provenance, not required.
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")


def device_fingerprint() -> dict[str, Any]:
    """CPU model, relevant ISA flags, OS and arch of this machine."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    flags = _cpu_flags()
    return {
        "cpu_model": model or platform.processor(),
        "isa": sorted(f for f in _ISA_FLAGS if f in flags),
        "cores": os.cpu_count(),
        "os": platform.system().lower(),
        "arch": platform.machine(),
    }


def _builder_options(scheme: QuantScheme | None, prof: dict[str, Any], tied: bool) -> tuple[str, dict[str, str]]:
    """(precision, KEY=VALUE extra options) for the onnxruntime-genai model builder."""
    opts: dict[str, str] = {"hf_token": "false"}  # local directories only: never ask the Hub
    if scheme is None:
        precision = prof["dense_precision"]
        if precision != "fp32":
            raise ValueError(f"profile dense_precision={precision!r}: the cpu engine builds dense checkpoints in fp32")
    else:
        precision = "int4"
        level = int(prof["accuracy_level"])
        if level not in (1, 2, 3, 4):
            raise ValueError(f"profile accuracy_level={level}: must be 1 (fp32), 2 (fp16), 3 (bf16) or 4 (int8)")
        opts["accuracy_level"] = str(level)
        head = prof["lm_head"]
        if head == "fp32":
            # Keep the lm_head and the embedding exactly as in the checkpoint. For tied weights the
            # builder can share one fp32 table (Gather reads the lm_head weight transposed), but only
            # if neither node is quantized: shared_embeddings would otherwise add Gather to the
            # quantized op types and RTN-quantize the embedding to int4.
            if tied:
                opts["shared_embeddings"] = "true"
                opts["nodes_to_exclude"] = "/lm_head/MatMul,/model/embed_tokens/Gather"
            else:
                opts["shared_embeddings"] = "false"
                opts["nodes_to_exclude"] = "/lm_head/MatMul"
        elif head in ("int8", "int4"):
            # The embedding Gather must stay fp32 (GatherBlockQuantized is int4-only and would
            # re-quantize it), so the quantized head cannot share the table: shared_embeddings=false.
            opts["shared_embeddings"] = "false"
            opts["block_size"] = str(int(prof["lm_head_block_size"]))
            opts["is_symmetric"] = "true"
            if head == "int8":
                opts["matmul_mixed_precision"] = "last_matmul:int8"
        else:
            raise ValueError(f"profile lm_head={head!r}: choose 'fp32', 'int8' or 'int4'")
    opts["prune_lm_head"] = "true" if prof["prune_lm_head"] else "false"
    for k, v in (prof.get("extra_options") or {}).items():
        opts[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    return precision, opts


SCORE_MODEL = "score.onnx"


def _write_score_graph(out_dir: Path) -> str:
    """Write score.onnx: model.onnx without the lm_head prune (logits for every position).

    The builder's prune is `Gather(hidden, -1) -> Unsqueeze -> lm_head`; the lm_head is rewired to
    the un-gathered hidden states. Only the graph is rewritten: initializers keep pointing at
    model.onnx.data (ORT resolves external data relative to the model file), so no weights are
    duplicated on disk. Returns the file name to use for scoring.
    """
    import onnx

    model = onnx.load(str(out_dir / "model.onnx"), load_external_data=False)
    nodes = list(model.graph.node)
    gather = next((n for n in nodes if n.name == "/lm_head/prune/Gather"), None)
    unsqueeze = next((n for n in nodes if n.name == "/lm_head/prune/Unsqueeze"), None)
    if gather is None or unsqueeze is None:
        return "model.onnx"  # not pruned: the decoder already returns every position
    pruned_out, hidden = unsqueeze.output[0], gather.input[0]
    consumers = [n for n in nodes if pruned_out in n.input]
    if len(consumers) != 1 or not consumers[0].name.startswith("/lm_head/"):
        raise RuntimeError(f"unexpected lm_head prune pattern in {out_dir / 'model.onnx'}: {[n.name for n in consumers]}")
    head = consumers[0]
    head.input[list(head.input).index(pruned_out)] = hidden
    model.graph.node.remove(gather)
    model.graph.node.remove(unsqueeze)
    logits = next(o for o in model.graph.output if o.name == "logits")
    dims = logits.type.tensor_type.shape.dim
    if len(dims) == 3:
        dims[1].Clear()
        dims[1].dim_param = "sequence_length"
    onnx.save(model, str(out_dir / SCORE_MODEL))
    return SCORE_MODEL


def _set_lm_head_accuracy_level(out_dir: Path, level: int) -> list[str]:
    """Set accuracy_level on the quantized lm_head MatMulNBits node(s) of the built model.

    The builder applies one accuracy level to every MatMulNBits; this edits only the small graph
    file (weights stay in model.onnx.data). Returns the node names changed.
    """
    import onnx

    path = out_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    changed = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.name.startswith("/lm_head/"):
            for attr in node.attribute:
                if attr.name == "accuracy_level" and attr.i != level:
                    attr.i = level
                    changed.append(node.name)
    if changed:
        onnx.save(model, str(path))
    return changed


def _run_builder(src: Path, out_dir: Path, precision: str, opts: dict[str, str], cache_dir: Path) -> str:
    """Call the onnxruntime-genai model builder in-process; returns its (Python-level) log."""
    from onnxruntime_genai.models import builder

    log = io.StringIO()
    kv = [f"{k}={v}" for k, v in opts.items()]
    quant_logger = logging.getLogger("onnxruntime.quantization")  # one INFO line per graph node
    old_level = quant_logger.level
    quant_logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(log):
            extra = builder.parse_extra_options(None, str(src), str(out_dir), precision, "cpu", str(cache_dir), kv)
            builder.create_model(None, str(src), str(out_dir), precision, "cpu", str(cache_dir), **extra)
    finally:
        quant_logger.setLevel(old_level)
    return log.getvalue()


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Compile a dense or compressed-tensors int4 checkpoint into an onnxruntime-genai CPU engine dir."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    unknown = set(profile or {}) - set(DEFAULT_PROFILE)
    if unknown:
        raise ValueError(f"unknown cpu engine profile keys {sorted(unknown)}; known: {sorted(DEFAULT_PROFILE)}")
    prof = {**DEFAULT_PROFILE, **(profile or {})}
    if prof["inexact_weights"] not in ("dequantize", "error"):
        raise ValueError(f"profile inexact_weights={prof['inexact_weights']!r}: choose 'dequantize' or 'error'")
    dequantized: str | None = None
    try:
        scheme = detect_scheme(checkpoint_dir)  # raises ValueError before any work for unsupported schemes
    except NotInt4Exact as e:
        if prof["inexact_weights"] == "error":
            raise
        scheme, dequantized = None, str(e)
    tied = bool(_read_config(checkpoint_dir).get("tie_word_embeddings", False))
    precision, opts = _builder_options(scheme, prof, tied)
    checkpoint_sha = sha256_tree(checkpoint_dir)

    with tempfile.TemporaryDirectory(prefix="edgeflow-cpu-build-") as tmp:
        tmp_path = Path(tmp)
        src = checkpoint_dir
        repack_stats = None
        if scheme is not None:  # repack first: tensor-level ValueErrors come before out_dir is touched
            src = tmp_path / "gptq"
            repack_stats = repack_compressed_tensors(checkpoint_dir, src, scheme)
        elif dequantized:
            src = tmp_path / "dequantized"
            _write_dequantized(checkpoint_dir, src)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / ENGINE_JSON).unlink(missing_ok=True)  # a failed rebuild must not look like a valid engine
        log = _run_builder(src, out_dir, precision, opts, tmp_path / "cache")
    (out_dir / "builder.log").write_text(log)
    lm_head_nodes: list[str] = []
    if scheme is not None and prof["lm_head"] != "fp32":
        lm_head_nodes = _set_lm_head_accuracy_level(out_dir, int(prof["lm_head_accuracy_level"]))
    score_model = _write_score_graph(out_dir)
    copied = _copy_tokenizer_files(checkpoint_dir, out_dir)

    meta: dict[str, Any] = {
        "backend": BACKEND,
        **_versions(),
        "precision": precision,
        "execution_provider": "cpu",
        "builder_options": opts,
        "profile": prof,
        "quantization": scheme.as_dict() if scheme else None,
        # set when a quantized checkpoint was built as fp32 from its exactly dequantized weights
        "dequantized": dequantized and {"reason": dequantized, "checkpoint_quantization": _read_config(checkpoint_dir)["quantization_config"]},
        "repack": repack_stats,
        "lm_head_accuracy_level_set_on": lm_head_nodes,
        "score_model": score_model,
        "sampling": {"method": "exact: the full fp32 logits of each step (get_logits)", "parameters": list(PARAMETERS)},
        "checkpoint": str(checkpoint_dir.resolve()),
        "checkpoint_sha256": checkpoint_sha,
        "device": device_fingerprint(),
        "tokenizer_files": copied,
        "model_files": sorted(p.name for p in out_dir.iterdir() if p.suffix in (".onnx", ".data")),
    }
    (out_dir / ENGINE_JSON).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return meta


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


def _major_minor(v: str) -> tuple[str, ...]:
    return tuple(str(v).split(".")[:2])


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the onnxruntime(-genai) versions."""
    v = _versions()
    return f"{BACKEND} onnxruntime-genai {v['onnxruntime_genai']}, onnxruntime {v['onnxruntime']}"


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    path = Path(engine_dir) / ENGINE_JSON
    if not path.exists():
        raise EngineIncompatibleError(
            f"{engine_dir}: no {ENGINE_JSON}; not an edgeflow engine directory (build it with engine.build)"
        )
    meta = json.loads(path.read_text())
    if meta.get("backend") != BACKEND:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine backend is {meta.get('backend')!r} but this device runs backend {BACKEND!r}"
        )
    have = _versions()
    built = meta.get("onnxruntime_genai", "<missing>")
    if _major_minor(built) != _major_minor(have["onnxruntime_genai"]):
        raise EngineIncompatibleError(
            f"{engine_dir}: engine built with onnxruntime-genai {built}, this device has onnxruntime-genai "
            f"{have['onnxruntime_genai']} (major.minor must match; rebuild the engine)"
        )
    missing = [f for f in meta.get("model_files", []) + ["genai_config.json"] if not (Path(engine_dir) / f).exists()]
    if missing:
        raise EngineIncompatibleError(f"{engine_dir}: engine files missing: {missing}")
    # No ISA/arch requirement: the ONNX files hold no machine code (MLAS picks AVX2/AVX-512/VNNI/
    # NEON kernels and prepacks MatMulNBits weights when the session is created), so an engine
    # built here runs on any CPU onnxruntime supports; device fingerprint is provenance only.


@dataclass
class CpuSession:
    """Opaque handle returned by `load`: the shared og.Model and facts about it."""

    model: Any
    engine_dir: Path
    meta: dict[str, Any]
    vocab_size: int
    context_length: int
    threads: int
    score_model_file: str = "model.onnx"
    _score_model: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def score_model(self) -> Any:
        """The og.Model whose prefill returns logits for every position (loaded on first use)."""
        if self.score_model_file == "model.onnx":
            return self.model
        with self._lock:
            if self._score_model is None:
                self._score_model = _og_model(self.engine_dir, self.threads, self.score_model_file)
            return self._score_model


def _threads_from_env() -> int:
    """ORT intra-op threads: $EDGEFLOW_ENGINE_THREADS, else every CPU this process may run on.

    Left unset, onnxruntime-genai's session ran decode on one thread here (2-core EPYC: 41 tok/s
    unset, 40 with 1 thread, 71 with 2 on the 10-layer int4 student), so the count is always set.
    """
    value = os.environ.get(THREADS_ENV)
    if not value:
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: must be a positive integer (ORT intra-op threads)")
    return threads


def _og_model(engine_dir: Path, threads: int, filename: str | None = None) -> Any:
    import onnxruntime_genai as og

    config = og.Config(str(engine_dir))
    decoder: dict[str, Any] = {"session_options": {"intra_op_num_threads": threads}}
    if filename is not None:
        decoder["filename"] = filename
    config.overlay(json.dumps({"model": {"decoder": decoder}}))
    return og.Model(config)


def load(engine_dir: Path) -> CpuSession:
    """Check compatibility, then load the ONNX model once (shared by every generate/score call)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = json.loads((engine_dir / ENGINE_JSON).read_text())
    genai = json.loads((engine_dir / "genai_config.json").read_text())
    threads = _threads_from_env()
    return CpuSession(
        model=_og_model(engine_dir, threads),
        engine_dir=engine_dir,
        meta=meta,
        vocab_size=int(genai["model"]["vocab_size"]),
        context_length=int(genai["model"]["context_length"]),
        threads=threads,
        score_model_file=meta.get("score_model", "model.onnx"),
    )


def _generator(session: CpuSession, max_length: int, model: Any = None) -> Any:
    import onnxruntime_genai as og

    if max_length > session.context_length:
        raise ValueError(f"{max_length} tokens exceed the engine's context length {session.context_length}")
    model = session.model if model is None else model
    params = og.GeneratorParams(model)
    # Greedy; max_length bounds the KV cache the generator allocates (past/present share one
    # buffer of max_length positions; the default would size it for the whole context).
    params.set_search_options(do_sample=False, max_length=max_length, batch_size=1)
    return og.Generator(model, params)


def generate(
    session: CpuSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode with the KV cache; yields each new token id (never a stop id).

    Plain greedy (no `sampling`, or greedy params) runs onnxruntime-genai's own greedy search: besides
    `stop_token_ids`, genai itself ends the sequence after the model's eos_token_id (genai_config.json);
    that token is yielded unless it is also a stop id. Anything else reads the step's full fp32 logits
    (`get_logits`), draws with the shared Sampler and appends the token (exact: no candidate bound).
    """
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens <= 0:
        return
    stops = set(int(t) for t in stop_token_ids)
    gen = _generator(session, len(input_ids) + max_new_tokens)
    gen.append_tokens(np.asarray([input_ids], dtype=np.int32))
    if sampling is None or sampling.plain_greedy:
        for _ in range(max_new_tokens):
            if gen.is_done():
                break
            gen.generate_next_token()
            token = int(gen.get_next_tokens()[0])
            if token in stops:
                break
            yield token
        return
    sampler = Sampler(sampling, input_ids)
    ids = np.arange(session.vocab_size)
    for i in range(max_new_tokens):
        logits = np.asarray(gen.get_logits(), dtype=np.float32).reshape(-1)[: session.vocab_size]
        token = sampler.choose(ids, logits)
        if token in stops:
            break
        yield token
        if i + 1 < max_new_tokens:
            gen.append_tokens(np.asarray([[int(token)]], dtype=np.int32))


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw reads the full fp32 logits of each step."""
    return frozenset(PARAMETERS)


def score(session: CpuSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab].

    One prefill step through og's Generator on score.onnx (the decoder graph without the lm_head
    prune; same weights file, loaded on first call): `get_output("logits")` then holds the
    [1, len, vocab] logits of that step. `get_logits()` would give the last position only.
    """
    if not input_ids:
        raise ValueError("input_ids is empty")
    gen = _generator(session, len(input_ids) + 1, session.score_model())
    gen.append_tokens(np.asarray([input_ids], dtype=np.int32))
    logits = np.asarray(gen.get_output("logits"))
    if logits.ndim != 3 or logits.shape[1] != len(input_ids):
        raise RuntimeError(
            f"engine returned logits of shape {logits.shape} for {len(input_ids)} tokens; "
            "was it built with prune_lm_head?"
        )
    return np.ascontiguousarray(logits[0], dtype=np.float32)
