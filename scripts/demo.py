"""`make demo`: run the release deployment on the CPU demo profile, then chat with what it deployed.

    python scripts/demo.py --profile configs/demo-cpu.yaml
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from prefect.deployments import run_deployment

    from edgeflow.preflight import load_profile
    from edgeflow.pipeline.progress import follow
    from edgeflow.evaluation.answers import repetition
    from edgeflow.tracking.report import quality_phrase, staged_row, table
    from edgeflow.tracking.runs import tracking_uri

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="configs/demo-cpu.yaml")
    a = ap.parse_args()
    p = load_profile(a.profile)
    t0 = time.time()
    ui = os.environ.get("PREFECT_UI_URL", "http://127.0.0.1:4200")
    fr = run_deployment("release/release", parameters={"profile": a.profile, "deploy": "pool"}, timeout=0)
    run_url = f"{ui}/runs/flow-run/{fr.id}"
    print(f"Running the release deployment with {a.profile}; the same progress is in the Prefect UI: {run_url}", flush=True)
    fr = follow(fr.id)  # each stage as it starts and ends, and the long loops' progress bars, from the Prefect API
    if not fr.state.is_completed():
        # the release's own message names why nothing was staged (the student gate's or the consistency gate's
        # missed limits) and what to change
        print(f"release ended {fr.state.type.value}: nothing was staged or deployed.\n{fr.state.message}\n{run_url}",
              file=sys.stderr)
        return 1
    report = fr.state.result()
    print(f"\nRelease {report['release_id']} finished in {time.time() - t0:.0f} s\n")
    print(table(report["variants"]))
    print(f"\nstaging: {report['staging']} (version {report['staging_version']})")
    s = report["student"]
    print(f"student: {s['student_layers']} layers, top-1 agreement with teacher {s['student_top1_vs_teacher']:.1%}, "
          f"perplexity {s['student_ppl']:.1f} vs teacher {s['teacher_ppl']:.1f} "
          f"({s['student_ppl'] / s['teacher_ppl']:.1f}×), {quality_phrase(s)}")
    staged = staged_row(report)
    if staged and staged.get("answers"):
        a = staged["answers"]
        print(f"answers of {staged['name']} to the {len(a)} demo prompts: {staged['answers_ok']} not degenerate "
              f"(distinct-2 {min(x['distinct_2'] for x in a):.2f}–{max(x['distinct_2'] for x in a):.2f}); all five are in the report")
    server = f"http://{p.deploy.host}:{p.deploy.port}"
    if report.get("deploy"):
        question = "Name three uses of a microcontroller."
        print(f"\nStreaming a chat from the deployed {report['staging']} engine at {server}:\n> {question}\n", flush=True)
        from openai import OpenAI

        client = OpenAI(base_url=f"{server}/v1", api_key=os.environ.get("EDGEFLOW_API_KEY", "none"), max_retries=0)
        # no temperature or top_p: the server applies the model's own defaults (its generation_config.json)
        kw = dict(model=p.registry.model_name, messages=[{"role": "user", "content": question}], max_tokens=96,
                  seed=1, stop=["\n\n\n"], stream=True)
        answers = []
        for shown in (True, False):  # the same seed and request twice: the same answer
            parts = []
            for chunk in client.chat.completions.create(**kw):
                for ch in chunk.choices:
                    parts.append(ch.delta.content or "")
                    if shown:
                        print(ch.delta.content or "", end="", flush=True)
            answers.append("".join(parts))
        print(f"\n\n(the model's sampling defaults, seed 1; asked twice, the same answer: {answers[0] == answers[1]})")
        if answers[0] != answers[1]:
            print("error: the same seed gave two different answers", file=sys.stderr)
            return 1
        if (fig := repetition(answers[0]))["degenerate"]:
            print(f"error: the streamed answer degenerates (most frequent word 3-gram x{fig['max_trigram_repeats']}, "
                  f"distinct-2 {fig['distinct_2']:.2f}); the staged variant passed the gate's answers on its prompts but not "
                  "this one. Fix: raise gate.min_answers_ok and gate.student.min_answers_ok, or train longer "
                  "(distill.steps)", file=sys.stderr)
            return 1
    exp_id = report["mlflow_experiment_id"]  # in the report, so this script never imports mlflow (~3 s)
    print(f"\nReport:       {REPO / 'reports' / (report['release_id'] + '.md')}")
    print(f"Prefect run:  {run_url}")
    print(f"MLflow run:   {tracking_uri()}/#/experiments/{exp_id}/runs/{report['mlflow_parent_run_id']}")
    print(f"Edge server:  {server}  (OpenAI-compatible: {server}/v1/chat/completions)")
    print("Stop everything with: make down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
