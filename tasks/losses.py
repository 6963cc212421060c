"""Distillation loss math, apart from the training loop (tested on hand-computed tensors)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    temperature: float,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, float]]:
    """α·KL(p_T ‖ p_S at temperature T)·T² + (1−α)·CE(student, labels), averaged over non-ignored tokens.

    Logits are [batch, seq, vocab] and already aligned with `labels` (position t predicts labels[t]).
    """
    mask = labels != ignore_index
    s = student_logits[mask].float()
    t = teacher_logits[mask].float()
    log_ps = F.log_softmax(s / temperature, dim=-1)
    log_pt = F.log_softmax(t / temperature, dim=-1)
    # KL(p_T || p_S) = sum p_T (log p_T - log p_S); T² keeps gradient scale independent of T (Hinton et al.).
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * temperature**2
    ce = F.cross_entropy(s, labels[mask])
    loss = alpha * kl + (1 - alpha) * ce
    return loss, {"kl": kl.item(), "ce": ce.item(), "loss": loss.item()}
