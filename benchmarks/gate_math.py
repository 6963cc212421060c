"""Milliseconds of the consistency gate's numpy work per scored sequence: an engine's logits to log-probabilities,
and the log of its mass outside the reference's top-k (the KL's tail bucket).

    python benchmarks/gate_math.py

The demo's shape: 128 positions over SmolLM2's 49,152-token vocabulary, the reference's top 64. `full` is the sum over
every token outside the top-k (logsumexp_outside, what the gate did before); `gate` is what it does now
(log_mass_outside: log(1 - the k probabilities), the full sum only where that mass is under 1e-6). Both on the same
float64 log-probabilities; prints the largest difference between them and one RESULT line per round.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines.cpu_host import device_fingerprint  # noqa: E402
from edgeflow.evaluation.metrics import log_mass_outside, log_softmax, logsumexp_outside  # noqa: E402

POSITIONS, VOCAB, TOP_K, REPS = 128, 49152, 64, 10


def per_call(fn) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - t) / REPS * 1000


def main() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((POSITIONS, VOCAB)) * 3).astype(np.float32)
    ref = log_softmax(rng.standard_normal((POSITIONS, VOCAB)) * 3)
    ids = np.argsort(-ref, -1)[:, :TOP_K]
    cand = log_softmax(logits)
    diff = float(np.abs(log_mass_outside(cand, ids) - logsumexp_outside(cand, ids)).max())
    print("machine:", device_fingerprint())
    for _ in range(2):
        ls = per_call(lambda: log_softmax(logits))
        full = per_call(lambda: logsumexp_outside(cand, ids))
        gate = per_call(lambda: log_mass_outside(cand, ids))
        print(f"RESULT [{POSITIONS}, {VOCAB}] top-{TOP_K}: log_softmax {ls:.1f} ms, tail full {full:.1f} ms, "
              f"tail gate {gate:.2f} ms (largest difference {diff:.1e})")


if __name__ == "__main__":
    main()
