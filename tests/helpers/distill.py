"""Test helpers for the distill stage: a training set written from token ids (write_sequences), and the loss of one
step in one process built from the functions train() calls each step (kd_sums, hidden_sums, StepSums, rank_share),
so that hand-computed values in the loss tests check the loop's own math; and the run the resume test repeats
(resume_run), in the test's process and in the one it kills."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from edgeflow.distill import TokenDataset, build_student, resolve_layer_map, train
from edgeflow.distill.data import TOKEN_SCHEMA
from edgeflow.distill.losses import StepSums, hidden_sums, kd_sums, rank_share
from edgeflow.profile import DistillConfig

TERMS = ("kd", "ce", "hidden_mse", "total")


def write_sequences(seqs: list[list[int]], out: Path) -> Path:
    """Already tokenized sequences as a training-set Parquet file (same layout as build_token_dataset's)."""
    n = [len(x) for x in seqs]
    table = pa.table({"input_ids": seqs, "n_tokens": n, "source": [0] * len(seqs), "record": list(range(len(seqs))),
                      "truncated": [False] * len(seqs)}, schema=TOKEN_SCHEMA)
    stats = {"samples": len(seqs), "truncated": 0, "overlong": 0, "tokens": sum(n), "files": [], "max_seq_len": max(n, default=0)}
    table = table.replace_schema_metadata({"edgeflow": json.dumps(stats)})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="none")
    return out


def _one_process(sums: StepSums, alpha: float, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """What train() computes for a step in one process (its divisors summed over one process are its own): the loss
    with its gradient, and the terms it logs."""
    total, shares = rank_share(sums, sums.divisors(), alpha, beta)
    return total, dict(zip(TERMS, shares.tolist()))


def kd_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float,
             ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p_T ‖ p_S at temperature T)·T², CE(student, labels)), each averaged over non-ignored tokens, with gradients."""
    kd, ce, n = kd_sums(student_logits, teacher_logits, labels, temperature, ignore_index)
    return kd / n, ce / n


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, alpha: float, temperature: float,
            ignore_index: int = -100) -> tuple[torch.Tensor, dict[str, float]]:
    """α·KL(p_T ‖ p_S at temperature T)·T² + (1−α)·CE(student, labels) as train() computes it, with its terms
    (kd, ce, hidden_mse=0, total)."""
    return _one_process(StepSums(*kd_sums(student_logits, teacher_logits, labels, temperature, ignore_index)), alpha, 0.0)


def hidden_mse(student_hidden: Sequence[torch.Tensor], teacher_hidden: Sequence[torch.Tensor], attention_mask: torch.Tensor,
               projections: Sequence[torch.nn.Module | None] | None = None, relative: bool = True) -> torch.Tensor:
    """Mean over mapped layer pairs of the (projected) student's hidden-state error, padding excluded.

    relative=True: the term train() uses (rank_share's, each layer's MSE divided by the teacher's mean square);
    relative=False: the plain per-element MSE (hidden_sums' squared error over its element count), for comparison.
    """
    sse, tsq, n = hidden_sums(student_hidden, teacher_hidden, attention_mask, projections)
    if not relative:
        return (sse / n).mean()
    zero = sse.new_zeros(())
    # alpha=0, beta=1 with no KD/CE sums: the step loss is the hidden-state term alone
    total, _ = _one_process(StepSums(kd=zero, ce=zero, n_tokens=sse.new_ones(()), sse=sse, tsq=tsq), alpha=0.0, beta=1.0)
    return total


def combine(kd: torch.Tensor, ce: torch.Tensor, hidden: torch.Tensor | None, alpha: float,
            beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """α·kd + (1−α)·ce + β·hidden for terms already averaged, weighted by rank_share (divisors of 1), with the terms
    as train() logs them (hidden_mse is 0.0 when the term is off)."""
    one = kd.new_ones(())
    sums = StepSums(kd=kd, ce=ce, n_tokens=one, sse=None if hidden is None else hidden.reshape(1),
                    tsq=None if hidden is None else one.reshape(1))
    return _one_process(sums, alpha, beta)


RESUME_CFG = dict(keep_layers=[1], steps=8, batch_size=3, lr=1e-3, checkpoint_every=2, beta=0.5, seed=7)


def resume_run(teacher_dir: Path, data: Path, ckpt: Path, log=None):
    """The run the resume test repeats: tiny_llama -> its 1-layer cut, with attention dropout so that training
    consumes the RNG (a resume must restore it) and the hidden-state term on (its state is resumed too)."""
    from transformers import AutoModelForCausalLM

    cfg = DistillConfig(**RESUME_CFG)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).requires_grad_(False)
    student, kept = build_student(teacher, cfg)
    for layer in student.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return train(teacher, student, TokenDataset(data), cfg, pad_id=0, layer_map=resolve_layer_map(cfg, 2, 1, kept),
                 checkpoint_dir=ckpt, log=log)


def require_deepspeed() -> None:
    """Skip where DeepSpeed is not installed; a failure in CI (tests/helpers/require.py)."""
    import importlib.util

    from tests.helpers.require import lacking

    if importlib.util.find_spec("deepspeed") is None:
        lacking("DeepSpeed is not installed", "`make test` installs it with the test extra: pip install -e '.[test]'")
