"""Distillation loss math, apart from the training loop (tested on hand-computed tensors).

total = α·KL(p_T ‖ p_S at temperature T)·T² + (1−α)·CE(student, labels) + β·MSE(proj(h_S), h_T) / mean(h_T²)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F


def kd_terms(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p_T ‖ p_S at temperature T)·T², CE(student, labels)), each averaged over non-ignored tokens.

    Logits are [batch, seq, vocab] and already aligned with `labels` (position t predicts labels[t]).
    """
    mask = labels != ignore_index
    s = student_logits[mask].float()
    t = teacher_logits[mask].float()
    log_ps = F.log_softmax(s / temperature, dim=-1)
    log_pt = F.log_softmax(t / temperature, dim=-1)
    # KL(p_T || p_S) = sum p_T (log p_T - log p_S); T² keeps the gradient scale independent of T (Hinton et al.).
    kd = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * temperature**2
    ce = F.cross_entropy(s, labels[mask])
    return kd, ce


def hidden_mse(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    attention_mask: torch.Tensor,
    projections: Sequence[torch.nn.Module | None] | None = None,
    relative: bool = True,
) -> torch.Tensor:
    """Mean over mapped layer pairs of the per-element MSE between (projected) student and teacher hidden states.

    student_hidden[i] ([batch, seq, d_S]) is matched with teacher_hidden[i] ([batch, seq, d_T]); when d_S != d_T,
    projections[i] maps d_S -> d_T (a learned linear layer). Padding positions (attention_mask == 0) are excluded.
    relative=True divides each layer's MSE by the teacher hidden state's mean square (a constant, no gradient).
    """
    if len(student_hidden) != len(teacher_hidden):
        raise ValueError(f"hidden_mse got {len(student_hidden)} student and {len(teacher_hidden)} teacher layers; pass one of each per mapped pair")
    if not student_hidden:
        raise ValueError("hidden_mse needs at least one mapped layer pair")
    projections = projections or [None] * len(student_hidden)
    mask = attention_mask.bool()
    per_layer = []
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
        mse = F.mse_loss(hs, ht)
        if relative:
            # The residual stream's scale differs by orders of magnitude across layers (SmolLM2-135M: mean square
            # ~50 after layer 3, ~16,000 after layer 12, where a few "massive activation" channels reach 25,000).
            # Raw MSE would be dominated by those layers and dwarf the KD term; relative MSE weighs layers alike.
            mse = mse / ht.pow(2).mean().detach().clamp_min(1e-12)
        per_layer.append(mse)
    return torch.stack(per_layer).mean()


def make_projections(student_layers: Sequence[int], student_width: int, teacher_width: int) -> torch.nn.ModuleDict:
    """One learned student->teacher linear map per mapped student layer; empty when the widths already match."""
    if student_width == teacher_width:
        return torch.nn.ModuleDict()
    # Projection from the student side (FitNets): the teacher's representation stays the fixed target.
    return torch.nn.ModuleDict({str(j): torch.nn.Linear(student_width, teacher_width, bias=False) for j in student_layers})


def combine(kd: torch.Tensor, ce: torch.Tensor, hidden: torch.Tensor | None, alpha: float, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """α·kd + (1−α)·ce + β·hidden, and each term as a float for logging (hidden_mse is 0.0 when off)."""
    total = alpha * kd + (1 - alpha) * ce
    if hidden is not None and beta > 0:
        total = total + beta * hidden
    parts = {"kd": kd.item(), "ce": ce.item(), "hidden_mse": hidden.item() if hidden is not None else 0.0, "total": total.item()}
    return total, parts


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    temperature: float,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, float]]:
    """α·KL(p_T ‖ p_S at temperature T)·T² + (1−α)·CE(student, labels), with its terms (kd, ce, hidden_mse=0, total)."""
    kd, ce = kd_terms(student_logits, teacher_logits, labels, temperature, ignore_index)
    return combine(kd, ce, None, alpha, 0.0)


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
