"""Staging for the tensorrt_llm backend: a checkpoint rewritten as exactly what convert_checkpoint.py reads.

    python -c "from edgeflow.engines.tensorrt_llm.staging import legacy_hf_config; print(legacy_hf_config({}, 'float16'))"

The integers, zero points and scales stay those of the checkpoint (read by edgeflow.engines.checkpoint);
only their layout (AutoGPTQ's) and config.json's spelling (transformers-4 keys) change.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines.checkpoint import (
    QuantizedLayer,
    WeightScheme,
    copy_tokenizer_files,
    gptq_layer,
    layer,
    load_tensors,
    read_config,
    split_tensors,
    unpack_int32_le,
    write_gptq_int4,
)


def legacy_hf_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json as TensorRT-LLM's LLaMAConfig.from_hugging_face reads it (transformers-4 keys, no quantization).

    transformers 5 writes `rope_parameters` and `dtype`; TensorRT-LLM reads `rope_theta` (default 10000.0:
    SmolLM2 uses 100000, a silent wrong RoPE), `rope_scaling` and `torch_dtype` via getattr. The quantization
    is given on the convert command line; an HF `quantization_config` left in place would be re-read by newer
    converters (update_quant_config_from_hf) and override it.
    """
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    rope = out.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in out:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    out.setdefault("torch_dtype", out.get("dtype") or dtype)
    return out


def _stage_dense(tensors: dict[str, np.ndarray], config: dict, dtype: str, out: Path, tied: bool) -> dict[str, Any]:
    """Write a dense HF checkpoint the converter reads (lm_head written out when tied)."""
    from safetensors.numpy import save_file

    add_head = tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    if add_head:  # older converters read lm_head.weight unconditionally; same values as the tied embedding
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(legacy_hf_config(config, dtype), indent=2))
    return {"tensors": len(tensors), "lm_head_written": add_head}


def stage_checkpoint(checkpoint_dir: Path, staging: Path, quant: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Write what convert_checkpoint.py reads for this plan; integers stay exactly those of the checkpoint."""
    checkpoint_dir, staging = Path(checkpoint_dir), Path(staging)
    config = read_config(checkpoint_dir)
    tied = bool(config.get("tie_word_embeddings", False))
    kind, scheme = quant["staging"], quant["scheme"]
    shutil.rmtree(staging, ignore_errors=True)
    if kind == "dense":
        stats = _stage_dense(load_tensors(checkpoint_dir), config, dtype, staging, tied)
    elif kind == "gptq_int4":
        # bit-exact repack to AutoGPTQ's layout (qweight/qzeros(zp-1)/scales/g_idx), the same as the cpu backend's
        stats = write_gptq_int4(checkpoint_dir, staging, _scheme(scheme))
        stats.update(_finish_gptq_staging(staging, config, dtype, tied, bits=4))
    elif kind in ("gptq_int8", "dense_dequantized"):
        tensors = load_tensors(checkpoint_dir)
        dense, prefixes = split_tensors(tensors, checkpoint_dir)
        out: dict[str, np.ndarray] = dict(dense)
        for prefix in prefixes:
            q = layer(tensors, prefix, _scheme(scheme))
            n_out, n_in = q.q.shape
            if kind == "dense_dequantized":
                reps = n_in // q.scale.shape[1]
                out[f"{prefix}.weight"] = (q.q.astype(np.float32) - np.repeat(q.zero, reps, 1)) * np.repeat(q.scale, reps, 1)
                continue
            gs = int(quant["group_size"])
            groups = n_in // gs
            # per-channel scales/zero points repeated over 64-wide groups: the same arithmetic
            scale_g, zp_g = (np.repeat(a, groups, axis=1) if a.shape[1] == 1 else a for a in (q.scale, q.zero))
            if scale_g.shape[1] != groups:
                raise ValueError(f"{prefix}: {q.scale.shape[1]} scale groups cannot be expressed as {groups} groups of {gs}")
            _zp_minus_one(zp_g, 8, prefix)  # a zero point of 0 cannot be stored
            # AutoGPTQ int8 layout as TensorRT-LLM's W8A16_GPTQ loader reads it: qweight int32 [in/4, out]
            # (bytes = q+128 along the input dim, i.e. weight_packed transposed), qzeros int32 [groups, out/4]
            # (bytes = zp-1 along the output dim), scales [groups, out]
            grouped = QuantizedLayer(q=q.q, zero=np.ascontiguousarray(zp_g), scale=np.ascontiguousarray(scale_g))
            out.update({f"{prefix}.{k}": v for k, v in gptq_layer(grouped, 8).items()})
        staging.mkdir(parents=True, exist_ok=True)
        stats = _stage_dense(out, config, dtype, staging, tied)
        stats["linear_layers"] = len(prefixes)
        if kind == "gptq_int8":
            stats.update(_finish_gptq_staging(staging, config, dtype, tied, bits=8))
    else:  # pragma: no cover - quantization_plan only produces the kinds above
        raise ValueError(f"unknown staging kind {kind!r}")
    copy_tokenizer_files(checkpoint_dir, staging)
    return {"kind": kind, **stats}


def _scheme(plan_scheme: dict[str, Any]) -> WeightScheme:
    """The plan's scheme (tensorrt_llm.plan.weight_scheme, a JSON dict in engine.json) as the checkpoint reader's type."""
    return WeightScheme(**plan_scheme)


def _zp_minus_one(zp: np.ndarray, bits: int, prefix: str) -> np.ndarray:
    """GPTQ stores zero point - 1 (the loaders add 1 back); a zero point of 0 cannot be stored."""
    if (zp == 0).any():
        raise ValueError(
            f"{prefix}: {int((zp == 0).sum())} group(s) have unsigned zero point 0, which the GPTQ layout stores as -1 "
            "and TensorRT-LLM reads back as 2**bits; not representable exactly (re-quantize symmetric)"
        )
    return (zp.astype(np.int32) - 1).astype(np.uint8)


def _finish_gptq_staging(staging: Path, config: dict, dtype: str, tied: bool, bits: int) -> dict[str, Any]:
    """Make a GPTQ staging dir converter-ready: engine-dtype scales, explicit lm_head, legacy config.json, zero-point check."""
    from safetensors.numpy import save_file

    tensors = load_tensors(staging)
    scale_dtype = np.float16 if dtype == "float16" else np.float32  # numpy has no bfloat16; the loader casts
    for k in list(tensors):
        if k.endswith(".scales"):
            # the engine computes in `dtype`; TensorRT-LLM's loader casts scales to it too (one rounding)
            tensors[k] = tensors[k].astype(scale_dtype)
        elif k.endswith(".qzeros") and bits == 4:
            stored = unpack_int32_le(tensors[k], 4)
            if (stored == 15).any():  # zp - 1 == -1 -> zero point 0, read back as 16
                raise ValueError(
                    f"{k}: {int((stored == 15).sum())} group(s) have unsigned zero point 0; TensorRT-LLM's GPTQ loader "
                    "reads it as 16 (not representable exactly; re-quantize symmetric)"
                )
    if tied and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(legacy_hf_config(config, dtype), indent=2))
    return {"scales_dtype": np.dtype(scale_dtype).name, "lm_head_written": tied}
