"""Several test-tiny distillations at once, each in its own process, under each torch thread count: wall seconds.

    .venv/bin/python benchmarks/concurrent_distill.py --copies 2 --threads 2 1     # services need not be up

What `make test` does to a 2-core box: its two pytest workers each run a release, and both distill, quantize and
gate at the same moment, in stage processes whose torch uses every core by default. Each copy here is the distill
stage's own function (edgeflow.distill.run.run_distill) on configs/test-tiny.yaml, its converted teacher and corpora,
in a fresh interpreter with EDGEFLOW_TORCH_THREADS set as edgeflow/pipeline/__init__.py applies it, and an empty work
directory (as a host that never distilled this student). `--copies 1` gives the alone figure. Prints a markdown row
per (copies, threads) with each copy's seconds, and the machine (edgeflow/engines/cpu_host.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE = r"""
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import edgeflow.pipeline  # noqa: F401  (the allocator and EDGEFLOW_TORCH_THREADS, as in a stage process)
from transformers import AutoTokenizer
from edgeflow.preflight import load_profile
from edgeflow.distill.run import run_distill
from edgeflow.evaluation.gate import eval_texts
from edgeflow.model.source import teacher_dir
repo = Path(sys.argv[1])
p = load_profile(repo / "configs" / "test-tiny.yaml")
t = teacher_dir(p)
held = eval_texts({k: repo / v for k, v in p.gate.eval_sources.items()}, 24, AutoTokenizer.from_pretrained(t))
work = Path(tempfile.mkdtemp(prefix="concurrent-distill-"))
start = time.perf_counter()
run_distill(t, p.distill, [repo / c for c in p.distill.corpora], held, work / "out", work)
print(f"{time.perf_counter() - start:.1f}")
"""


def run(copies: int, threads: int) -> list[float]:
    env = os.environ | {"EDGEFLOW_TORCH_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([sys.executable, "-c", ONE, str(REPO)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(copies)]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a copy exited {proc.returncode}; run it alone to see why: {sys.executable} -c <ONE> {REPO}")
        out.append(float(stdout.split()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, nargs="+", default=[1, 2], help="processes at once (default: 1, then 2)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="EDGEFLOW_TORCH_THREADS of each (default 2, 1)")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from edgeflow.engines.cpu_host import device_fingerprint

    m = device_fingerprint()
    print(f"machine: {m['cpu_model']}, {m['cores']} cores, ISA {' '.join(m['isa'])}")
    print("| copies at once | torch threads each | seconds of each copy |\n|---|---|---|")
    for copies in a.copies:
        for threads in a.threads:
            wall = time.perf_counter()
            secs = run(copies, threads)
            print(f"| {copies} | {threads} | {', '.join(f'{s:.1f}' for s in secs)} (all done in {time.perf_counter() - wall:.0f} s) |",
                  flush=True)


if __name__ == "__main__":
    main()
