"""Does distillation beat no distillation? Three students, same data, same steps, same held-out text.

    python benchmarks/distill_ablation.py --profile configs/demo-cpu.yaml --out benchmarks/distill_ablation_results.md

Rows (one run each, same seed, same layer-dropped initialisation, same training set and batch order):
  1. the layer-dropped student before any training (kept teacher layers, nothing learned),
  2. that student distilled with the profile's loss (α·KL·T² + (1−α)·CE + β·hidden MSE),
  3. that student trained for the same steps with cross-entropy only (α = 0, β = 0).
Each is scored against the teacher on held-out texts from the gate's evaluation sources (disjoint from
the training corpora): perplexity, top-1 agreement and mean KL(teacher ‖ student). Needs no services;
the teacher is converted once into the profile's work dir (the demo's cache is reused).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from edgeflow.preflight import load_profile  # noqa: E402
from edgeflow.distill import run_distill  # noqa: E402
from edgeflow.evaluation.gate import eval_texts  # noqa: E402
from edgeflow.model.source import teacher_dir  # noqa: E402

KEYS = ("student_ppl", "student_top1_vs_teacher", "student_kl_vs_teacher", "student_quality_pct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--eval-texts", type=int, default=60, help="held-out texts, spread over the gate's eval domains")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the profile's distill.steps)")
    ap.add_argument("--distill", action="append", default=None, metavar="FIELD=V,...",
                    help="distillation settings to compare, e.g. 'temperature=1,beta=0' (repeatable; default: the profile's)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/distill_ablation_results.md"))
    args = ap.parse_args()

    # setup: the profile's teacher, training config and held-out text
    profile = load_profile(args.profile)
    teacher = teacher_dir(profile)  # converted once into the profile's work dir
    base = profile.distill if args.steps is None else profile.distill.model_copy(update={"steps": args.steps})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    held_out = eval_texts({k: profile.resolve(v) for k, v in profile.gate.eval_sources.items()}, args.eval_texts, tok)
    corpora = [profile.resolve(c) for c in base.corpora]
    torch.set_num_threads(os.cpu_count() or 1)

    # work: the same student trained once per distillation setting and once with CE only
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="edgeflow-ablation-") as tmp:
        cfgs = [base] if not args.distill else [
            type(base).model_validate(base.model_dump() | {k: float(v) for k, v in (kv.split("=") for kv in spec.split(","))})
            for spec in args.distill]
        variants = [(f"distilled (α={c.alpha}, T={c.temperature}, β={c.beta})", c) for c in cfgs]
        for i, (name, cfg) in enumerate(variants + [("CE only (α=0, β=0)", base.model_copy(update={"alpha": 0.0, "beta": 0.0}))]):
            t0 = time.perf_counter()
            m = run_distill(teacher, cfg, corpora, held_out, Path(tmp) / f"student-{i}", Path(tmp) / "work")
            m["wall_s"] = time.perf_counter() - t0
            m.pop("history")
            runs[name] = m
            print(f"{name}: ppl {m['student_ppl']:.2f} (before {m['student_ppl_before_training']:.2f}) in {m['wall_s']:.0f} s", flush=True)

    # save: the raw numbers first, then the table; the before-training row from the first run (all start identical)
    args.out.with_suffix(".json").write_text(json.dumps({"profile": args.profile, "steps": base.steps, "runs": runs}, indent=1, default=str))
    d = next(iter(runs.values()))
    assert all(abs(m["student_ppl_before_training"] - d["student_ppl_before_training"]) < 1e-6 * d["student_ppl_before_training"]
               for m in runs.values()), "the runs did not start from the same student"
    rows = [("layer-dropped, before training", {"student_ppl": d["student_ppl_before_training"],
                                                "student_top1_vs_teacher": d["student_top1_before_training"],
                                                "student_kl_vs_teacher": d["student_kl_before_training"],
                                                "student_quality_pct": 100 * d["teacher_ppl"] / d["student_ppl_before_training"]}, "-")]
    rows += [(name, m, f"{m['wall_s']:.0f}") for name, m in runs.items()]
    lines = [
        f"Profile `{args.profile}`: {d['student_layers']}-layer student ({d['student_params'] / 1e6:.1f} M parameters) from the "
        f"{d['teacher_params'] / 1e6:.1f} M teacher, {base.steps} steps × {base.batch_size} × ≤{base.max_seq_len} tokens, lr {base.lr}, "
        f"seed {base.seed}; held-out: {d['eval_positions']} positions from {len(held_out)} texts of the gate's eval sources. "
        f"Teacher perplexity {d['teacher_ppl']:.2f}. Machine: {platform.machine()}, {os.cpu_count()} CPUs.",
        "",
        "| student | held-out ppl | top-1 vs teacher | mean KL(teacher‖student) | quality % of teacher | train wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ] + [
        f"| {name} | {m['student_ppl']:.2f} | {m['student_top1_vs_teacher']:.1%} | {m['student_kl_vs_teacher']:.3f} | "
        f"{m['student_quality_pct']:.1f} | {wall} |" for name, m, wall in rows
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
