"""What sampling costs on an engine, against greedy decoding on the same engine.

    python benchmarks/sampling.py --engine .edgeflow/device/engines/<key> --tokens 96 --repeats 3

For each setting (greedy; temperature 0.7 + top_p 0.9; temperature 1.0; temperature 0.7 with frequency/presence
penalties; temperature 0.8 + top_k 40; greedy with a repetition penalty; greedy with logprobs) it decodes --tokens new
tokens on each prompt (EOS ignored), --repeats times (round-robin over the settings), and reports the median tokens/s
and its ratio to greedy. On cpu_native it also reports the mean number of head rows rescored in fp32 per sampled step
(the draw is exact: cpu_native.head_sample) and how many steps read the whole fp32 head instead. Prints a markdown
table, the CPU, then the raw numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.serving.tokenizer import LightTokenizer  # noqa: E402
from edgeflow.engines import get_backend  # noqa: E402
from edgeflow.engines.sampling import SamplingParams  # noqa: E402

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.")
SETTINGS = {
    "greedy": None,
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "temperature 1.0": SamplingParams(temperature=1.0, seed=1),
    "temperature 0.7 + penalties 0.5/0.5": SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.5, seed=1),
    "temperature 0.8, top_k 40": SamplingParams(temperature=0.8, top_k=40, seed=1),
    "greedy + repetition_penalty 1.1": SamplingParams(repetition_penalty=1.1),
    "greedy + logprobs (top 5)": SamplingParams(logprobs=True, top_logprobs=5),
}


def _cpu() -> str:
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return f"{model} ({os.cpu_count()} CPUs; {', '.join(f for f in ('avx2', 'fma', 'avx512f') if f in flags)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    meta = json.loads((a.engine / "engine.json").read_text())
    backend = get_backend(meta["backend"])
    session = backend.load(a.engine)
    tok = LightTokenizer(a.engine)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    list(backend.generate(session, ids[0], 8, []))  # warm-up
    # Round-robin: each repeat runs every setting once, so a machine that speeds up or slows down over the run moves
    # every setting alike (run one setting's repeats after another's and a drift of the box shows up as a ratio).
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    counters = {name: {"sampled": 0, "sampled_candidates": 0, "sampled_full_passes": 0} for name in SETTINGS}
    stats = getattr(session, "stats", None)
    for _ in range(a.repeats):
        for name, params in SETTINGS.items():
            before = dict(stats) if stats else {}
            n, t0 = 0, time.perf_counter()
            for p in ids:
                n += len(list(backend.generate(session, p, a.tokens, [], params)))
            speeds[name].append(n / (time.perf_counter() - t0))
            if stats is not None:
                for key in counters[name]:
                    counters[name][key] += stats[key] - before.get(key, 0)
    rows = []
    for name in SETTINGS:
        row = {"setting": name, "tok_s": round(statistics.median(speeds[name]), 1), "runs": [round(x, 1) for x in speeds[name]]}
        if stats is not None:
            c = counters[name]
            sampled = c["sampled"]
            row |= {"sampled_steps": sampled,
                    "mean_candidates": round(c["sampled_candidates"] / sampled, 1) if sampled else None,
                    "full_passes": c["sampled_full_passes"]}
        rows.append(row)
    print(f"Engine: {a.engine} ({meta['backend']}, {meta.get('precision')}); {a.tokens} tokens x {len(ids)} prompts, "
          f"median of {a.repeats}")
    greedy = rows[0]["tok_s"]
    print("| setting | tok/s | of greedy | rows rescored per sampled step | steps that read the whole head |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['tok_s']} | {r['tok_s'] / greedy:.2f} | {r.get('mean_candidates') or '–'} | "
              f"{r['full_passes'] if r.get('sampled_steps') else '–'} |")
    print(f"CPU: {_cpu()}")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
