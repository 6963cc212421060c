"""Prefill speed of cpu_native engines by prompt length, and decoding after a long prompt, engines side by side.

    python benchmarks/prefill.py --engine ENGINE_DIR [--engine OTHER_DIR[@CODE_DIR]] --rounds 3

Per engine and prompt length (--lengths, default 128, 512 and 1,024 tokens of random ids): the time to the first
token, best of 3, as prompt tokens per second; then --long-decode new tokens greedy after a --long-prompt prompt, best
of 3, tok/s after the first token. Every engine runs in a fresh process per round and rounds alternate, so the
machine's drift falls on every engine alike. `DIR@CODE_DIR` loads that engine with another edgeflow tree's
cpu_native (a checkout of another commit, e.g. `git worktree add /tmp/before HEAD~1`), to set two kernel versions
side by side: each engine must have been built by the tree that loads it. Prints the machine and a markdown table of
the medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with the chosen tree first on sys.path: argv = code_dir engine lengths long_prompt long_decode
_MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import numpy as np
from edgeflow.engines import get_backend
b = get_backend("cpu_native"); s = b.load(Path(sys.argv[2]))
rng = np.random.default_rng(0)
out = {}
for n in json.loads(sys.argv[3]):
    ids = [int(x) for x in rng.integers(100, 40000, n)]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in b.generate(s, ids, 1, []):
            break
        best = min(best, time.perf_counter() - t0)
    out[f"prefill {n}"] = n / best
ids = [int(x) for x in rng.integers(100, 40000, int(sys.argv[4]))]
best = 0.0
for _ in range(3):
    t0, n = None, 0
    for _ in b.generate(s, ids, int(sys.argv[5]), []):
        n += 1
        t0 = t0 or time.perf_counter()
    best = max(best, (n - 1) / (time.perf_counter() - t0))
out[f"decode after {sys.argv[4]}"] = best
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", required=True, help="a cpu_native engine dir, optionally DIR@CODE_DIR")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    ap.add_argument("--lengths", default="128,512,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--long-prompt", type=int, default=1500, help="prompt tokens before the decoding measurement")
    ap.add_argument("--long-decode", type=int, default=65, help="tokens generated after --long-prompt")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    runs = {e: [] for e in a.engine}
    for r in range(a.rounds):
        for e in a.engine:
            engine, _, code = e.partition("@")
            p = subprocess.run([sys.executable, "-c", _MEASURE, code or str(ROOT), engine, json.dumps(lengths),
                                str(a.long_prompt), str(a.long_decode)], capture_output=True, text=True, cwd=code or ROOT)
            if p.returncode:
                sys.exit(f"{e}: exit {p.returncode}: {p.stderr.strip()[-800:]}")
            runs[e].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {e}: {runs[e][-1]}", flush=True)
    sys.path.insert(0, str(ROOT))
    from edgeflow.engines.cpu_host import device_fingerprint

    print("\nmachine:", device_fingerprint())
    cols = list(runs[a.engine[0]][0])
    print("\n| engine | " + " | ".join(f"{c} (tok/s)" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for e, rs in runs.items():
        print(f"| {e} | " + " | ".join(f"{statistics.median(x[c] for x in rs):.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
