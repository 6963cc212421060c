"""cpu_native against its estimate: each engine's decode (one stream) and prefill measured on this host, the roofline
of the same workload (the probe's bandwidth and fp32 FMA peak, the bytes and FLOPs edgeflow/estimate/counts.py counts),
their ratio, and the factors fitted to all of them (geometric mean) with each figure's leave-one-out error: what
edgeflow/estimate/runtimes.py carries for cpu_native (BENCHMARKS.md#estimate-cpu-native).

    python benchmarks/estimate_cpu_native.py --profile configs/demo-cpu.yaml \
        --gate-report .edgeflow/releases/<release_id>/gate-attempt0.json --teacher --rounds 3 --out /tmp/cpu-native-fit.json

Engines: every row of the gate report (the FP student and each variant, materialized from the artifact store, or
with --rebuild built here from the row's checkpoint) and,
with --teacher, the teacher built here as an fp32 cpu_native engine. Workload: a --prompt-token prompt (prefill: its
TTFT p50 over 20 requests, one at a time), then 64 new tokens on one stream (decode: the p50 of three runs), as
edgeflow/evaluation/service.py measures them. A variant whose scheme the counts cannot take (the mixed recipe) is
listed and left out of the fit. --rounds: every engine measured that many times, the engines in turn (each round
starting one engine later), the host probed afresh before each round (edgeflow/estimate/probe.py); each figure is the
median over the rounds and the roofline uses the median probe, so a slow minute moves one round, not the fit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines import get_backend  # noqa: E402
from edgeflow.engines.checkpoint import read_config  # noqa: E402
from edgeflow.estimate.probe import probe  # noqa: E402
from edgeflow.estimate.counts import Scheme, token_cost  # noqa: E402
from edgeflow.estimate.roofline import Limits, estimate  # noqa: E402
from edgeflow.estimate.runtimes import ROOFLINE  # noqa: E402
from edgeflow.estimate.variants import variant_schemes  # noqa: E402
from edgeflow.evaluation.report import GateReport  # noqa: E402
from edgeflow.evaluation.service import measure  # noqa: E402
from edgeflow.model.architecture import describe  # noqa: E402
from edgeflow.preflight import load_profile  # noqa: E402
from edgeflow.profile.slo import SLOTarget  # noqa: E402
from edgeflow.tracking.store import materialize  # noqa: E402


def _loo(ratios: list[float]) -> list[float]:
    """Each figure's error when predicted with the geometric-mean factor of the others."""
    out = []
    for i, r in enumerate(ratios):
        others = ratios[:i] + ratios[i + 1:]
        f = math.exp(sum(map(math.log, others)) / len(others)) if others else r
        out.append(f / r - 1)
    return out


def _fit_one(ratios: list[float]) -> dict:
    loo = _loo(ratios)
    return {"factor": math.exp(sum(map(math.log, ratios)) / len(ratios)), "figures": len(ratios),
            "loo_abs_median": sorted(abs(e) for e in loo)[len(loo) // 2], "loo_abs_max": max(map(abs, loo)), "loo": loo}


def fit(rows: list[dict]) -> dict:
    """The factors: one over every engine, then one per kernel family (fp32 layers run f32_gemm's fp32 FMAs, the 4-
    and 8-bit ones the int16 multiply-adds of q4i_gemm / q8w_gemm), each with its leave-one-out errors."""
    measured = [r for r in rows if "decode_fraction" in r]
    groups = {"all": measured, "fp32": [r for r in measured if r["scheme"]["bits"] == 32],
              "quantized": [r for r in measured if r["scheme"]["bits"] in (4, 8)]}
    out = {}
    for group, rs in groups.items():
        for kind in ("decode", "prefill"):
            if not rs:
                continue
            f = out.setdefault(group, {})[kind] = _fit_one([r[f"{kind}_fraction"] for r in rs])
            print(f"{group} ({', '.join(r['engine'] for r in rs)}): {kind} factor {f['factor']:.3f}, leave-one-out "
                  f"error median {f['loo_abs_median']:.1%}, max {f['loo_abs_max']:.1%}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--gate-report", type=Path)
    ap.add_argument("--teacher", action="store_true", help="also the teacher, built here as an fp32 engine")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="measurements of every engine, in turn (medians)")
    ap.add_argument("--rebuild", action="store_true", help="build each variant's engine here from its checkpoint, with "
                    "this tree's kernels (an engine built with other kernel sources is refused)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="fit the rows of an earlier --out file again, measuring nothing")
    a = ap.parse_args()
    if a.refit:
        fit(json.loads(a.refit.read_text())["rows"])
        return
    if a.gate_report is None or a.out is None:
        ap.error("--gate-report and --out are required to measure (only --refit measures nothing)")

    profile = load_profile(a.profile)
    report = GateReport.model_validate_json(a.gate_report.read_text())
    backend = get_backend("cpu_native")
    schemes = variant_schemes(profile)
    target = SLOTarget(device="x86-cpu", prompt_tokens=a.prompt, concurrency=1, max_new_tokens=64, decode_tok_s=1)
    fp = report.fp_row
    student = describe(read_config(materialize(fp.checkpoint)), "the student")
    tmp = tempfile.TemporaryDirectory(prefix="edgeflow-fit-")
    engines = []
    for r in report.rows:
        if a.rebuild:
            engine = Path(tmp.name) / r.name
            backend.build(materialize(r.checkpoint), engine, {})
        else:
            engine = materialize(r.engine)
        engines.append((r.name, student, schemes.get(r.name), engine))
    if a.teacher:
        from edgeflow.model.source import teacher_dir

        t = teacher_dir(profile)
        out = Path(tmp.name) / "teacher"
        backend.build(t, out, {})
        engines.append(("teacher fp32", describe(read_config(t), "the teacher"), schemes.get(fp.name), out))
    seqs = [list(range(100, 100 + 8 * a.prompt))]
    counted = [e for e in engines if isinstance(e[2], Scheme)]
    probes, runs = [], {name: [] for name, *_ in counted}
    for r in range(a.rounds):
        probes.append(probe())
        for name, _, _, engine in counted[r % len(counted):] + counted[:r % len(counted)]:
            m = measure(backend, engine, target, seqs)
            runs[name].append((m["decode_tok_s_solo"], a.prompt / (m["ttft_p50_ms"] / 1000)))
            print(f"round {r}: {name}: decode {runs[name][-1][0]:.1f} tok/s, prefill {runs[name][-1][1]:.0f} tok/s "
                  f"(probe {probes[-1].read_gb_s:.1f} GB/s)", flush=True)
    host = probes[0]
    limits = Limits(device="x86-cpu", bandwidth_gb_s=statistics.median(p.read_gb_s for p in probes),
                    peak_tflops=statistics.median(p.fma_gflops for p in probes) / 1e3, memory_gb=None,
                    source=f"probed before each of {a.rounds} rounds: {host.cpu} ({', '.join(host.isa)}), {host.threads} "
                    f"threads; read {', '.join(f'{p.read_gb_s:.1f}' for p in probes)} GB/s, FMA "
                    f"{', '.join(f'{p.fma_gflops:.0f}' for p in probes)} GFLOP/s")
    rows = [{"engine": name, "not_estimated": scheme} for name, _, scheme, _ in engines if not isinstance(scheme, Scheme)]
    print(f"host: {limits.source}; medians {limits.bandwidth_gb_s:.1f} GB/s, {limits.peak_tflops * 1e3:.0f} GFLOP/s")
    print("| engine | layers | decode tok/s (range) | roofline | fraction | prefill tok/s (range) | roofline | fraction |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, arch, scheme, _ in counted:
        best = estimate(token_cost(arch, scheme), limits, ROOFLINE, a.prompt, 1, 64)
        decode = statistics.median(d for d, _ in runs[name])
        prefill = statistics.median(p for _, p in runs[name])
        prefill_best = a.prompt / (best.ttft_p99_ms / 1000)
        row = {"engine": name, "layers": arch.num_hidden_layers, "scheme": scheme.model_dump(), "runs": runs[name],
               "decode_tok_s": decode, "decode_roofline": best.decode_roofline_tok_s,
               "decode_fraction": decode / best.decode_roofline_tok_s,
               "prefill_tok_s": prefill, "prefill_roofline": prefill_best, "prefill_fraction": prefill / prefill_best,
               "prefill_bound": best.ttft_bound}
        rows.append(row)
        d_range = f"{min(d for d, _ in runs[name]):.1f}-{max(d for d, _ in runs[name]):.1f}"
        p_range = f"{min(p for _, p in runs[name]):.0f}-{max(p for _, p in runs[name]):.0f}"
        print(f"| {name} | {row['layers']} | {decode:.1f} ({d_range}) | {row['decode_roofline']:.1f} | "
              f"{row['decode_fraction']:.0%} | {prefill:.0f} ({p_range}) | {prefill_best:.0f} | {row['prefill_fraction']:.0%} |")
    a.out.write_text(json.dumps({"limits": limits.model_dump(), "rows": rows, "fit": fit(rows)}, indent=1))
    tmp.cleanup()


if __name__ == "__main__":
    main()
