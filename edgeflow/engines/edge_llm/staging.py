"""Staging for the edge_llm backend: a checkpoint rewritten as exactly what Edge-LLM's exporter reads.

    python -c "from edgeflow.engines.edge_llm.staging import edge_llm_dequantize; help(edge_llm_dequantize)"

The exporter (tensorrt_edgellm 0.11.0; read in 0.10.0) takes HF checkpoints: dense float weights, or pre-quantized
ones whose config.json says quant_method "gptq" (AutoGPTQ layout) or "awq", or ModelOpt exports. It does not
read compressed-tensors. So:

* int4 (W4A16, group 128): the stored integers, zero points and scales are rewritten bit-exactly in
  AutoGPTQ's layout by `edgeflow.engines.checkpoint.write_gptq_int4` (qzeros store zero - 1). The exporter
  (tensorrt_edgellm/config.py `_detect_gptq_zero_point_offset`) reads that convention as offset 1 for
  every asymmetric checkpoint and for symmetric ones whose qzeros are not all 8 (ours are all 7), so the
  zero point it uses is the checkpoint's. `repack_gptq_to_plugin` (tensorrt_edgellm/checkpoint/repacking.py)
  then folds it into the nibble, n = clamp(q - zero + 8, 0, 15), and the kernel computes (n - 8) * scale
  with the scale in float16 (GPTQLinear.scales). `check_int4_exact` refuses, per layer, what that formula
  would change: q - zero outside [-8, 7] (asymmetric groups whose range is off-centre) and zero point 0
  (stored zero - 1 wraps to 15).
* dense: float weights written in float16 (the export dtype), config.json without quantization_config.
* dequantized (opt-in): (q - zero) * scale of each quantized linear, then as dense.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines.checkpoint import (
    InexactWeights,
    QuantizedLayer,
    WeightScheme,
    copy_tokenizer_files,
    layer,
    layer_scheme,
    load_tensors,
    read_config,
    split_tensors,
    write_gptq_int4,
)
from edgeflow.engines.edge_llm.plan import INT4_CENTERED_RANGE


def edge_llm_dequantize(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """What Edge-LLM's int4 path computes from GPTQ integers: (clamp(q - zero + 8, 0, 15) - 8) * fp16(scale).

    q [out, in] and zero [out, groups] unsigned as the GPTQ loader sees them (zero = stored + 1);
    scale [out, groups]. Formula: tensorrt_edgellm/checkpoint/repacking.py repack_gptq_to_plugin (nibble
    adjust + clamp) and the int4 GEMM's (n - 8) * scale with float16 scales (models/linear.py GPTQLinear).
    """
    zeros = np.repeat(zero.astype(np.int64), group_size, axis=1)
    n = np.clip(q.astype(np.int64) - zeros + 8, 0, 15)
    scales = np.repeat(scale.astype(np.float16).astype(np.float32), group_size, axis=1)
    return (n - 8).astype(np.float32) * scales


def check_int4_exact(prefix: str, q: QuantizedLayer) -> None:
    """InexactWeights (naming the layer, the count and the fix) unless Edge-LLM's int4 formula keeps every weight."""
    lo, hi = INT4_CENTERED_RANGE
    if (q.zero == 0).any():
        raise InexactWeights(
            f"{prefix}: {int((q.zero == 0).sum())} group(s) have unsigned zero point 0, which AutoGPTQ's layout stores "
            "as zero-1 = -1 (nibble 15) and Edge-LLM's exporter reads back as 16; not representable. Fix: re-quantize "
            "symmetric, or profile inexact_weights: dequantize"
        )
    centred = q.q.astype(np.int16) - np.repeat(q.zero.astype(np.int16), q.group_size, axis=1)
    outside = (centred < lo) | (centred > hi)
    if outside.any():
        raise InexactWeights(
            f"{prefix}: {int(outside.sum())} weight(s) have q - zero outside [{lo}, {hi}] (range "
            f"[{int(centred.min())}, {int(centred.max())}]); Edge-LLM's int4 kernel has no zero point and its exporter "
            "clamps q - zero + 8 to [0, 15] (repacking.py repack_gptq_to_plugin), which would change them. Fix: "
            "re-quantize symmetric (GPTQ/RTN with symmetric: true), or profile inexact_weights: dequantize"
        )


def _config_without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _write_dense(tensors: dict[str, np.ndarray], config: dict[str, Any], out: Path) -> dict[str, Any]:
    """A dense HF checkpoint the exporter reads: float tensors in float16 (its --dtype), no quantization_config."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    # the engine computes in float16: one rounding here, visible in the staged file, instead of in the exporter
    cast = {k: (v.astype(np.float16) if np.issubdtype(v.dtype, np.floating) else v) for k, v in tensors.items()}
    save_file({k: np.ascontiguousarray(v) for k, v in cast.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config_without_quantization(config), indent=2))
    return {"tensors": len(cast), "dtype": "float16"}


def stage_checkpoint(checkpoint_dir: Path, staging: Path, quant: dict[str, Any]) -> dict[str, Any]:
    """Write what the exporter reads for this plan (`quant` from plan.quantization_plan); returns what was written."""
    checkpoint_dir, staging = Path(checkpoint_dir), Path(staging)
    config = read_config(checkpoint_dir)
    kind = quant["staging"]
    shutil.rmtree(staging, ignore_errors=True)
    if kind == "dense":
        stats = _write_dense(load_tensors(checkpoint_dir), config, staging)
    elif kind == "dequantized":
        tensors = load_tensors(checkpoint_dir)
        dense, prefixes = split_tensors(tensors, checkpoint_dir)
        schemes = _schemes(config)
        out = dict(dense)
        for prefix in prefixes:
            q = _any_layer(tensors, prefix, schemes)
            reps = q.q.shape[1] // q.scale.shape[1]
            out[f"{prefix}.weight"] = ((q.q.astype(np.float32) - np.repeat(q.zero, reps, 1).astype(np.float32))
                                       * np.repeat(q.scale, reps, 1))
        stats = _write_dense(out, config, staging) | {"linear_layers": len(prefixes)}
    elif kind == "gptq_int4":
        scheme = WeightScheme(**quant["scheme"])
        tensors = load_tensors(checkpoint_dir)
        _, prefixes = split_tensors(tensors, checkpoint_dir)
        for prefix in prefixes:  # refuse before writing anything the exporter would change
            check_int4_exact(prefix, layer(tensors, prefix, scheme))
        del tensors
        # norms, biases and embeddings in float16 too, what the Orin kernels compute in: left float32 (edgeflow's
        # students are saved so), tensorrt-edgellm 0.11.0's exporter traced float32 activations into its int4
        # linears and stopped ("GPTQLinear expects float16 input, got torch.float32")
        stats = write_gptq_int4(checkpoint_dir, staging, scheme, dense_dtype=np.float16)
    else:  # pragma: no cover - quantization_plan only produces the kinds above
        raise ValueError(f"unknown staging kind {kind!r}")
    copy_tokenizer_files(checkpoint_dir, staging)
    return {"kind": kind, **stats}


def _schemes(config: dict[str, Any]) -> dict[str, WeightScheme]:
    from edgeflow.engines.checkpoint import weight_schemes

    return weight_schemes(config, engine="edge_llm") or {}


def _any_layer(tensors: dict[str, np.ndarray], prefix: str, schemes: dict[str, WeightScheme]) -> QuantizedLayer:
    """The layer read with the config group's scheme its stored shapes match (mixed W8/W4 recipes have several)."""
    return layer(tensors, prefix, layer_scheme(tensors, prefix, schemes))
