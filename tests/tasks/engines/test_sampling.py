"""The shared sampler (tasks/engines/sampling.py): seeds, truncation masses, penalties, logprobs, bounds."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from tasks.engines.sampling import EPSILON, SamplingParams, Sampler, Token, excluded_mass_bound

V = 50


def _logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, V).astype(np.float32)


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> Counter:
    s = Sampler(params)
    ids = np.arange(V)
    out = Counter()
    for _ in range(n):
        s.output_counts.clear()  # independent draws from the same distribution
        out[int(s.choose(ids, logits))] += 1
    return out


def _probs(logits: np.ndarray, t: float) -> np.ndarray:
    z = logits.astype(np.float64) / t
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.fixture(scope="session", autouse=True)
def _export_teacher() -> None:
    """Pure numpy: no teacher needed (overrides the autouse fixture of tests/conftest.py)."""


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = _logits()

    def seq(seed: int) -> list[int]:
        return [int(t) for t in _seq(SamplingParams(temperature=1.0, seed=seed), logits, 40)]

    assert seq(7) == seq(7)
    assert seq(7) != seq(8)


def _seq(p: SamplingParams, logits: np.ndarray, n: int) -> list[Token]:
    s = Sampler(p)
    return [s.choose(np.arange(V), logits) for _ in range(n)]


def test_temperature_zero_is_argmax_and_penalties_change_it() -> None:
    logits = _logits(1)
    best = int(np.argmax(logits))
    assert {int(t) for t in _seq(SamplingParams(), logits, 5)} == {best}
    # a presence penalty larger than the gap to the runner-up moves greedy decoding off a token once used
    gap = float(np.sort(logits)[-1] - np.sort(logits)[-2])
    toks = [int(t) for t in _seq(SamplingParams(presence_penalty=min(2.0, gap + 0.1)), logits, 2)]
    if gap + 0.1 <= 2.0:
        assert toks[0] == best and toks[1] != best
    rep = [int(t) for t in _seq(SamplingParams(repetition_penalty=10.0), logits, 3)]
    assert len(set(rep)) == 3  # each chosen token is divided (or multiplied) by 10 afterwards


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    logits = _logits(2)
    k = 3
    got = _draws(SamplingParams(temperature=1.5, top_k=k, seed=0), logits, 600)
    assert set(got) <= set(np.argsort(-logits)[:k].tolist())
    assert len(got) == k


def test_top_p_keeps_the_smallest_set_reaching_p_and_its_mass() -> None:
    logits = _logits(3)
    p = _probs(logits, 1.0)
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    n = int(np.searchsorted(cum, 0.5)) + 1
    allowed = set(order[:n].tolist())
    got = _draws(SamplingParams(temperature=1.0, top_p=0.5, seed=1), logits, 2000)
    assert set(got) <= allowed and len(got) == n
    # frequencies follow the renormalised probabilities (chi-square-ish tolerance for 2000 draws)
    q = p[order[:n]] / p[order[:n]].sum()
    for tok, qq in zip(order[:n], q):
        assert abs(got[int(tok)] / 2000 - qq) < 0.05


def test_logprobs_are_the_raw_distribution() -> None:
    logits = _logits(4)
    s = Sampler(SamplingParams(temperature=0.5, top_k=2, logprobs=True, top_logprobs=5, seed=3))
    tok = s.choose(np.arange(V), logits)
    ref = np.log(_probs(logits, 1.0))
    assert tok.logprob == pytest.approx(ref[int(tok)], abs=1e-6)
    assert [t for t, _ in tok.top_logprobs] == np.argsort(-logits)[:5].tolist()
    assert all(lp == pytest.approx(ref[t], abs=1e-6) for t, lp in tok.top_logprobs)
    assert sum(math.exp(v) for v in ref) == pytest.approx(1.0)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_k", -2),
                                         ("repetition_penalty", 0.0), ("frequency_penalty", 3.0), ("top_logprobs", 21),
                                         ("temperature", float("nan"))])
def test_out_of_range_parameters_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_excluded_mass_bound_holds() -> None:
    logits = _logits(5).astype(np.float64)
    t = 0.8
    p = _probs(logits, t)
    best = float(logits.max())
    cut = best - t * math.log(1 / EPSILON) * 0.1  # a narrow window: many tokens left out
    kept, out = logits >= cut, logits < cut
    bound = excluded_mass_bound(logits[out] + 0.01, best, logits[kept], t)  # upper bounds a little above truth
    assert p[out].sum() <= bound + 1e-12
    assert excluded_mass_bound(np.array([]), best, logits, t) == 0.0


def test_set_fields_and_plain_greedy() -> None:
    assert SamplingParams().plain_greedy and SamplingParams().set_fields() == []
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    assert not p.plain_greedy and p.set_fields() == ["logprobs", "top_logprobs"]
