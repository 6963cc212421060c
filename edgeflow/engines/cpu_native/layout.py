"""How weights are stored for the kernels: int4 packed in 16-bit words with their scales and zero points, int8
rows, and the int8 head with its per-row scales.
"""
from __future__ import annotations

import numpy as np

from edgeflow.engines.cpu_native.settings import GROUP


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


def pack_int8(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q uint8 [N, K] as stored (signed + 128), s fp32 [N, K/64], z uint8 [N, K/64] -> the q8w_gemm layout: w int8
    = q - 128, s, z int16 = z - 128 (w - z = q - z exactly)."""
    return (np.ascontiguousarray((q.astype(np.int16) - 128).astype(np.int8)), np.ascontiguousarray(s, np.float32),
            np.ascontiguousarray(z.astype(np.int16) - 128))
