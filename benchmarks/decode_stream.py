"""How close cpu_native's decode kernels stream to the memory's speed: one decode step's linears (M = 1 row) over a
model-sized stack of weights, as the bytes per second they read against the probe's read stream on the same threads.

    python benchmarks/decode_stream.py [--layers 24] [--rounds 5]

The stack is the demo student's shape (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64; q/k/v and
gate/up fused as the engine builds them): per layer qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down
1536 -> 576, random weights in the engine's own int4 and int8 layouts (cpu_native.pack_int4 / pack_int8, group 64).
One "token" calls each layer's four kernels in order on the engine's team, the way llama_step does; nothing else
(attention, norms, the head) runs, so the figure is the linears' share of decode alone. Bytes are the buffers the
kernels read (weights, scales, zero points), counted from the arrays themselves. Prints the machine, the probe,
and one RESULT line per width: tokens/s, GB/s and the fraction of the probe, the best and the median of --rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines import cpu_native  # noqa: E402
from edgeflow.engines.cpu_host import device_fingerprint, threads_from_env  # noqa: E402
from edgeflow.estimate.probe import probe  # noqa: E402

HIDDEN, INTER, QKV = 576, 1536, 576 + 2 * 192
SHAPES = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (K, N) per layer, in step order


def stack(width: int, layers: int, rng: np.random.Generator) -> list[tuple[int, int, tuple[np.ndarray, ...]]]:
    out = []
    for _ in range(layers):
        for k, n in SHAPES:
            scales = rng.random((n, k // 64), dtype=np.float32)
            if width == 4:
                packed = cpu_native.pack_int4(rng.integers(0, 16, (n, k), dtype=np.uint8), scales,
                                              rng.integers(0, 16, (n, k // 64), dtype=np.uint8))
            else:
                packed = cpu_native.pack_int8(rng.integers(0, 256, (n, k), dtype=np.uint8), scales,
                                              np.full((n, k // 64), 128, np.uint8))
            out.append((k, n, tuple(np.ascontiguousarray(a) for a in packed)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="the demo student's 24 (the teacher: 30)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per round")
    a = ap.parse_args()
    lib = cpu_native._library()
    threads = threads_from_env()
    team = ctypes.c_void_p(lib.team_create(threads, cpu_native.spin_us_from_env() * 1000))
    ptr = lambda x: x.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    rng = np.random.default_rng(0)
    print("machine:", device_fingerprint())
    limits = probe(threads)
    print(f"probe: read {limits.read_gb_s:.1f} GB/s on {threads} threads")
    x = rng.standard_normal((1, INTER), dtype=np.float32)
    y = np.empty((1, 2 * INTER), np.float32)
    for width in (4, 8):
        layers = stack(width, a.layers, rng)
        nbytes = sum(arr.nbytes for _, _, arrs in layers for arr in arrs)
        fn = lib.q4i_gemm if width == 4 else lib.q8w_gemm
        calls = [(k, n, *(ptr(arr) for arr in arrs)) for k, n, arrs in layers]

        def token() -> None:
            for k, n, w, s, z in calls:
                fn(ptr(x), 1, k, n, w, s, z, ptr(y), team)

        for _ in range(5):
            token()
        rates = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            for _ in range(a.tokens):
                token()
            rates.append(a.tokens / (time.perf_counter() - t))
        best, med = max(rates), statistics.median(rates)
        print(f"RESULT int{width}: {nbytes / 1e6:.1f} MB per token; tok/s best {best:.1f}, median {med:.1f}; "
              f"GB/s best {best * nbytes / 1e9:.1f} ({best * nbytes / 1e9 / limits.read_gb_s:.0%} of the probe), "
              f"median {med * nbytes / 1e9:.1f} ({med * nbytes / 1e9 / limits.read_gb_s:.0%})")
    lib.team_destroy(team)


if __name__ == "__main__":
    main()
