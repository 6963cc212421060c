"""Where the native CPU engine's time goes, for 1 and 2 concurrent streams.

    python benchmarks/engine_profile.py --quantized INT4_DIR --tokens 128 [--perf]

1. The engine's own profile (`session.stats`, kept by its scheduler): per decode step, the layer stack
   (`llama_step`), the exact-argmax lm_head (`head_argmax`) and the scheduler's Python; prefill apart.
2. The lm_head alone at one row: the exact int8-bound head vs one full fp32 pass over the vocabulary
   (what the head would cost without the int8 copy).
3. Two streams batched in one session (2 threads) vs one 1-thread session per stream, alternating.
4. With --perf (and `perf` on PATH): the 1-stream workload sampled by `perf record` (attached after
   loading and warm-up), CPU samples
   grouped by what they run: the int4 body GEMV, the int8 head pass, the rest of the C step, OpenMP
   wake-ups, the Python interpreter, numpy, the kernel.
Prints markdown tables, then the raw numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from edgeflow.engines import cpu_native  # noqa: E402
from edgeflow.engines.cpu_host import THREADS_ENV  # noqa: E402

PROMPT = list(range(100, 143))  # 43 token ids: the length of the benchmark's chat prompt

# perf symbol -> what it is (first match wins)
GROUPS = (
    (r"^(q4i_|q4a_)|^quantize_rows$", "int4 body GEMV (q4i_*)"),
    (r"^(q8i_|q8a_|quantize_rows_1)", "lm_head int8 pass (q8i_*)"),
    (r"^f32_", "fp32 GEMV (f32_*)"),
    (r"^(head_argmax|dotK)", "lm_head bound, candidates, fp32 rescoring"),
    (r"^llama_step|^rmsnorm|^rope|^__expf|^expf|^exp8", "rest of the layer step (attention, norms, RoPE, SiLU)"),
    (r"^(gomp_|GOMP_|omp_)|libgomp", "OpenMP fork/join and waits"),
    (r"^\[k\]|kernel", "kernel (futex wake-ups, page faults)"),
    (r"^(_Py|Py|_PyEval|gc_|visit_|unicode|dict|list_|tuple|long_|frame|method|cfunction)|libpython|python3", "Python interpreter"),
    (r"numpy|^PyArray|^npy_|^array_|blas", "numpy"),
)


def concurrent_wall(sessions: list, n: int) -> float:
    """Seconds for one generate() call of n tokens per entry of `sessions`, all at once (a thread each)."""

    def one(session) -> None:
        got = list(cpu_native.generate(session, PROMPT, n, []))
        assert len(got) == n

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def run_streams(session, k: int, n: int) -> dict:
    """k concurrent generate() calls of n tokens on one session; the scheduler's stats for exactly this run."""
    for key in session.stats:
        session.stats[key] = 0
    wall = concurrent_wall([session] * k, n)
    st = dict(session.stats)
    steps = st["scheduler_steps"]
    return {
        "streams": k, "tokens": n * k, "wall_s": wall, "tok_s": n * k / wall, "steps": steps,
        "prefill_ms": st["prefill_ns"] / 1e6, "layers_ms_per_step": st["layers_ns"] / steps / 1e6,
        "head_ms_per_step": st["head_ns"] / steps / 1e6, "scheduler_ms_per_step": st["scheduler_ns"] / steps / 1e6,
        "unaccounted_ms": wall * 1e3 - (st["prefill_ns"] + st["layers_ns"] + st["head_ns"] + st["scheduler_ns"]) / 1e6,
        "mean_candidates": st["candidates"] / max(st["head_calls"], 1), "full_passes": st["full_passes"],
    }


def batched_vs_sessions(engine: Path, session, n: int, repeats: int) -> dict:
    """Median aggregate tok/s: 1 stream; 2 streams batched in `session`; 2 streams with a 1-thread session each."""
    old = os.environ.get(THREADS_ENV)
    os.environ[THREADS_ENV] = "1"  # read once, at load
    try:
        solo = [cpu_native.load(engine) for _ in range(2)]
    finally:
        if old is None:
            del os.environ[THREADS_ENV]
        else:
            os.environ[THREADS_ENV] = old

    def aggregate(sessions: list) -> float:
        return n * len(sessions) / concurrent_wall(sessions, n)

    for s in solo:
        list(cpu_native.generate(s, PROMPT, 4, []))
    runs: dict[str, list[float]] = {"one_stream": [], "two_batched": [], "two_sessions_1_thread": []}
    for _ in range(repeats):
        runs["one_stream"].append(aggregate([session]))
        runs["two_batched"].append(aggregate([session, session]))
        runs["two_sessions_1_thread"].append(aggregate(solo))
    return {k: float(np.median(v)) for k, v in runs.items()} | {"runs": runs}


def head_costs(session, repeats: int = 200) -> dict:
    """ms per call at one row: exact int8-bound head vs the full fp32 pass (max_candidates=0)."""
    dec = cpu_native._Decoder(session, 1, len(PROMPT) + 1)
    x = dec.prefill(PROMPT, 0)[-1:]
    out = {}
    for name, cap in (("int8_bound_ms", None), ("full_fp32_ms", 0)):
        cpu_native.head_argmax(session, x, cap, buffers=dec.head)
        t = time.perf_counter()
        for _ in range(repeats):
            cpu_native.head_argmax(session, x, cap, buffers=dec.head)
        out[name] = (time.perf_counter() - t) / repeats * 1e3
    return out


def perf_profile(engine: Path, n: int, repeats: int) -> list[tuple[str, float]]:
    """Sample the 1-stream workload with `perf record` (attached after load and warm-up, so imports and
    weight loading are not counted); CPU sample shares per group."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        subprocess.run([sys.executable, __file__, "--engine", str(engine), "--tokens", str(n), "--repeats", str(repeats),
                        "--workload-only", str(data)], check=True, stdout=subprocess.DEVNULL)
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol", "--stdio"],
                                capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[([.k])\]\s+(\S+)", line)
        if not m:
            continue
        pct, dso, kind, sym = float(m.group(1)), m.group(2), m.group(3), m.group(4)
        label = "[k]" if kind == "k" else sym
        group = next((g for pat, g in GROUPS if re.search(pat, label) or re.search(pat, dso)), "other")
        shares[group] = shares.get(group, 0.0) + pct
    return sorted(shares.items(), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--quantized", type=Path, help="llm-compressor int4 checkpoint (an engine is built from it)")
    src.add_argument("--engine", type=Path, help="an existing cpu_native engine directory")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="runs per stream count (the median-throughput run is shown)")
    ap.add_argument("--perf", action="store_true", help="also sample the 1-stream run with `perf record`")
    ap.add_argument("--workload-only", type=Path, default=None, help=argparse.SUPPRESS)  # perf.data path
    args = ap.parse_args(argv)

    work = None
    engine = args.engine
    if engine is None:
        work = Path(tempfile.mkdtemp(prefix="edgeflow-profile-"))
        engine = work / "engine"
        cpu_native.build(args.quantized, engine, {})
    session = cpu_native.load(engine)
    list(cpu_native.generate(session, PROMPT, 4, []))  # warm-up
    if args.workload_only:
        import signal

        perf = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-p", str(os.getpid()), "-o", str(args.workload_only)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches asynchronously
        for _ in range(args.repeats):
            run_streams(session, 1, args.tokens)
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
        return {}

    results: dict = {"command": "python benchmarks/engine_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
                     "threads": session.threads, "loadavg_start": os.getloadavg(), "runs": []}
    for k in (1, 2):
        runs = sorted((run_streams(session, k, args.tokens) for _ in range(args.repeats)), key=lambda r: r["tok_s"])
        results["runs"].append(runs[len(runs) // 2])
    results["head"] = head_costs(session)
    results["streams"] = batched_vs_sessions(engine, session, args.tokens, args.repeats)
    if args.perf and shutil.which("perf"):
        results["perf"] = perf_profile(engine, args.tokens, args.repeats)
    results["loadavg_end"] = os.getloadavg()
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)

    print(render(results))
    print("\n```json\n" + json.dumps(results, indent=1) + "\n```")
    return results


def render(r: dict) -> str:
    lines = [
        f"{r['threads']} engine threads; load average {r['loadavg_start'][0]:.1f} at start, {r['loadavg_end'][0]:.1f} at end.",
        "",
        "| streams | tok/s | prefill ms | layers ms/step | lm_head ms/step | scheduler ms/step | steps | mean head candidates |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["runs"]:
        lines.append(f"| {x['streams']} | {x['tok_s']:.1f} | {x['prefill_ms']:.0f} | {x['layers_ms_per_step']:.2f} | "
                     f"{x['head_ms_per_step']:.2f} | {x['scheduler_ms_per_step']:.2f} | {x['steps']} | {x['mean_candidates']:.1f} |")
    h = r["head"]
    lines += ["", f"lm_head at one row: exact int8-bound head {h['int8_bound_ms']:.2f} ms vs one full fp32 pass "
                  f"{h['full_fp32_ms']:.2f} ms ({h['full_fp32_ms'] / h['int8_bound_ms']:.1f}x)."]
    b = r["streams"]
    lines += ["", f"Two streams, median of alternating runs: 1 stream {b['one_stream']:.1f} tok/s; batched in one session "
                  f"{b['two_batched']:.1f} ({b['two_batched'] / b['one_stream']:.2f}x); a 1-thread session each "
                  f"{b['two_sessions_1_thread']:.1f} ({b['two_sessions_1_thread'] / b['one_stream']:.2f}x)."]
    if "perf" in r:
        lines += ["", "| perf samples, 1 stream | share |", "|---|---:|"]
        lines += [f"| {g} | {pct:.1f}% |" for g, pct in r["perf"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
