"""Greedy continuations one at a time against all in flight together (tasks.engines.generate_many), per engine.

    python benchmarks/generate_many.py .edgeflow/artifacts/engines/fp32-cpu_native-* \
        .edgeflow/artifacts/engines/gptq-w8a16-cpu_native-* .edgeflow/artifacts/engines/gptq-w4a16-cpu_native-*

The consistency gate's greedy check in the demo's shape: 16 prompts of 20-63 random token ids, 32 new tokens each,
no stop token. For each engine directory (its backend read from engine.json): the seconds for `backend.generate` on
each prompt in turn, then for `generate_many` on all of them, and how many of the 16 continuations are the same.
Prints one RESULT line per engine.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from tasks.engines import generate_many, get_backend  # noqa: E402
from tasks.engines.engine_dir import read_meta  # noqa: E402

PROMPTS = 16
NEW_TOKENS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path, help="engine directories (each holds engine.json)")
    a = ap.parse_args()
    for engine in a.engines:
        if not (engine / "engine.json").exists():
            ap.error(f"{engine}: no engine.json; pass a built engine directory (.edgeflow/artifacts/engines/...)")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, size=int(n)).tolist() for n in rng.integers(20, 64, size=PROMPTS)]
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs")
    for engine in a.engines:
        backend = get_backend(read_meta(engine).backend)
        session = backend.load(engine)
        list(backend.generate(session, prompts[0], 4, []))  # warm: kernels, scratch
        start = time.perf_counter()
        alone = [list(backend.generate(session, p, NEW_TOKENS, [])) for p in prompts]
        t_alone = time.perf_counter() - start
        start = time.perf_counter()
        together = generate_many(backend, session, prompts, NEW_TOKENS, [])
        t_together = time.perf_counter() - start
        same = sum(x == y for x, y in zip(alone, together))
        print(f"RESULT {engine.name} one-at-a-time {t_alone:.1f} s, together {t_together:.1f} s, "
              f"same continuations {same}/{PROMPTS}", flush=True)


if __name__ == "__main__":
    main()
