import math

import pytest
import torch

from edgeflow.distill.losses import (
    check_layer_map,
    default_layer_map,
    make_projections,
    spread_layer_map,
)
from tests.helpers.distill import combine, hidden_mse, kd_loss, kd_terms


def test_kd_loss_matches_hand_computed_value():
    # one position, vocab 2: teacher logits [0, ln 3] -> p_T = [1/4, 3/4]; student logits [0, 0] -> p_S = [1/2, 1/2]
    t = torch.tensor([[[0.0, math.log(3.0)]]])
    s = torch.tensor([[[0.0, 0.0]]], requires_grad=True)
    labels = torch.tensor([[1]])
    loss, parts = kd_loss(s, t, labels, alpha=0.5, temperature=1.0)
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    ce = math.log(2.0)
    assert math.isclose(parts["kd"], kl, rel_tol=1e-6)
    assert math.isclose(parts["ce"], ce, rel_tol=1e-6)
    assert math.isclose(loss.item(), 0.5 * kl + 0.5 * ce, rel_tol=1e-6)
    assert parts["total"] == pytest.approx(loss.item()) and parts["hidden_mse"] == 0.0


def test_kd_loss_scales_kl_by_t_squared_and_ignores_padding():
    t = torch.tensor([[[0.0, 2.0], [5.0, -5.0]]])
    s = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[0, -100]])  # second position is padding
    _, parts = kd_loss(s, t, labels, alpha=1.0, temperature=2.0)
    pt = torch.softmax(t[0, 0] / 2, -1)
    ps = torch.softmax(s[0, 0] / 2, -1)
    expected = float((pt * (pt.log() - ps.log())).sum()) * 4.0
    assert math.isclose(parts["kd"], expected, rel_tol=1e-5)
    assert math.isclose(parts["total"], expected, rel_tol=1e-5)


def test_t_squared_keeps_the_soft_target_gradient_scale_independent_of_t():
    """Hinton et al.: d(KL_T·T²)/dz_S -> (z_S − z_T)/V for large T (zero-mean logits), the same at any T; without T² it would shrink as 1/T²."""
    torch.manual_seed(0)
    z_t = torch.randn(1, 1, 8)
    z_t -= z_t.mean()
    z_s0 = torch.randn(1, 1, 8)
    z_s0 -= z_s0.mean()
    labels = torch.zeros(1, 1, dtype=torch.long)
    grads = {}
    for temp in (200.0, 400.0):
        z_s = z_s0.clone().requires_grad_(True)
        kd, _ = kd_terms(z_s, z_t, labels, temp)
        kd.backward()
        grads[temp] = z_s.grad[0, 0]
    limit = (z_s0 - z_t)[0, 0] / 8
    assert torch.allclose(grads[200.0], limit, atol=2e-3) and torch.allclose(grads[400.0], limit, atol=1e-3)


def test_identical_distributions_have_zero_kl():
    x = torch.randn(2, 3, 7)
    labels = torch.zeros(2, 3, dtype=torch.long)
    _, parts = kd_loss(x, x.clone(), labels, alpha=1.0, temperature=3.0)
    assert abs(parts["kd"]) < 1e-6


def test_hidden_mse_by_hand_excludes_padding_and_averages_layers():
    # batch 1, 2 positions (second is padding), width 2; two mapped layers
    hs = [torch.tensor([[[1.0, 2.0], [9.0, 9.0]]]), torch.tensor([[[0.0, 0.0], [9.0, 9.0]]])]
    ht = [torch.tensor([[[3.0, 2.0], [0.0, 0.0]]]), torch.tensor([[[1.0, 1.0], [0.0, 0.0]]])]
    mask = torch.tensor([[1, 0]])
    raw = float(hidden_mse(hs, ht, mask, relative=False))
    # layer 0: ((1-3)² + 0²)/2 = 2; layer 1: (1 + 1)/2 = 1 -> mean 1.5
    assert raw == pytest.approx(1.5)
    rel = float(hidden_mse(hs, ht, mask))
    # relative: layer 0: 2 / ((9 + 4)/2) = 4/13; layer 1: 1 / 1 -> mean (4/13 + 1)/2
    assert rel == pytest.approx((4 / 13 + 1) / 2)


def test_relative_hidden_mse_weighs_layers_of_very_different_scale_alike():
    torch.manual_seed(0)
    small, big = torch.randn(1, 4, 8), 1000 * torch.randn(1, 4, 8)
    mask = torch.ones(1, 4)
    # the student is off by the same 10 % in both layers
    rel = float(hidden_mse([1.1 * small, 1.1 * big], [small, big], mask))
    assert rel == pytest.approx(0.01, rel=1e-4)
    raw = float(hidden_mse([1.1 * small, 1.1 * big], [small, big], mask, relative=False))
    assert raw > 1e3  # raw MSE is all about the big layer


def test_projection_path_maps_student_width_to_teacher_width_and_learns():
    projs = make_projections([0], student_width=2, teacher_width=3)
    assert list(projs) == ["0"] and projs["0"].weight.shape == (3, 2)
    assert len(make_projections([0, 1], 4, 4)) == 0  # same width: no projection
    with torch.no_grad():
        projs["0"].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    hs = torch.tensor([[[1.0, 2.0]]])  # projected: [1, 2, 3]
    ht = torch.tensor([[[1.0, 2.0, 5.0]]])
    loss = hidden_mse([hs], [ht], torch.ones(1, 1), [projs["0"]], relative=False)
    assert loss.item() == pytest.approx((5 - 3) ** 2 / 3)
    loss.backward()
    # d/dW of mean((W h - t)²) = 2/3 · (W h - t) hᵀ: only the third row has an error (-2)
    assert torch.allclose(projs["0"].weight.grad, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-4 / 3, -8 / 3]]))
    with pytest.raises(ValueError, match="no projection given"):
        hidden_mse([hs], [ht], torch.ones(1, 1))


def test_combine_weights_every_term():
    kd, ce, hid = torch.tensor(2.0), torch.tensor(3.0), torch.tensor(5.0)
    total, parts = combine(kd, ce, hid, alpha=0.8, beta=0.1)
    assert float(total) == pytest.approx(0.8 * 2 + 0.2 * 3 + 0.1 * 5)
    assert parts == pytest.approx({"kd": 2.0, "ce": 3.0, "hidden_mse": 5.0, "total": 0.8 * 2 + 0.2 * 3 + 0.1 * 5})
    total, _ = combine(kd, ce, hid, alpha=0.8, beta=0.0)
    assert float(total) == pytest.approx(0.8 * 2 + 0.2 * 3)


def test_layer_maps():
    assert default_layer_map([0, 3, 6, 29]) == {0: 0, 3: 1, 6: 2, 29: 3}
    m = spread_layer_map(30, 4)
    assert sorted(m.values()) == [0, 1, 2, 3] and m[29] == 3 and len(m) == 4
    check_layer_map({0: 0, 29: 3}, 30, 4)
    with pytest.raises(ValueError, match=r"teacher \[30\] \(teacher has layers 0..29\), student \[4\]"):
        check_layer_map({30: 4}, 30, 4)
