import math

import numpy as np

import pytest

from edgeflow.evaluation.metrics import Accumulator, LayerError, greedy_exact_match, kl_per_position, log_softmax, nll, top1_agreement


def test_top1_agreement_on_known_tensors():
    ref = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    cand = np.array([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [0.0, 0.0, 1.0], [0.0, 4.0, 0.0]])
    assert top1_agreement(ref, cand) == 0.5


def test_kl_on_known_distribution():
    ref = np.log(np.array([[0.25, 0.75]]))
    cand = np.log(np.array([[0.5, 0.5]]))
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert math.isclose(kl_per_position(ref, cand)[0], expected, rel_tol=1e-9)
    assert abs(kl_per_position(ref, ref)[0]) < 1e-12


def test_log_softmax_is_stable_for_large_logits():
    x = np.array([[1000.0, 1000.0]])
    assert np.allclose(np.exp(log_softmax(x)), 0.5)


def test_accumulator_perplexity_and_last_position():
    vocab = 4
    uniform = np.zeros((3, vocab))
    ids = [0, 1, 2]
    acc = Accumulator()
    acc.add(uniform, uniform, ids)
    r = acc.result()
    assert math.isclose(r["ppl"], vocab, rel_tol=1e-9)  # uniform over 4 tokens -> perplexity 4
    assert r["top1_agreement"] == 1.0 and r["top1_agreement_last"] == 1.0
    assert r["positions"] == 2 and math.isclose(nll(uniform[:2], np.array([1, 2])), 2 * math.log(4))


def test_greedy_exact_match_counts_only_identical_continuations():
    ref = [[1, 2, 3], [4, 5], [6]]
    assert greedy_exact_match(ref, [[1, 2, 3], [4, 5], [6]]) == 1.0
    assert greedy_exact_match(ref, [[1, 2, 3], [4, 5, 9], [7]]) == pytest.approx(1 / 3)  # longer or different: no match
    with pytest.raises(ValueError, match="3 reference continuations vs 2"):
        greedy_exact_match(ref, [[1], [2]])


def test_accumulator_keeps_per_sequence_agreement_and_every_kl():
    vocab = 3
    a = Accumulator()
    same = np.log(np.full((4, vocab), 1 / vocab))
    a.add(same, same, [0, 1, 2, 0])  # 3 positions, all agree
    ref = np.array([[5.0, 0, 0], [5.0, 0, 0], [5.0, 0, 0]])
    cand = np.array([[0, 5.0, 0], [5.0, 0, 0], [0, 5.0, 0]])
    a.add(ref, cand, [0, 1, 2])  # 2 positions: first disagrees, second agrees
    assert a.seq_agreement == [1.0, 0.5]
    kl = a.kl_values()
    assert kl.shape == (5,) and np.allclose(kl[:3], 0) and kl[3] > 4 and abs(kl[4]) < 1e-12


def test_layer_error_is_relative_and_pooled_over_sequences():
    e = LayerError()
    ref = [np.ones((2, 4)), np.full((2, 4), 2.0)]
    e.add(ref, [np.ones((2, 4)), np.full((2, 4), 2.2)])  # layer 0 exact, layer 1 off by 10 %
    assert e.result() == pytest.approx([0.0, 0.1])
    e.add(ref, [np.full((2, 4), 1.5), np.full((2, 4), 2.0)])  # pooled: sqrt(sum d^2 / sum ref^2)
    assert e.result() == pytest.approx([np.sqrt(0.25 * 8 / 16), np.sqrt(0.04 * 8 / 64)])
    with pytest.raises(ValueError):
        e.add(ref, ref[:1])  # a missing layer is an error, not a silent truncation


def test_log_mass_outside_matches_the_sum_over_the_rest_of_the_vocabulary():
    """The gate's fast tail (1 - sum of the k probabilities) against the full sum, on rows from flat to so peaked
    that the subtraction would lose every digit (those rows take the exact path)."""
    from edgeflow.evaluation.metrics import EXACT_BELOW, log_mass_outside, logsumexp_outside

    rng = np.random.default_rng(0)
    scales = [0.1, 1.0, 5.0, 20.0, 60.0, 400.0]  # logit spread: the last rows put ~all mass on one token
    logp = log_softmax(np.concatenate([rng.standard_normal((8, 3000)) * s for s in scales]))
    ids = np.argsort(-logp, axis=-1)[:, :16]
    exact = logsumexp_outside(logp, ids)
    fast = log_mass_outside(logp, ids)
    assert np.allclose(fast, exact, rtol=1e-9, atol=0)
    outside = np.exp(exact)
    assert (outside < EXACT_BELOW).any() and (outside > 0.5).any()  # both paths ran
    assert (outside[outside < EXACT_BELOW] < 1e-12).any()  # where 1 - sum(top-k) is pure rounding noise
    # every token listed: nothing outside, as logsumexp_outside says
    all_ids = np.argsort(-logp[:2], axis=-1)
    assert np.isneginf(log_mass_outside(logp[:2], all_ids)).all()
    # float32 log-probabilities are not normalized to float64 precision: the exact path
    assert np.array_equal(log_mass_outside(logp.astype(np.float32), ids), logsumexp_outside(logp.astype(np.float32), ids))
