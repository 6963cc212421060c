import math

import torch

from tasks.losses import kd_loss


def test_kd_loss_matches_hand_computed_value():
    # one position, vocab 2: teacher logits [0, ln 3] -> p_T = [1/4, 3/4]; student logits [0, 0] -> p_S = [1/2, 1/2]
    t = torch.tensor([[[0.0, math.log(3.0)]]])
    s = torch.tensor([[[0.0, 0.0]]], requires_grad=True)
    labels = torch.tensor([[1]])
    loss, parts = kd_loss(s, t, labels, alpha=0.5, temperature=1.0)
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    ce = math.log(2.0)
    assert math.isclose(parts["kl"], kl, rel_tol=1e-6)
    assert math.isclose(parts["ce"], ce, rel_tol=1e-6)
    assert math.isclose(float(loss), 0.5 * kl + 0.5 * ce, rel_tol=1e-6)


def test_kd_loss_scales_kl_by_t_squared_and_ignores_padding():
    t = torch.tensor([[[0.0, 2.0], [5.0, -5.0]]])
    s = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[0, -100]])  # second position is padding
    _, parts = kd_loss(s, t, labels, alpha=1.0, temperature=2.0)
    pt = torch.softmax(t[0, 0] / 2, -1)
    ps = torch.softmax(s[0, 0] / 2, -1)
    expected = float((pt * (pt.log() - ps.log())).sum()) * 4.0
    assert math.isclose(parts["kl"], expected, rel_tol=1e-5)
    assert math.isclose(parts["loss"], expected, rel_tol=1e-5)


def test_identical_distributions_have_zero_kl():
    x = torch.randn(2, 3, 7)
    labels = torch.zeros(2, 3, dtype=torch.long)
    _, parts = kd_loss(x, x.clone(), labels, alpha=1.0, temperature=3.0)
    assert abs(parts["kl"]) < 1e-6
