"""The five demo answers of built engines under several decoding defaults: which defaults stop a small model looping.

    python benchmarks/answer_defaults.py ENGINE_DIR [ENGINE_DIR ...] [--backend cpu_native] [--out /tmp/answers.json]

Each engine directory is copied once per setting, its generation_config.json overlaid with the setting (the server's
decoding defaults: edgeflow/serving/runtime.py:generation_defaults), and answered exactly as the consistency gate answers
(edgeflow/evaluation/answers.py: the engine's chat template, seed 1, 64 tokens). Prints one markdown row per engine and
setting: answers that are not degenerate, and each answer's distinct-2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.engines import get_backend  # noqa: E402
from edgeflow.engines.engine_dir import read_meta  # noqa: E402
from edgeflow.evaluation.answers import answer_prompts  # noqa: E402

SETTINGS = {
    "greedy (the converted model's own)": {},
    "model card: T 0.2, top-p 0.9": {"do_sample": True, "temperature": 0.2, "top_p": 0.9},
    "greedy, repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "T 0.2, top-p 0.9, repetition_penalty 1.1": {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
    "T 0.2, top-p 0.9, repetition_penalty 1.2": {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.2},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--backend", default="cpu_native")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    backend = get_backend(a.backend)
    rows = []
    print(f"cpus: {os.cpu_count()}")
    print("| engine | precision | setting | not degenerate | distinct-2 per answer |")
    print("|---|---|---|---:|---|")
    for engine in a.engines:
        meta = read_meta(engine)
        for name, overlay in SETTINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                d = Path(tmp) / "engine"
                shutil.copytree(engine, d)
                path = d / "generation_config.json"
                cfg = json.loads(path.read_text()) if path.exists() else {}
                for k in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty"):
                    cfg.pop(k, None)  # the setting replaces whatever the engine shipped with
                path.write_text(json.dumps(cfg | overlay))
                answers = answer_prompts(backend, backend.load(d), d)
            ok = sum(not x["degenerate"] for x in answers)
            rows.append({"engine": str(engine), "precision": meta.label, "setting": name, "not_degenerate": ok,
                         "answers": answers})
            spread = ", ".join(f"{x['distinct_2']:.2f}" for x in answers)
            print(f"| {engine.parent.name[:12]} | {meta.label} | {name} | {ok}/5 | {spread} |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
