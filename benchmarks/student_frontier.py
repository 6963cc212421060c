"""The demo student's quality against its training time: which layers it keeps, how many steps, which rate.

    python benchmarks/student_frontier.py --profile configs/demo-cpu.yaml \
        --run '{"keep_every_k": 3}' --run '{"keep_layers": [0, 1, 2, 29], "steps": 120}' --out /tmp/frontier.json

Each --run is a JSON object of distill fields laid over the profile's `distill` section (so the profile's own
keep_every_k/keep_layers/drop_block is dropped when a run names one of them). Every run distils the same teacher on the same
corpora with run_distill (this process, no services) and is scored on the same held-out texts of the gate's
eval sources: perplexity against the teacher's, top-1 agreement and KL with the teacher, before and after
training, with the training throughput and the run's wall time (evaluation included). Prints a markdown row per run as it finishes and writes all of it to --out.

All runs of one invocation share a work directory, so the teacher-output cache (distill.teacher_cache) the first run
fills serves the later ones, as it serves later releases: `--run '{}' --run '{}'` is a cold and a warm run of the same
student, and `--run '{"teacher_cache": {"enabled": false}}'` the full-vocabulary KL against a live teacher. A run with
`"sequence_kd": {"enabled": true, ...}` trains on the teacher's answers too (generated once, then found again).
With --answers, each student is built into the profile's engine (engine.backend) and answers the demo's five prompts as
the student gate asks them (edgeflow/evaluation/answers.py): the `answers ok` column is gate.student.min_answers_ok's
measure. `--run '{"mixed_precision": "off"}'` distils in fp32 on a box that would use bf16 (the AVX2-only boxes' way).
"""
from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    ap.add_argument("--run", action="append", required=True, help="JSON object of distill fields for one run")
    ap.add_argument("--eval-texts", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--answers", action="store_true", help="build each student's engine and score its demo answers")
    a = ap.parse_args()

    profile = load_profile(a.profile)
    teacher = teacher_dir(profile)  # converted once into the profile's work dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    held_out = eval_texts({k: profile.resolve(v) for k, v in profile.gate.eval_sources.items()}, a.eval_texts, tok)
    corpora = [profile.resolve(c) for c in profile.distill.corpora]
    torch.set_num_threads(os.cpu_count() or 1)
    base = profile.distill.model_dump(exclude_unset=True)
    results = []
    print("| run | layers | steps | lr | ppl before | ppl after | × teacher | top-1 after | KL after | train tok/s | teacher cache hits | wall s | answers ok |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="edgeflow-frontier-") as tmp:
        for i, spec in enumerate(a.run):
            over = json.loads(spec)
            fields = dict(base)
            if {"keep_layers", "keep_every_k", "drop_block"} & set(over):  # the run's way of cutting replaces the profile's
                for k in ("keep_layers", "keep_every_k", "drop_block"):
                    fields.pop(k, None)
            cfg = type(profile.distill).model_validate(fields | over)
            t0 = time.perf_counter()
            files, kd_stats = list(corpora), {}
            if cfg.sequence_kd.enabled:
                files, kd_stats = _with_answers(teacher, tok, cfg, files, Path(tmp) / "work")
            m = run_distill(teacher, cfg, files, held_out, Path(tmp) / f"s{i}", Path(tmp) / "work") | kd_stats
            wall = time.perf_counter() - t0
            m.pop("history", None)
            if a.answers:
                m["answers"] = _answers(profile, Path(tmp) / f"s{i}", Path(tmp) / f"e{i}")
            row = {"run": over, "wall_s": wall} | m
            results.append(row)
            print(f"| {json.dumps(over)} | {m['student_layers']} | {cfg.steps} | {cfg.lr:g} | {m['student_ppl_before_training']:.1f} | "
                  f"{m['student_ppl']:.1f} | {m['student_ppl'] / m['teacher_ppl']:.2f} | {m['student_top1_vs_teacher']:.1%} | "
                  f"{m['student_kl_vs_teacher']:.3f} | {m['mean_tokens_per_s']:.0f} | {_cache(m)} | {wall:.0f} | "
                  f"{_ok(m)} |", flush=True)
            a.out.write_text(json.dumps({"profile": a.profile, "eval_texts": a.eval_texts, "cpus": os.cpu_count(),
                                         "results": results}, indent=1, default=str))


def _answers(profile, student: Path, engine: Path) -> list[dict]:
    """The student's demo answers from its own engine, as the student gate gets them."""
    from edgeflow.engines import get_backend
    from edgeflow.evaluation.answers import answer_prompts

    backend = get_backend(profile.engine.backend)
    backend.build(student, engine, profile.engine.profile)
    return answer_prompts(backend, backend.load(engine), engine)


def _ok(m: dict) -> str:
    if "answers" not in m:
        return ""
    from edgeflow.evaluation.answers import ok_share

    return f"{ok_share(m['answers']):.0%}"


def _cache(m: dict) -> str:
    if "teacher_cache_hits" not in m:
        return "off"
    hits, total = int(m["teacher_cache_hits"]), int(m["teacher_cache_hits"] + m["teacher_cache_misses"])
    return f"{hits}/{total}"


def _with_answers(teacher: Path, tok, cfg, corpora: list[Path], work: Path) -> tuple[list[Path], dict]:
    """The corpora plus the teacher's answers file (edgeflow/distill/seqkd.py), generated once per work directory."""
    from transformers import AutoModelForCausalLM

    from edgeflow.tracking.artifacts import sha256_tree
    from edgeflow.distill import seqkd
    from edgeflow.distill.run import teacher_cache_root

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    path, stats = seqkd.answers_file(model, tok, corpora, sha256_tree(teacher), cfg.sequence_kd.max_new_tokens,
                                     cfg.sequence_kd.max_prompts, teacher_cache_root(work))
    return corpora + ([path] if path else []), stats | {"sequence_kd_s": time.perf_counter() - t0}


if __name__ == "__main__":
    main()
