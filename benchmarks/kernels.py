"""GFLOP/s of cpu_native's fp32, int4 and int8 matrix kernels against numpy's BLAS, in the decoder's shapes.

    python benchmarks/kernels.py

y = x @ W^T for M activation rows (1 and 4: decoding streams; 16: one prefill step, q4.c's STEP_ROWS; 128: a
whole scored sequence) over the demo student's projections: K 576 -> N 1536 (gate/up), K 1536 -> N 576 (down),
K 576 -> N 576 (q/o). Random fp32 weights for f32_gemm and numpy; random 4-bit weights (group 64) for q4i_gemm and
8-bit ones for q8w_gemm, whose FLOP counts are the same (above 4 rows both run their prefill panels). The kernels
run on the engine's own team of threads (all cores, idle workers spinning as in a session); numpy's BLAS on its own. Prints the machine (CPU model, ISA)
and one RESULT line per shape.
"""
from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines import cpu_native  # noqa: E402
from edgeflow.engines.cpu_host import device_fingerprint, threads_from_env  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (576, 576)]
ROWS = [1, 4, 16, 128]


def gflops(fn, m: int, k: int, n: int) -> float:
    """Best of three timings of enough calls for ~2 GFLOP each."""
    reps = max(3, int(2e9 / (2 * m * k * n)))
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    lib = cpu_native._library()
    team = ctypes.c_void_p(lib.team_create(threads_from_env(), cpu_native.spin_us_from_env() * 1000))  # as a session
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    rng = np.random.default_rng(0)
    print("machine:", device_fingerprint())
    for k, n in SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32)
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        wq, sq, zq = cpu_native.pack_int4(q, rng.random((n, k // 64), dtype=np.float32), rng.integers(0, 16, (n, k // 64), dtype=np.uint8))
        q8 = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w8, s8, z8 = cpu_native.pack_int8(q8, rng.random((n, k // 64), dtype=np.float32), np.full((n, k // 64), 128, np.uint8))
        for m in ROWS:
            x = rng.standard_normal((m, k), dtype=np.float32)
            y = np.empty((m, n), np.float32)
            time.sleep(0.5)  # numpy's BLAS threads spin after its last product, on the cores our kernels time
            f32 = gflops(lambda: lib.f32_gemm(ptr(x), m, k, n, ptr(w), ptr(y), team), m, k, n)
            y32 = y.copy()
            q4 = gflops(lambda: lib.q4i_gemm(ptr(x), m, k, n, ptr(wq), ptr(sq), ptr(zq), ptr(y), team), m, k, n)
            q8 = gflops(lambda: lib.q8w_gemm(ptr(x), m, k, n, ptr(w8), ptr(s8), ptr(z8), ptr(y), team), m, k, n)
            err = float(np.abs(y32 - x.astype(np.float64) @ w.T.astype(np.float64)).max())
            blas = gflops(lambda: x @ w.T, m, k, n)
            print(f"RESULT K={k} N={n} M={m}: f32_gemm {f32:.1f} GFLOP/s (max error {err:.1e}), q4i_gemm {q4:.1f}, "
                  f"q8w_gemm {q8:.1f}, numpy {blas:.1f}")
    lib.team_destroy(team)


if __name__ == "__main__":
    main()
