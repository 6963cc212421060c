"""What llama.cpp's blocks hold exactly (Q4_0, Q4_1, Q8_0) and the checkpoint's integers written as those blocks
(the layouts of ggml-common.h), with the RoPE row order llama.cpp expects.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines.checkpoint import InexactWeights, QuantizedLayer, WeightScheme, read_config, weight_schemes

from edgeflow.engines.llama_cpp.settings import BACKEND, BLOCK, GGUF_ARCH, INTERLEAVED_ROPE


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
