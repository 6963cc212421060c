"""Service objectives measured on a built engine, on the host that built it (the consistency gate's engine half): each
slo.targets[] entry (edgeflow/profile/slo.py) this host can stand for, against the engine as a server would run it.

    python -m edgeflow.evaluation.service ENGINE_DIR BACKEND --prompt 128 --concurrency 2 [--decode-tok-s 50 ...]

What is measured, for an engine in this process's memory in a Python process of its own (as the edge server runs it:
its footprint is then its own, and no other session's threads share the cores), and for one on a device of its own on
the gate's session (a second copy may not fit there):
- TTFT p99: at least MIN_TTFT_REQUESTS prompts of exactly `prompt_tokens` tokens, `concurrency` of them arriving
  together (the estimate's definition, edgeflow/estimate/roofline.py), each timed from the round's start to its first
  token; the 99th percentile of all of them (nearest rank: with 20 requests, the slowest).
- Decode per stream, p50: DECODE_TOKENS new tokens after such a prompt, one stream alone (three runs) and `concurrency`
  streams together (two rounds); the median of the per-stream rates, each counted from the stream's first token.
- Peak memory: what the engine holds at its most over its load and all of the above. A backend on a device of its own
  reports it (device_memory_used); an engine in the process's memory is the rise of the process's peak resident set
  (Linux VmHWM, reset before the load through /proc/self/clear_refs, else VmRSS sampled every 5 ms) over its resident
  set before the load (Python and the libraries already imported).

Prompts are cut from the gate's held-out sequences laid end to end, at different offsets, so no prompt is a prefix of
another. A target is measured where the engine runs on that target's kind of device and the consistency stage runs on
the target's pool (`targets_here`); elsewhere the row says why it was not, and the plan's estimate stands.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from edgeflow.profile.devices import device_class
from edgeflow.profile.slo import SLOTarget

MIN_TTFT_REQUESTS = 20
DECODE_TOKENS = 64
SOLO_RUNS = 3
SHARED_ROUNDS = 2


def runs_on_device(backend) -> bool:
    """True for a backend whose engine lives on a device of its own (it implements device_memory_used); False for one in
    this process's memory and CPU (it exports edgeflow.engines.hooks' default)."""
    from edgeflow.engines import hooks

    return backend.device_memory_used is not hooks.device_memory_used


def targets_here(targets: list[SLOTarget], backend_name: str, pool: str) -> tuple[list[SLOTarget], list[dict[str, Any]]]:
    """(the targets this host measures, one {device, pool, not_measured} per target it cannot): a target is measured
    where it is served by this engine's backend (its slo runtime, if set, is `backend_name`), the engine's kind of
    device is the target's (a CPU engine for x86-cpu, a GPU engine for a GPU class) and the consistency stage runs on
    the target's pool (`pool`: placement.consistency; a target without a pool: any)."""
    from edgeflow.engines import get_backend

    on_device = runs_on_device(get_backend(backend_name))
    here, elsewhere = [], []
    for t in targets:
        cpu_target = device_class(t.device, "slo.targets[].device").kind == "cpu"
        if t.runtime is not None and t.runtime != backend_name:
            why = (f"{t.device} is served by {t.runtime} and the gate measured {backend_name} engines: the estimate "
                   "stands until it runs there")
        elif cpu_target == on_device:
            why = (f"the engine runs on a {'GPU' if on_device else 'CPU'} and {t.device} is "
                   f"{'a CPU' if cpu_target else 'a GPU'}: the estimate stands until it runs on one")
        elif t.pool is not None and t.pool != pool:
            why = f"the gate ran on {'the release host' if pool == 'inline' else f'pool {pool}'}, not on pool {t.pool}"
        else:
            here.append(t)
            continue
        elsewhere.append({"device": t.device, "pool": t.pool, "not_measured": why})
    return here, elsewhere


def prompts_of(seqs: list[list[int]], length: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, cut at different offsets from `seqs` laid end to end (repeated
    while shorter than one prompt plus `count` offsets)."""
    flat = [t for s in seqs for t in s]
    if not flat:
        raise ValueError("no held-out tokens to make prompts of; check gate.eval_sources")
    while len(flat) < length + count:
        flat = flat + flat
    stride = max(1, (len(flat) - length) // count)
    return [flat[i * stride : i * stride + length] for i in range(count)]


class _Footprint:
    """The engine's peak resident memory, MB, in this process (see the module doc)."""

    def __init__(self):
        self.base = _status_kb("VmRSS")
        self.peak_kb = self.base
        self._stop = threading.Event()
        self._sampler = None
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        except OSError:
            self._sampler = threading.Thread(target=self._sample, name="slo-rss", daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_kb = max(self.peak_kb, _status_kb("VmRSS"))

    def mb(self) -> float:
        if self._sampler is None:
            self.peak_kb = _status_kb("VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
        return max(0.0, self.peak_kb - self.base) * 1024 / 1e6


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def measure_speed(backend, session, prompt_ids: list[int], n_tokens: int = 64, sampling=None,
                  t0: float | None = None) -> dict[str, float]:
    """Decode tok/s and time to first token of one generation (no stop tokens): greedy, or with `sampling`. `t0`: when
    the request counts as sent (perf_counter; default: now), e.g. the start of a round of requests sent together."""
    t0 = time.perf_counter() if t0 is None else t0
    first = None
    count = 0
    for _ in backend.generate(session, prompt_ids, n_tokens, [], sampling):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    decode = (count - 1) / (end - first) if count > 1 else 0.0
    return {"decode_tok_s": decode, "ttft_ms": 1000 * ((first or end) - t0), "speed_tokens": count}


def _round(backend, session, prompts: list[list[int]], new_tokens: int) -> list[tuple[float, float | None]]:
    """The prompts sent together; each one's (TTFT s, decode tok/s or None after a single token)."""
    def one(prompt: list[int]) -> tuple[float, float | None]:
        got = measure_speed(backend, session, prompt, new_tokens, t0=t0)
        if not got["speed_tokens"]:
            raise ValueError(f"the engine generated no token after a {len(prompt)}-token prompt")
        return got["ttft_ms"] / 1000, got["decode_tok_s"] or None

    with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="slo") as pool:
        t0 = time.perf_counter()
        return list(pool.map(one, prompts))


def p99(values: list[float]) -> float:
    """The 99th percentile, nearest rank (the slowest of fewer than 100)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(0.99 * len(ranked)) - 1)]


def measure(backend, engine_dir: Path, target: SLOTarget, seqs: list[list[int]],
            requests: int = MIN_TTFT_REQUESTS, session: Any = None) -> dict[str, Any]:
    """The engine's figures at the target's workload (see the module doc): ttft_p99_ms, ttft_p50_ms, decode_tok_s
    (p50 per stream at the target's concurrency), decode_tok_s_solo (p50, one stream), peak_memory_mb, requests.
    `session`: an engine on a device of its own already loaded (the gate's), measured as it is instead of loading a
    second copy the device may not hold; an engine in this process's memory is always loaded afresh, so that its
    footprint is its own."""
    n = target.concurrency
    rounds = max(1, math.ceil(requests / n))
    prompts = prompts_of(seqs, target.prompt_tokens, rounds * n)
    new = min(DECODE_TOKENS, target.max_new_tokens)
    gc.collect()
    footprint = _Footprint()
    own = session is None or not runs_on_device(backend)
    if own:
        session = backend.load(Path(engine_dir))
    try:
        _round(backend, session, prompts[:1], 2)  # warm-up: no figure pays for the first call
        ttft = [s for r in range(rounds) for s, _ in _round(backend, session, prompts[r * n : (r + 1) * n], 1)]
        solo = [_round(backend, session, [prompts[i % len(prompts)]], new)[0][1] for i in range(SOLO_RUNS)]
        shared = [rate for r in range(SHARED_ROUNDS) for _, rate in _round(backend, session, prompts[r * n : (r + 1) * n], new)]
        on_device = backend.device_memory_used(session)
    finally:
        local = footprint.mb()
        if own:
            del session
            gc.collect()
    rates = [r for r in shared if r is not None]
    solo_rates = [r for r in solo if r is not None]
    return {
        "ttft_p99_ms": round(1000 * p99(ttft), 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        "decode_tok_s": round(statistics.median(rates), 1) if rates else None,
        "decode_tok_s_solo": round(statistics.median(solo_rates), 1) if solo_rates else None,
        "peak_memory_mb": round(on_device / 1e6 if on_device is not None else local, 1),
        "memory_source": "device_memory_used" if on_device is not None else "process peak RSS rise",
        "requests": len(ttft),
    }


def misses(measured: dict[str, Any], target: SLOTarget) -> list[str]:
    """Which of the target's objectives the measured figures miss, each with the figure, the objective and by how much."""
    out = []
    where = f"{target.prompt_tokens} prompt tokens, concurrency {target.concurrency}"
    if target.ttft_p99_ms is not None and measured["ttft_p99_ms"] > target.ttft_p99_ms:
        over = measured["ttft_p99_ms"] / target.ttft_p99_ms - 1
        out.append(f"TTFT p99 {measured['ttft_p99_ms']:,.0f} ms > {target.ttft_p99_ms:g} ms ({over:.0%} over; "
                   f"{measured['requests']} requests, {where})")
    if target.decode_tok_s is not None and (measured["decode_tok_s"] or 0.0) < target.decode_tok_s:
        short = 1 - (measured["decode_tok_s"] or 0.0) / target.decode_tok_s
        out.append(f"decode {measured['decode_tok_s'] or 0:,.1f} tok/s per stream (p50) < {target.decode_tok_s:g} tok/s "
                   f"({short:.0%} short; {where})")
    if target.max_memory_mb is not None and measured["peak_memory_mb"] > target.max_memory_mb:
        over = measured["peak_memory_mb"] / target.max_memory_mb - 1
        out.append(f"peak memory {measured['peak_memory_mb']:,.0f} MB > {target.max_memory_mb:g} MB ({over:.0%} over; "
                   f"{measured['memory_source']}, {where})")
    return out


def measure_alone(backend_name: str, engine_dir: Path, target: SLOTarget, seqs: list[list[int]],
                  requests: int = MIN_TTFT_REQUESTS, timeout_s: float = 1800) -> dict[str, Any]:
    """`measure` in a Python process of its own (this module's command line), as the edge server runs one engine:
    the footprint is then the engine's, not what the gate's own allocations happen to leave free (the gate holds every
    variant's engine at once: there a fresh int4 engine's peak rose 193 MB against 387 MB in a process of its own),
    and no other session's threads share the cores. ValueError with the engine's reason when it refuses the workload."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="edgeflow-slo-") as tmp:
        (Path(tmp) / "seqs.json").write_text(json.dumps(seqs))
        args = [sys.executable, "-m", "edgeflow.evaluation.service", str(engine_dir), backend_name,
                "--device", target.device, "--prompt", str(target.prompt_tokens), "--concurrency", str(target.concurrency),
                "--new-tokens", str(target.max_new_tokens), "--requests", str(requests),
                "--seqs", str(Path(tmp) / "seqs.json"), "--measure-only"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode == EXIT_REFUSED:
        raise ValueError(done.stderr.strip().splitlines()[-1].removeprefix(f"{PROG}: "))
    if done.returncode != 0:
        raise RuntimeError(f"measuring {engine_dir} in a process of its own failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)["measured"]


def check_targets(backend_name: str, engine_dir: Path, here: list[SLOTarget], seqs: list[list[int]],
                  session: Any = None) -> list[dict[str, Any]]:
    """Each target measured on the engine: {device, pool, objectives, measured, misses}; a prompt the engine refuses
    (ValueError, e.g. longer than it takes) is a miss that names the engine's reason. An engine in this process's
    memory is measured in a process of its own (measure_alone); one on a device of its own on `session`, the gate's."""
    from edgeflow.engines import get_backend

    backend = get_backend(backend_name)
    out = []
    for t in here:
        objectives = t.model_dump(include={"prompt_tokens", "concurrency", "max_new_tokens", "ttft_p99_ms",
                                           "decode_tok_s", "max_memory_mb"})
        try:
            got = (measure(backend, engine_dir, t, seqs, session=session) if runs_on_device(backend)
                   else measure_alone(backend_name, engine_dir, t, seqs))
        except ValueError as e:
            out.append({"device": t.device, "pool": t.pool, "objectives": objectives, "measured": None,
                        "misses": [f"the engine cannot serve the workload: {e}"]})
            continue
        out.append({"device": t.device, "pool": t.pool, "objectives": objectives, "measured": got, "misses": misses(got, t)})
    return out


PROG = "python -m edgeflow.evaluation.service"
EXIT_REFUSED = 3  # the engine refused the workload (a ValueError): its message is the last line of stderr


def main(argv: list[str] | None = None) -> None:
    import sys

    from edgeflow.engines import get_backend

    ap = argparse.ArgumentParser(prog=PROG, description="Measure one engine against one service objective (see the module doc).")
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("backend")
    ap.add_argument("--device", default="x86-cpu")
    ap.add_argument("--prompt", type=int, required=True, help="prompt tokens")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens of the target (decode runs min(64, this))")
    ap.add_argument("--ttft-p99-ms", type=float)
    ap.add_argument("--decode-tok-s", type=float)
    ap.add_argument("--max-memory-mb", type=float)
    ap.add_argument("--requests", type=int, default=MIN_TTFT_REQUESTS)
    ap.add_argument("--seqs", type=Path, help="JSON list of token-id lists to cut the prompts from (default: ids 100, 101, "
                    "...; speed does not depend on which)")
    ap.add_argument("--measure-only", action="store_true", help="no objective needed: print the figures only")
    a = ap.parse_args(argv)
    objectives = (a.ttft_p99_ms, a.decode_tok_s, a.max_memory_mb)
    if a.measure_only and not any(objectives):
        objectives = (None, None, float("inf"))  # a target needs one objective; this one every engine meets
    target = SLOTarget(device=a.device, prompt_tokens=a.prompt, concurrency=a.concurrency, max_new_tokens=a.new_tokens,
                       ttft_p99_ms=objectives[0], decode_tok_s=objectives[1], max_memory_mb=objectives[2])
    seqs = json.loads(a.seqs.read_text()) if a.seqs else [list(range(100, 100 + 4 * a.prompt))]
    try:
        got = measure(get_backend(a.backend), a.engine_dir, target, seqs, a.requests)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    print(json.dumps({"measured": got, "misses": [] if a.measure_only else misses(got, target)}, indent=1))


if __name__ == "__main__":
    main()
