"""Quantization methods and calibration data, side by side, on SmolLM2-135M-Instruct (the demo's teacher).

    python benchmarks/quant_methods.py --calib-total 64 --eval-per-domain 60 --out benchmarks/quant_methods_results.md

Two questions, one run, every variant scored against the same full-precision model on the same
held-out evaluation sequences (data/eval: chat, wiki, math; disjoint from the calibration sources):
  1. Method order (AWQ paper: AWQ <= GPTQ <= RTN in perplexity loss): AWQ, GPTQ and RTN W4A16 g64,
     all calibrated on one domain-mixed set (chat:wiki:math = 5:3:2); plus the W8A16 and mixed
     W8-attention/W4-MLP recipes for scale.
  2. Calibration data: GPTQ and AWQ calibrated on the domain mix vs on the same number of samples
     from a single generic source (wiki only), scored per domain.
Models are scored as their exactly dequantized weights (edgeflow.engines.checkpoint.load_dequantized): the same
numbers the CPU engine runs (engine parity is tested in tests/engines). Writes a markdown
table to --out and the raw numbers to the same path with .json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from edgeflow.calibration.mix import build_calibration_set, check_no_leakage  # noqa: E402
from edgeflow.paths import REPO_ROOT  # noqa: E402
from edgeflow.preflight import load_profile  # noqa: E402
from edgeflow.evaluation.gate import tokenize  # noqa: E402
from edgeflow.evaluation.reference import HFScorer  # noqa: E402
from edgeflow.evaluation.metrics import Accumulator, log_softmax  # noqa: E402
from edgeflow.model.source import teacher_dir  # noqa: E402
from edgeflow.quantize.run import quantize  # noqa: E402
from edgeflow.quantize.recipe import load_recipe  # noqa: E402
from edgeflow.calibration.textdata import load_texts  # noqa: E402

RECIPES = REPO_ROOT / "deployments" / "recipes"
# (row name, recipe file, calibration set)
RUNS = [
    ("rtn-w4a16 (no calibration)", "rtn-w4a16-asym.yaml", "mixed"),
    ("gptq-w4a16 · mixed calib", "gptq-w4a16-sym.yaml", "mixed"),
    ("awq-w4a16 · mixed calib", "awq-w4a16-asym.yaml", "mixed"),
    ("gptq-w4a16 · wiki-only calib", "gptq-w4a16-sym.yaml", "wiki"),
    ("awq-w4a16 · wiki-only calib", "awq-w4a16-asym.yaml", "wiki"),
    ("mixed-w8attn-w4mlp · mixed calib", "mixed-w8attn-w4mlp.yaml", "mixed"),
    ("gptq-w8a16 · mixed calib", "gptq-w8a16-sym.yaml", "mixed"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib-total", type=int, default=64, help="calibration samples per set")
    ap.add_argument("--calib-tokens", type=int, default=256, help="tokens per calibration sample")
    ap.add_argument("--eval-per-domain", type=int, default=60, help="held-out sequences per domain")
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--awq-grid", type=int, default=10, help="AWQ n_grid (recipe default 20)")
    ap.add_argument("--only", nargs="*", help="row names to run (default all)")
    ap.add_argument("--work", default=".edgeflow/bench-quant")
    ap.add_argument("--out", default="benchmarks/quant_methods_results.md")
    a = ap.parse_args()

    profile = load_profile(REPO_ROOT / "configs" / "demo-cpu.yaml")
    teacher = teacher_dir(profile)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    work = REPO_ROOT / a.work
    cal = profile.calibration
    sources = {d: profile.resolve(p) for d, p in cal.sources.items()}
    sets = {
        "mixed": build_calibration_set(sources, cal.ratios, a.calib_total, a.calib_tokens, 0, tok, work / "calib-mixed.parquet"),
        "wiki": build_calibration_set({"wiki": sources["wiki"]}, {"wiki": 1}, a.calib_total, a.calib_tokens, 0, tok,
                                      work / "calib-wiki.parquet"),
    }
    calib_ids = {k: pq.read_table(work / f"calib-{k}.parquet", columns=["input_ids"]).column("input_ids").to_pylist() for k in sets}

    evals: dict[str, list[list[int]]] = {}
    for domain, path in sorted(profile.gate.eval_sources.items()):
        texts = load_texts([profile.resolve(path)], tok)[: a.eval_per_domain]
        for k in sets:
            check_no_leakage(pq.read_table(work / f"calib-{k}.parquet", columns=["text"]).column("text").to_pylist(), texts)
        evals[domain] = tokenize(texts, tok, a.eval_tokens)

    torch.set_num_threads(os.cpu_count() or 1)
    # quantize every variant first, then score all of them sequence by sequence against one reference
    # forward pass (a full-vocabulary log-prob tensor per sequence is ~50 MB: never keep them all)
    done = []
    for name, recipe_file, calib in RUNS:
        if a.only and name not in a.only:
            continue
        recipe = load_recipe(RECIPES / recipe_file, {"AWQModifier": {"n_grid": a.awq_grid}})
        out = work / f"{recipe_file[:-5]}-{calib}"
        t0 = time.perf_counter()
        info = quantize(teacher, recipe, calib_ids[calib], out)
        done.append((name, recipe_file, calib, out, info, time.perf_counter() - t0))
        print(f"quantized {name} in {done[-1][-1]:.0f} s", flush=True)

    reference = HFScorer(teacher)
    models = {name: HFScorer(out) for name, _, _, out, _, _ in done}
    acc = {name: {d: Accumulator() for d in evals} | {"all": Accumulator()} for name in models}
    for d, seqs in evals.items():
        for ids in seqs:
            ref = log_softmax(reference(ids))
            for name, model in models.items():
                cand = log_softmax(model(ids))
                acc[name][d].add_logprobs(ref, cand, ids)
                acc[name]["all"].add_logprobs(ref, cand, ids)

    rows = []
    for name, recipe_file, calib, out, info, q_s in done:
        m = acc[name]["all"].result()
        rows.append({
            "name": name, "recipe": recipe_file, "calibration": calib, "quantize_s": round(q_s, 1), "size_mb": round(info["size_mb"], 1),
            "top1": m["top1_agreement"], "kl": m["kl"], "ppl_ref": m["ppl_ref"], "ppl": m["ppl"], "ppl_delta": m["ppl_increase"],
            "per_domain": {d: {"ppl": r["ppl"], "ppl_ref": r["ppl_ref"], "ppl_delta": r["ppl_increase"], "top1": r["top1_agreement"]}
                           for d, r in ((d, acc[name][d].result()) for d in evals)},
        })
        print(json.dumps(rows[-1]), flush=True)

    domains = sorted(evals)
    lines = [
        f"Model: SmolLM2-135M-Instruct (30 layers, fp32 reference). Calibration: {a.calib_total} samples × ≤{a.calib_tokens} tokens "
        f"(mixed = chat:wiki:math 5:3:2; wiki = the wiki source only), seed 0; AWQ n_grid {a.awq_grid}. Evaluation: "
        f"{sum(len(s) for s in evals.values())} held-out sequences ({a.eval_per_domain} per domain, ≤{a.eval_tokens} tokens), "
        f"{sum(len(s) - 1 for v in evals.values() for s in v)} positions. Machine: {platform.machine()}, {os.cpu_count()} CPUs.",
        "",
        "| variant | size MB | quantize s | top-1 vs FP | mean KL | ppl (FP " + f"{rows[0]['ppl_ref']:.2f}" + ") | Δppl | "
        + " | ".join(f"Δppl {d}" for d in domains) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(domains),
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['size_mb']} | {r['quantize_s']} | {r['top1']:.2%} | {r['kl']:.4f} | {r['ppl']:.2f} | "
            f"{r['ppl_delta']:+.2%} | " + " | ".join(f"{r['per_domain'][d]['ppl_delta']:+.2%}" for d in domains) + " |"
        )
    out_md = REPO_ROOT / a.out
    out_md.write_text("\n".join(lines) + "\n")
    out_md.with_suffix(".json").write_text(json.dumps({"args": vars(a), "calibration": sets, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
