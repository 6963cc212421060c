"""Sequence-level KD: the teacher's own answers to the training set's chat prompts, generated once and trained on.

    python -m edgeflow.distill.seqkd TEACHER_DIR data/corpora/chat.jsonl --max-new-tokens 64 --max-prompts 8

Word-level KD (the KL term) teaches the student the teacher's next-token distribution on human-written text;
sequence-level KD (Kim & Rush, 2016) also trains it on text the teacher itself would write, so the student imitates
the teacher's answers as a whole. Every chat record's conversation up to its last user turn is answered by the teacher
(greedy, its chat template, up to max_new_tokens), answers that loop (the gate's repetition check,
edgeflow/evaluation/answers.py) are dropped, and the rest become one more training file of chat records.

Generated once per (teacher weights, prompt records, generation settings), stored as one Parquet file named by its
sha256 under the namespace of those inputs, and shared between hosts through MLflow exactly as the teacher-output
cache is (edgeflow/distill/teacher_cache.py: pull before, push after).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from edgeflow.model.architecture import transformers_kwargs
from edgeflow.tracking.artifacts import sha256_file, sha256_json
from edgeflow.distill.teacher_cache import NAMESPACE_TAG
from edgeflow.calibration.textdata import read_records, record_messages

logger = logging.getLogger("edgeflow.distill")

SEQKD_FORMAT = 2  # 2: answers stop at every end token (engine_dir.stop_ids), not only the tokenizer's eos


@dataclass(frozen=True)
class AnswersSpec:
    """What the teacher's answers depend on (their namespace)."""

    teacher_sha256: str
    prompts_sha256: str
    max_new_tokens: int
    max_prompts: int | None

    @property
    def namespace(self) -> str:
        return sha256_json({"kind": "sequence-kd", "format": SEQKD_FORMAT, "teacher": self.teacher_sha256,
                            "prompts": self.prompts_sha256, "max_new_tokens": self.max_new_tokens,
                            "max_prompts": self.max_prompts})[:32]

    def tags(self) -> dict[str, str]:
        return {NAMESPACE_TAG: self.namespace, "edgeflow.kind": "sequence-kd", "edgeflow.teacher_sha256": self.teacher_sha256,
                "edgeflow.prompts_sha256": self.prompts_sha256, "edgeflow.max_new_tokens": str(self.max_new_tokens)}


def chat_prompts(corpora: list[Path], max_prompts: int | None = None) -> list[list[dict]]:
    """Each chat record's conversation up to and including its last user turn, in corpus order."""
    prompts = []
    for path in corpora:
        for rec in read_records(path):
            msgs = record_messages(rec) if "messages" in rec else None  # conversations, not question/answer pairs
            if not msgs:
                continue
            last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
            if last_user is not None:
                prompts.append([{"role": m["role"], "content": m["content"]} for m in msgs[: last_user + 1]])
    return prompts[:max_prompts] if max_prompts is not None else prompts


def prompts_sha256(prompts: list[list[dict]]) -> str:
    return sha256_json(prompts)


@torch.no_grad()
def generate_answers(teacher, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int = 16) -> list[str]:
    """The teacher's greedy answer to each prompt (left-padded batches, its chat template, end-of-turn stops)."""
    from edgeflow.engines.engine_dir import stop_ids

    device = next(teacher.parameters()).device
    # where the server stops: the eos, generation_config's list (Gemma: <eos>, <end_of_turn>), the family's end tokens
    stops = stop_ids(Path(teacher.name_or_path)) or tokenizer.eos_token_id
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    answers: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                     for p in prompts[start : start + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            # attention_mask always: pad and end-of-turn ids coincide in SmolLM2's tokenizer (FIELD-NOTES)
            out = teacher.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=stops)
            answers += [a.strip() for a in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
    finally:
        tokenizer.padding_side = side
    return answers


def answers_file(teacher, tokenizer, corpora: list[Path], teacher_sha256: str, max_new_tokens: int,
                 max_prompts: int | None, root: Path) -> tuple[Path | None, dict[str, float]]:
    """The training file of the teacher's answers for these corpora's chat prompts: found under its namespace in `root`
    (this host's, or pulled from the store), else generated and written there. (None, stats) when there are no chat
    prompts or every answer looped."""
    from edgeflow.evaluation.answers import repetition

    prompts = chat_prompts(corpora, max_prompts)
    if not prompts:
        return None, {"sequence_kd_prompts": 0}
    spec = AnswersSpec(teacher_sha256, prompts_sha256(prompts), max_new_tokens, max_prompts)
    folder = Path(root) / spec.namespace
    found = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
    if found:
        kept = pq.ParquetFile(found[0]).metadata.num_rows
        return found[0], {"sequence_kd_prompts": len(prompts), "sequence_kd_answers": kept, "sequence_kd_cache_hit": 1}
    if teacher is None:
        raise ValueError(f"sequence-level KD: no answers stored under {folder} and no teacher given to generate them")
    answers = generate_answers(teacher, tokenizer, prompts, max_new_tokens)
    records = [{"messages": p + [{"role": "assistant", "content": a}]} for p, a in zip(prompts, answers)
               if a and not repetition(a)["degenerate"]]
    stats = {"sequence_kd_prompts": len(prompts), "sequence_kd_answers": len(records), "sequence_kd_cache_hit": 0}
    if not records:
        logger.warning("sequence-level KD: every one of the teacher's %d answers looped; no file added", len(prompts))
        return None, stats
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".answers-{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        pq.write_table(pa.Table.from_pylist(records), tmp)
        out = folder / f"{sha256_file(tmp)}.parquet"
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out, stats


def spec_for(corpora: list[Path], teacher_sha256: str, max_new_tokens: int, max_prompts: int | None) -> AnswersSpec:
    """The namespace answers_file reads and writes for these inputs (what the flow pulls and pushes)."""
    return AnswersSpec(teacher_sha256, prompts_sha256(chat_prompts(corpora, max_prompts)), max_new_tokens, max_prompts)


def shared_answers(client, teacher_dir: Path, teacher_sha256: str, cfg, corpora: list[Path], root: Path,
                   artifact_location: str | None = None) -> tuple[Path | None, dict[str, float]]:
    """answers_file with the store: pull the namespace's file from MLflow, else generate it here (the teacher on CUDA
    in bfloat16 when there is one), then push it for the next host. cfg is a edgeflow.profile.SequenceKDConfig."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.distill import teacher_cache

    spec = spec_for(corpora, teacher_sha256, cfg.max_new_tokens, cfg.max_prompts)
    teacher_cache.pull(client, spec, root)
    model = None
    if not any((Path(root) / spec.namespace).glob("*.parquet")):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=dtype, **transformers_kwargs(teacher_dir)).to(device).eval()
    path, stats = answers_file(model, AutoTokenizer.from_pretrained(teacher_dir), corpora, teacher_sha256,
                               cfg.max_new_tokens, cfg.max_prompts, root)
    teacher_cache.push(client, spec, root, artifact_location)
    return path, stats


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.tracking.artifacts import sha256_tree

    parser = argparse.ArgumentParser(description="Generate (or find) the teacher's answers to the corpora's chat prompts.")
    parser.add_argument("teacher", type=Path)
    parser.add_argument("corpora", type=Path, nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--root", type=Path, default=Path(".edgeflow/cache/teacher-outputs"))
    a = parser.parse_args(argv)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32, **transformers_kwargs(a.teacher)).eval()
    tok = AutoTokenizer.from_pretrained(a.teacher)
    path, stats = answers_file(teacher, tok, a.corpora, sha256_tree(a.teacher), a.max_new_tokens, a.max_prompts, a.root)
    print(json.dumps({"file": str(path), **stats}))
    if path:
        for rec in read_records(path)[:3]:
            print("-", rec["messages"][-2]["content"][:80], "->", rec["messages"][-1]["content"][:160])


if __name__ == "__main__":
    main()
