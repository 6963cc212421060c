"""Demo answers: five fixed chat prompts answered by each built engine as the edge server would answer them, with
the repetition figures that tell an answer from a loop.

    python -m edgeflow.evaluation.answers ENGINE_DIR [BACKEND]     # print one engine's five answers and their figures

Each answer is rendered with the engine's own chat template, stops where the server's would (engine_dir.stop_ids),
decoded with the model's sampling defaults
(generation_config.json, the server's defaults: edgeflow/serving/runtime.py) and a fixed seed, for at most ANSWER_TOKENS
tokens, all five in flight together as concurrent requests are, on the host that built the engine (the consistency
stage). The figures, computed on the answer's words:
- `max_trigram_repeats`: how often the most frequent word 3-gram occurs (a fluent 64-token answer: 1 or 2);
- `distinct_2`: distinct word bigrams / word bigrams (a loop drives it towards 0);
- `degenerate`: a 3-gram more than twice, or distinct-2 below 0.6, or no words at all.
A prompt the engine refuses (ValueError) is recorded with its `error` and counts as degenerate; the gate goes on.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PROMPTS = (
    "Name three uses of a microcontroller.",
    "Why do we have seasons on Earth?",
    "Give me two tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write one sentence inviting a friend to a picnic on Saturday.",
)
ANSWER_TOKENS = 64
SEED = 1
MAX_TRIGRAM_REPEATS = 2
MIN_DISTINCT_2 = 0.6

_WORD = re.compile(r"[\w']+")


def repetition(text: str) -> dict[str, Any]:
    """The answer's repetition figures (see the module doc)."""
    words = [w.lower() for w in _WORD.findall(text)]
    trigrams = Counter(zip(words, words[1:], words[2:]))
    bigrams = list(zip(words, words[1:]))
    top = max(trigrams.values(), default=0)
    distinct = len(set(bigrams)) / len(bigrams) if bigrams else 0.0
    return {"words": len(words), "max_trigram_repeats": top, "distinct_2": round(distinct, 4),
            "degenerate": not words or top > MAX_TRIGRAM_REPEATS or distinct < MIN_DISTINCT_2}


def answer_prompts(backend: Any, session: Any, engine_dir: Path) -> list[dict[str, Any]]:
    """Each of PROMPTS answered by one engine session: [{prompt, answer, tokens, figures…}]."""
    from edgeflow.serving.runtime import generation_defaults
    from edgeflow.serving.tokenizer import LightTokenizer
    from edgeflow.engines import generate_many
    from edgeflow.engines.engine_dir import stop_ids
    from edgeflow.engines.sampling import SamplingParams

    tok = LightTokenizer(Path(engine_dir))
    params = SamplingParams(**generation_defaults(engine_dir), seed=SEED)
    stops = stop_ids(engine_dir)  # the server's: the model's own end of turn, not only its tokenizer's eos
    prompt_ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))["input_ids"]
                  for p in PROMPTS]
    out = []
    for prompt, new in zip(PROMPTS, generate_many(backend, session, prompt_ids, ANSWER_TOKENS, stops, params)):
        if isinstance(new, ValueError):  # the engine refused the prompt (e.g. a test model's vocabulary smaller than its tokenizer's)
            out.append({"prompt": prompt, "answer": "", "tokens": 0, "error": str(new)} | repetition(""))
            continue
        reply = tok.decode(new).strip()
        out.append({"prompt": prompt, "answer": reply, "tokens": len(new)} | repetition(reply))
    return out


def ok_share(answers: list[dict[str, Any]]) -> float:
    """The share of answers that are not degenerate (0 for none): what gate.min_answers_ok and
    gate.student.min_answers_ok limit."""
    return sum(not a["degenerate"] for a in answers) / len(answers) if answers else 0.0


def summary(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What the report's table and the demo's last lines say about a variant's answers."""
    n = len(answers)
    return {"answers": n, "degenerate": sum(a["degenerate"] for a in answers),
            "distinct_2_mean": round(sum(a["distinct_2"] for a in answers) / n, 4) if n else None,
            "max_trigram_repeats": max((a["max_trigram_repeats"] for a in answers), default=None)}


if __name__ == "__main__":
    from edgeflow.engines import get_backend
    from edgeflow.engines.engine_dir import read_meta

    engine = Path(sys.argv[1])
    backend = get_backend(sys.argv[2] if len(sys.argv) > 2 else read_meta(engine).backend)
    for a in answer_prompts(backend, backend.load(engine), engine):
        print(f"> {a['prompt']}\n{a['answer']}\n  [{a['tokens']} tokens, 3-gram x{a['max_trigram_repeats']}, "
              f"distinct-2 {a['distinct_2']:.2f}{', degenerate' if a['degenerate'] else ''}]\n")
