"""Greedy continuations one at a time against all in flight together (edgeflow.engines.generate_many), per engine,
and the gate reference's FP side (HFScorer.greedy) one prompt at a time against one batch.

    python benchmarks/generate_many.py .edgeflow/artifacts/engines/fp32-cpu_native-* \
        .edgeflow/artifacts/engines/gptq-w8a16-cpu_native-* .edgeflow/artifacts/engines/gptq-w4a16-cpu_native-*
    python benchmarks/generate_many.py --hf ~/.cache/edgeflow/models/teacher-*     # a transformers model directory

The consistency gate's greedy check in the demo's shape: 16 prompts of 20-63 random token ids, 32 new tokens each,
no stop token. For each engine directory (its backend read from engine.json): the seconds for `backend.generate` on
each prompt in turn, then for `generate_many` on all of them, and how many of the 16 continuations are the same.
Prints one RESULT line per engine or model.
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

from edgeflow.engines import generate_many, get_backend  # noqa: E402
from edgeflow.engines.engine_dir import read_meta  # noqa: E402

PROMPTS = 16
NEW_TOKENS = 32


def both_ways(alone, together) -> str:
    """Time alone() (one prompt at a time) and together() (all at once); how long each took and how many of the
    continuations they give are the same."""
    start = time.perf_counter()
    one_by_one = alone()
    t_alone = time.perf_counter() - start
    start = time.perf_counter()
    at_once = together()
    t_together = time.perf_counter() - start
    same = sum(x == y for x, y in zip(one_by_one, at_once))
    return f"one at a time {t_alone:.1f} s, together {t_together:.1f} s, same continuations {same}/{PROMPTS}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="*", type=Path, help="engine directories (each holds engine.json)")
    ap.add_argument("--hf", nargs="*", type=Path, default=[], help="transformers model directories (HFScorer.greedy)")
    a = ap.parse_args()
    if not a.engines and not a.hf:
        ap.error("pass engine directories, --hf model directories, or both")
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
        print(f"RESULT {engine.name}", both_ways(
            lambda: [list(backend.generate(session, p, NEW_TOKENS, [])) for p in prompts],
            lambda: generate_many(backend, session, prompts, NEW_TOKENS, [])), flush=True)
    for model in a.hf:
        from edgeflow.evaluation.reference import HFScorer

        scorer = HFScorer(model)
        scorer.greedy(prompts[:1], 2, [])  # warm
        print(f"RESULT hf:{model.name}", both_ways(lambda: [scorer.greedy([p], NEW_TOKENS, [])[0] for p in prompts],
                                                   lambda: scorer.greedy(prompts, NEW_TOKENS, [])), flush=True)


if __name__ == "__main__":
    main()
