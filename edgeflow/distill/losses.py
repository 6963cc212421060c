"""Distillation loss math, apart from the training loop (edgeflow/distill/train.py calls kd_sums, hidden_sums, StepSums and
rank_share every step; tests/distill/test_losses.py checks them on hand-computed tensors).

total = α·KL(p_T ‖ p_S at temperature T)·T² + (1−α)·CE(student, labels) + β·MSE(proj(h_S), h_T) / mean(h_T²)

Every term is a sum over the step's tokens divided by a count (or, for the relative MSE, by the teacher's sum of
squares). The *_sums functions return the sums and the divisors separately, so that a step split across processes
divides each process's sums by the divisors of the whole step (StepSums, rank_share) and the processes' shares add
up to exactly the one-process loss.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def kd_sums(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ KL(p_T ‖ p_S at temperature T)·T², Σ CE(student, labels), number of target tokens) over non-ignored tokens.

    Logits are [batch, seq, vocab] and already aligned with `labels` (position t predicts labels[t]).
    """
    mask = labels != ignore_index
    s = student_logits[mask].float()
    t = teacher_logits[mask].float()
    log_ps = F.log_softmax(s / temperature, dim=-1)
    log_pt = F.log_softmax(t / temperature, dim=-1)
    # KL(p_T || p_S) = sum p_T (log p_T - log p_S); T² keeps the gradient scale independent of T (Hinton et al.).
    kd = (log_pt.exp() * (log_pt - log_ps)).sum() * temperature**2
    ce = F.cross_entropy(s, labels[mask], reduction="sum")
    return kd, ce, mask.sum()


def teacher_topk(teacher_logits: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, log-probabilities) of the teacher's k most likely tokens at temperature T, per position.

    What the teacher-output cache stores (edgeflow/distill/teacher_cache.py): log p_T(i) = log_softmax(z / T)_i of the
    full vocabulary, so the mass outside the top k is known (1 − Σ p) without the other logits.
    """
    log_pt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    values, indices = log_pt.topk(min(k, log_pt.shape[-1]), dim=-1)
    return indices, values


def kd_sums_topk(
    student_logits: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_logp: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kd_sums with the teacher given as its top-k log-probabilities at temperature T (teacher_topk), not its logits.

    The KL is taken over k + 1 outcomes: the teacher's k tokens, and "any other token" with the teacher's remaining
    mass 1 − Σ p_T and the student's 1 − Σ p_S over the same k. That is a proper KL between two coarsened
    distributions: never above the full-vocabulary KL (merging outcomes cannot raise a KL), equal to it when k is the
    vocabulary size, and it still pulls down the student's mass outside the teacher's top k.
    topk_indices/topk_logp are [batch, seq, k] aligned with `labels`; the rest as in kd_sums.
    """
    mask = labels != ignore_index
    s = student_logits[mask].float()
    idx = topk_indices[mask].long()
    log_pt = topk_logp[mask].float()
    log_ps_all = F.log_softmax(s / temperature, dim=-1)
    log_ps = log_ps_all.gather(-1, idx)
    kd_top = (log_pt.exp() * (log_pt - log_ps)).sum()
    # the rest: log(1 − Σ p) computed as log1p(−Σ p), clamped where the k tokens hold (numerically) all the mass
    rest_t = (-log_pt.exp().sum(-1)).clamp(min=-1.0 + 1e-7).log1p()
    rest_s = (-log_ps.exp().sum(-1)).clamp(min=-1.0 + 1e-7).log1p()
    p_rest = rest_t.exp()
    kd_rest = torch.where(p_rest > 1e-6, p_rest * (rest_t - rest_s), torch.zeros_like(p_rest)).sum()
    kd = (kd_top + kd_rest) * temperature**2
    ce = F.cross_entropy(s, labels[mask], reduction="sum")
    return kd, ce, mask.sum()


# Guards the relative MSE's divisor against an all-zero teacher hidden state.
_TINY = 1e-12


def hidden_sums(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    attention_mask: torch.Tensor,
    projections: Sequence[torch.nn.Module | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per mapped layer pair, over non-padding positions: (Σ squared error of the (projected) student hidden state,
    Σ teacher hidden state² (no gradient), number of elements per layer); the first two are [n_layers] tensors.

    student_hidden[i] ([batch, seq, d_S]) is matched with teacher_hidden[i] ([batch, seq, d_T]); when d_S != d_T,
    projections[i] maps d_S -> d_T (a learned linear layer).
    """
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(f"hidden_mse got {len(student_hidden)} student and {len(teacher_hidden)} teacher layers; pass one of each per mapped pair")
    if not student_hidden:
        raise ValueError("hidden_mse needs at least one mapped layer pair")
    projections = projections or [None] * len(student_hidden)
    mask = attention_mask.bool()
    sse, tsq = [], []
    n = None
    for hs, ht, proj in zip(student_hidden, teacher_hidden, projections):
        hs = hs[mask].float()
        ht = ht[mask].float()
        if proj is not None:
            hs = proj(hs)
        if hs.shape[-1] != ht.shape[-1]:
            raise ValueError(
                f"hidden_mse: student width {hs.shape[-1]} != teacher width {ht.shape[-1]} and no projection given; "
                "pass a linear projection (make_projections) for layers whose widths differ"
            )
        sse.append((hs - ht).pow(2).sum())
        tsq.append(ht.pow(2).sum().detach())
        n = ht.numel()
    return torch.stack(sse), torch.stack(tsq), torch.tensor(n, device=sse[0].device)


@dataclass
class StepSums:
    """One process's share of a step's loss terms as sums (kd_sums, hidden_sums); sse/tsq are None without the beta term."""

    kd: torch.Tensor
    ce: torch.Tensor
    n_tokens: torch.Tensor
    sse: torch.Tensor | None = None
    tsq: torch.Tensor | None = None

    def divisors(self) -> torch.Tensor:
        """[target tokens, Σ teacher² per mapped layer...] (float64, no gradient): what the sums are divided by.

        Summed over the processes of a step (all_reduce), it is the whole step's divisors.
        """
        parts = [self.n_tokens.detach().reshape(1).double()]
        if self.tsq is not None:
            parts.append(self.tsq.detach().double())
        return torch.cat(parts)


def rank_share(sums: StepSums, divisors: torch.Tensor, alpha: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(this process's share of the step loss, its [kd, ce, hidden_mse, total] shares, no gradient).

    `divisors` are the whole step's (StepSums.divisors summed over processes): the shares of all processes then
    add up to the loss of the whole step computed in one process, term by term.
    """
    d = divisors.to(sums.kd.dtype)
    kd, ce = sums.kd / d[0], sums.ce / d[0]
    total = alpha * kd + (1 - alpha) * ce
    hid = torch.zeros_like(kd)
    if sums.sse is not None and beta > 0:
        # Relative MSE. The residual stream's scale differs by orders of magnitude across layers (SmolLM2-135M: mean
        # square ~50 after layer 3, ~16,000 after layer 12, where a few "massive activation" channels reach 25,000).
        # Raw MSE would be dominated by those layers and dwarf the KD term; relative MSE weighs layers alike.
        # MSE / mean(h_T²) = Σ error² / Σ h_T²: the element count cancels.
        hid = (sums.sse / d[1:].clamp_min(_TINY)).mean()
        total = total + beta * hid
    return total, torch.stack([kd, ce, hid, total]).detach()


def make_projections(student_layers: Sequence[int], student_width: int, teacher_width: int) -> torch.nn.ModuleDict:
    """One learned student->teacher linear map per mapped student layer; empty when the widths already match."""
    if student_width == teacher_width:
        return torch.nn.ModuleDict()
    # Projection from the student side (FitNets): the teacher's representation stays the fixed target.
    return torch.nn.ModuleDict({str(j): torch.nn.Linear(student_width, teacher_width, bias=False) for j in student_layers})


def default_layer_map(kept: Sequence[int]) -> dict[int, int]:
    """Teacher layer -> student layer for a layer-dropped student: student layer j was teacher layer kept[j].

    Student layer j then learns to leave the residual stream where the teacher has it after layer kept[j],
    i.e. to stand in for the teacher layers it skipped since kept[j-1].
    """
    return {t: s for s, t in enumerate(kept)}


def spread_layer_map(n_teacher: int, n_student: int) -> dict[int, int]:
    """Teacher layer -> student layer for an unrelated student: evenly spaced, last layer to last layer."""
    return {round((j + 1) * n_teacher / n_student) - 1: j for j in range(n_student)}


def check_layer_map(layer_map: Mapping[int, int], n_teacher: int, n_student: int, field: str = "distill.hidden_layer_map") -> None:
    """Raise naming the field when a mapped layer does not exist in the teacher or the student."""
    bad_t = sorted(t for t in layer_map if not 0 <= t < n_teacher)
    bad_s = sorted(s for s in layer_map.values() if not 0 <= s < n_student)
    if bad_t or bad_s:
        raise ValueError(
            f"{field}={dict(layer_map)} names layers that do not exist: teacher {bad_t} (teacher has layers 0..{n_teacher - 1}), "
            f"student {bad_s} (student has layers 0..{n_student - 1}); fix the map or remove it to use the default"
        )
