"""cpu_native against its estimate: each engine's decode (one stream) and prefill measured on this host, the roofline
of the same workload (the probe's bandwidth and fp32 FMA peak, the bytes and FLOPs edgeflow/estimate/counts.py counts),
their ratio, and the factors fitted to all of them (geometric mean) with each figure's leave-one-out error: what
edgeflow/estimate/runtimes.py carries for cpu_native (BENCHMARKS.md#estimate-cpu-native).

    python benchmarks/estimate_cpu_native.py --profile configs/demo-cpu.yaml \
        --gate-report .edgeflow/releases/<release_id>/gate-attempt0.json --teacher --out /tmp/cpu-native-fit.json

Engines: every row of the gate report (the FP student and each variant, materialized from the artifact store) and,
with --teacher, the teacher built here as an fp32 cpu_native engine. Workload: a --prompt-token prompt (prefill: its
TTFT p50 over 20 requests, one at a time), then 64 new tokens on one stream (decode: the p50 of three runs), as
edgeflow/evaluation/service.py measures them. A variant whose scheme the counts cannot take (the mixed recipe) is
listed and left out of the fit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines import get_backend  # noqa: E402
from edgeflow.engines.checkpoint import read_config  # noqa: E402
from edgeflow.estimate import limits_for  # noqa: E402
from edgeflow.estimate.counts import Scheme, token_cost  # noqa: E402
from edgeflow.estimate.roofline import estimate  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--gate-report", type=Path, required=True)
    ap.add_argument("--teacher", action="store_true", help="also the teacher, built here as an fp32 engine")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    profile = load_profile(a.profile)
    report = GateReport.model_validate_json(a.gate_report.read_text())
    backend = get_backend("cpu_native")
    limits = limits_for("x86-cpu")
    schemes = variant_schemes(profile)
    target = SLOTarget(device="x86-cpu", prompt_tokens=a.prompt, concurrency=1, max_new_tokens=64, decode_tok_s=1)
    fp = report.fp_row
    student = describe(read_config(materialize(fp.checkpoint)), "the student")
    engines = [(r.name, student, schemes.get(r.name), materialize(r.engine)) for r in report.rows]
    tmp = tempfile.TemporaryDirectory(prefix="edgeflow-fit-")
    if a.teacher:
        from edgeflow.model.source import teacher_dir

        t = teacher_dir(profile)
        out = Path(tmp.name) / "teacher"
        backend.build(t, out, {})
        engines.append(("teacher fp32", describe(read_config(t), "the teacher"), schemes.get(fp.name), out))
    seqs = [list(range(100, 100 + 8 * a.prompt))]
    rows = []
    print(f"host: {limits.source}; {limits.bandwidth_gb_s:.1f} GB/s, {limits.peak_tflops * 1e3:.0f} GFLOP/s")
    print("| engine | layers | decode tok/s | roofline | fraction | prefill tok/s | roofline | fraction |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, arch, scheme, engine in engines:
        if not isinstance(scheme, Scheme):
            rows.append({"engine": name, "not_estimated": scheme})
            print(f"| {name} | {arch.num_hidden_layers} | not estimated: {scheme} |||||| ")
            continue
        best = estimate(token_cost(arch, scheme), limits, ROOFLINE, a.prompt, 1, 64)
        m = measure(backend, engine, target, seqs)
        prefill = a.prompt / (m["ttft_p50_ms"] / 1000)
        prefill_best = a.prompt / (best.ttft_p99_ms / 1000)
        row = {"engine": name, "layers": arch.num_hidden_layers, "scheme": scheme.model_dump(),
               "decode_tok_s": m["decode_tok_s_solo"], "decode_roofline": best.decode_roofline_tok_s,
               "decode_fraction": m["decode_tok_s_solo"] / best.decode_roofline_tok_s,
               "prefill_tok_s": prefill, "prefill_roofline": prefill_best, "prefill_fraction": prefill / prefill_best,
               "prefill_bound": best.ttft_bound}
        rows.append(row)
        print(f"| {name} | {row['layers']} | {row['decode_tok_s']:.1f} | {row['decode_roofline']:.1f} | "
              f"{row['decode_fraction']:.0%} | {prefill:.0f} | {prefill_best:.0f} | {row['prefill_fraction']:.0%} |", flush=True)
    fit = {}
    for kind in ("decode", "prefill"):
        ratios = [r[f"{kind}_fraction"] for r in rows if f"{kind}_fraction" in r]
        loo = _loo(ratios)
        fit[kind] = {"factor": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                     "loo_abs_median": sorted(abs(e) for e in loo)[len(loo) // 2], "loo_abs_max": max(map(abs, loo)),
                     "loo": loo}
        print(f"{kind}: factor {fit[kind]['factor']:.3f}, leave-one-out error median {fit[kind]['loo_abs_median']:.1%}, "
              f"max {fit[kind]['loo_abs_max']:.1%}")
    a.out.write_text(json.dumps({"limits": limits.model_dump(), "rows": rows, "fit": fit}, indent=1))
    tmp.cleanup()


if __name__ == "__main__":
    main()
