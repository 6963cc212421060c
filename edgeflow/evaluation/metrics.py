"""Consistency math on logits: agreement, KL, perplexity (numpy, no model code)."""
from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, in float64 (in place on one copy: the gate runs it on
    every engine's [positions, vocabulary] logits)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def top1_agreement(ref: np.ndarray, cand: np.ndarray) -> float:
    """Fraction of positions where both logits pick the same argmax token; inputs [n, vocab]."""
    return float((ref.argmax(-1) == cand.argmax(-1)).mean())


def kl_per_position(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """KL(p_ref ‖ p_cand) per position, in nats; inputs [n, vocab]."""
    lr, lc = log_softmax(ref), log_softmax(cand)
    return (np.exp(lr) * (lr - lc)).sum(-1)


def logsumexp_outside(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per row, log Σ exp(logp) over the tokens *not* in `ids` ([n, k]): -inf where ids cover the row."""
    rest = logp.astype(np.float64).copy()
    np.put_along_axis(rest, ids.astype(np.int64), -np.inf, -1)
    peak = rest.max(-1)
    shift = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):
        return shift + np.log(np.exp(rest - shift[:, None]).sum(-1))


# Outside mass below which log_mass_outside sums the rest of the vocabulary instead of subtracting: 1 - sum(top-k)
# in float64 is good to about 1e-15 absolute, so above 1e-6 its relative error stays under 1e-9.
EXACT_BELOW = 1e-6


def log_mass_outside(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """logsumexp_outside for normalized float64 log-probabilities (each row's exp sums to 1): log(1 - sum of the k
    probabilities), which reads k columns instead of the whole vocabulary. Rows whose outside mass is under
    EXACT_BELOW, where the subtraction would lose digits, and any other dtype go through logsumexp_outside."""
    if logp.dtype != np.float64:
        return logsumexp_outside(logp, ids)
    ids = ids.astype(np.int64)
    outside = 1.0 - np.exp(np.take_along_axis(logp, ids, -1)).sum(-1)
    exact = outside < EXACT_BELOW
    out = np.log(np.where(exact, 1.0, outside))
    if exact.any():
        out[exact] = logsumexp_outside(logp[exact], ids[exact])
    return out


def kl_from_top_k(ref_ids: np.ndarray, ref_logp: np.ndarray, ref_tail_logp: np.ndarray, cand_logp: np.ndarray) -> np.ndarray:
    """KL(p_ref ‖ p_cand) per position when only the reference's top-k is known: the k tokens plus one bucket for
    the rest of the vocabulary on each side. Exact when the top-k holds all of p_ref's mass; otherwise the KL of
    the coarsened distributions, a lower bound on the full KL (log-sum inequality).

    ref_ids/ref_logp: [n, k]; ref_tail_logp: [n], log of the reference mass outside its top-k (-inf when none), stored
    in the log domain because 1 - sum(top-k) in float32 is rounding noise; cand_logp: the candidate's full [n, vocab].
    """
    ref_logp = ref_logp.astype(np.float64)
    ids = ref_ids.astype(np.int64)
    q_logp = np.take_along_axis(cand_logp, ids, -1).astype(np.float64)
    head = (np.exp(ref_logp) * (ref_logp - q_logp)).sum(-1)
    q_tail_logp = log_mass_outside(cand_logp, ids)
    p_tail_logp = ref_tail_logp.astype(np.float64)
    with np.errstate(invalid="ignore"):
        tail = np.where(np.isfinite(p_tail_logp), np.exp(p_tail_logp) * (p_tail_logp - q_tail_logp), 0.0)
    return head + tail


def nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of `targets` [n] under `logits` [n, vocab]."""
    lp = log_softmax(logits)
    return float(-lp[np.arange(len(targets)), targets].sum())


class Accumulator:
    """Collects per-sequence comparisons of a candidate against the reference."""

    def __init__(self) -> None:
        self.agree = self.agree_last = self.n_pos = self.n_seq = 0
        self.kls: list[np.ndarray] = []
        self.seq_agreement: list[float] = []  # per-sequence top-1 agreement, for the histogram
        self.nll_ref = self.nll_cand = 0.0

    def add(self, ref: np.ndarray, cand: np.ndarray, input_ids: list[int]) -> None:
        """ref/cand: logits [len, vocab] for one sequence; position t predicts input_ids[t+1]."""
        self.add_logprobs(log_softmax(ref), log_softmax(cand), input_ids)

    def add_logprobs(self, ref: np.ndarray, cand: np.ndarray, input_ids: list[int]) -> None:
        """Like add, from log-probabilities (the gate computes each model's once and compares it many times)."""
        ref = ref[:-1]
        targets = np.asarray(input_ids[1:])
        self._add(ref.argmax(-1), (np.exp(ref) * (ref - cand[:-1])).sum(-1), ref[np.arange(len(targets)), targets], cand, input_ids)

    def add_top_k(self, ref_ids: np.ndarray, ref_logp: np.ndarray, ref_tail_logp: np.ndarray, ref_target_logp: np.ndarray,
                  cand: np.ndarray, input_ids: list[int]) -> None:
        """Like add_logprobs, against a stored reference: its top-k per position ([L, k], column 0 the argmax), the log
        of its mass outside them ([L]) and the log-probability of each next token ([L-1]); KL from kl_from_top_k.
        cand: the candidate's [L, vocab] log-probabilities."""
        kl = kl_from_top_k(ref_ids[:-1], ref_logp[:-1], ref_tail_logp[:-1], cand[:-1])
        self._add(ref_ids[:-1, 0], kl, ref_target_logp, cand, input_ids)

    def _add(self, ref_argmax: np.ndarray, kl: np.ndarray, ref_target_logp: np.ndarray, cand: np.ndarray,
             input_ids: list[int]) -> None:
        cand = cand[:-1]
        targets = np.asarray(input_ids[1:])
        same = ref_argmax == cand.argmax(-1)
        self.agree += int(same.sum())
        self.seq_agreement.append(float(same.mean()))
        self.agree_last += int(same[-1])
        self.n_pos += len(targets)
        self.n_seq += 1
        self.kls.append(kl)
        self.nll_ref -= float(np.sum(ref_target_logp))
        self.nll_cand -= float(cand[np.arange(len(targets)), targets].sum())

    def kl_values(self) -> np.ndarray:
        """Every position's KL, for the distribution plot."""
        return np.concatenate(self.kls) if self.kls else np.zeros(0)

    def result(self) -> dict[str, float]:
        kl = np.concatenate(self.kls) if self.kls else np.zeros(1)
        ppl_ref = float(np.exp(self.nll_ref / max(self.n_pos, 1)))
        ppl = float(np.exp(self.nll_cand / max(self.n_pos, 1)))
        return {
            "top1_agreement": self.agree / max(self.n_pos, 1),
            "top1_agreement_last": self.agree_last / max(self.n_seq, 1),
            "kl": float(kl.mean()),
            "kl_p99": float(np.percentile(kl, 99)),
            "ppl": ppl,
            "ppl_ref": ppl_ref,
            "ppl_increase": ppl / ppl_ref - 1.0,
            "positions": self.n_pos,
            "sequences": self.n_seq,
        }


class LayerError:
    """Relative error of each decoder layer's output hidden states, ‖h_ref − h‖ / ‖h_ref‖, pooled over sequences.

    Measured on block outputs, not weights: AWQ folds per-channel scales into neighbouring layers, so a
    weight-space comparison with the original model would count that exact rescaling as error, while a
    block's output is invariant to it. Errors accumulate with depth, which is what the plot shows.
    """

    def __init__(self) -> None:
        self.diff: np.ndarray | None = None
        self.ref: np.ndarray | None = None

    def add(self, ref: list[np.ndarray], cand: list[np.ndarray]) -> None:
        """ref/cand: one [len, hidden] array per decoder layer output, same order."""
        d = np.array([float(((r.astype(np.float64) - c) ** 2).sum()) for r, c in zip(ref, cand, strict=True)])
        n = np.array([float((r.astype(np.float64) ** 2).sum()) for r in ref])
        self.diff = d if self.diff is None else self.diff + d
        self.ref = n if self.ref is None else self.ref + n

    def result(self) -> list[float]:
        if self.diff is None:
            return []
        return [float(x) for x in np.sqrt(self.diff / np.maximum(self.ref, 1e-30))]


def greedy_exact_match(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Fraction of prompts whose greedy continuation is token-for-token identical."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference continuations vs {len(candidate)} candidate ones")
    return sum(r == c for r, c in zip(reference, candidate)) / max(len(reference), 1)
