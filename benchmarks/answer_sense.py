"""Can the teacher tell a student's sensible answers from its nonsense? Its mean negative log-likelihood per token of
each answer, given the prompt in the model's chat template, for the Gemma 3 students' answers kept in
benchmarks/data/gemma3_student_answers.json (lr 3e-4 students that answer in loops or stitched phrases; the lr 3e-5
demo student's engines that answer on the question), and for the lr 3e-5 answers put to the next prompt instead.

    python benchmarks/answer_sense.py --profile configs/demo-gemma3.yaml [--out /tmp/answer-sense.json]

The teacher is the profile's, converted as a release converts it (edgeflow.model.source.teacher_dir). Prints one line
per answer and, per set, the range and median; BENCHMARKS.md#student-gate has the reading.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "benchmarks" / "data" / "gemma3_student_answers.json"


def answer_nll(tok, model, prompt: str, answer: str) -> float:
    """Mean -log p(answer token | prompt in the chat template, earlier answer tokens), in nats."""
    import torch

    head = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    a = tok(head, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is not None and (not a or a[0] != tok.bos_token_id):
        a = [tok.bos_token_id] + a
    b = tok(answer, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([a + b])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    target = ids[0, 1:]
    return -logp[torch.arange(len(target)), target][len(a) - 1:].mean().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="configs/demo-gemma3.yaml")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.evaluation.answers import PROMPTS
    from edgeflow.model.source import teacher_dir
    from edgeflow.preflight import load_profile

    torch.manual_seed(0)
    path = teacher_dir(load_profile(a.profile))
    tok = AutoTokenizer.from_pretrained(path)
    if (path / "chat_template.jinja").exists():
        tok.chat_template = (path / "chat_template.jinja").read_text()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    answers = json.loads(DATA.read_text())["answers"]
    good = [r for r in answers if r["set"] == "lr 3e-5"]
    # the same sensible answers, put to the next demo prompt: an answer to another question
    moved = [r | {"set": "lr 3e-5, to the next prompt", "prompt": PROMPTS[(PROMPTS.index(r["prompt"]) + 1) % len(PROMPTS)]}
             for r in good]
    rows = []
    for r in answers + moved:
        nll = answer_nll(tok, model, r["prompt"], r["answer"])
        rows.append(r | {"nll": round(nll, 3)})
        print(f"{r['set']:<28} degenerate={r['degenerate']!s:<5} nll {nll:5.2f}  {r['answer'][:70]!r}", flush=True)
    print()
    for s in dict.fromkeys(r["set"] for r in rows):
        for label, keep in (("all", lambda r: True), ("not degenerate", lambda r: not r["degenerate"])):
            xs = [r["nll"] for r in rows if r["set"] == s and keep(r)]
            if xs:
                print(f"{s:<28} {label:<15} n={len(xs):<3} nll {min(xs):.2f}-{max(xs):.2f}, median {statistics.median(xs):.2f}")
    if a.out:
        a.out.write_text(json.dumps({"teacher": str(path), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
