"""The shared sampler (edgeflow/engines/sampling.py): seeds, truncation masses, penalties, logprobs, and the bounded draw's
distribution against the exact softmax."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from edgeflow.engines.sampling import SamplingParams, Sampler, Token

from tests.helpers.sampling import BIG_V, SETTINGS, TOP_K_SETTINGS, big_logits, chi_square_p, target, tied_logits_and_bounds

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


# ---------------------------------------------------------------------------------------------
# draw_bounded: the exact distribution from bounds and a few exact rows (rejection sampling)
# ---------------------------------------------------------------------------------------------

def bounded_draws(logits: np.ndarray, params: SamplingParams, n: int, counts: Counter = Counter(), width: float = 0.3,
                  max_rows: int = 1000, prompt: tuple[int, ...] = ()) -> tuple[np.ndarray, int, int]:
    """n independent draws by draw_bounded from bounds of random widths (up to `width`, the truth anywhere inside),
    each with the request's token counts reset to `counts`. Returns (counts per token, draws that needed the full head,
    rows rescored in all)."""
    rng = np.random.default_rng(99)
    lo = logits - rng.uniform(0, width, len(logits))
    up = logits + rng.uniform(0, width, len(logits))
    s = Sampler(params, prompt)
    drawn, fallbacks = np.zeros(len(logits), np.int64), 0
    for _ in range(n):
        reads = s.head_reads
        s.output_counts = Counter(counts)
        s.seen = (set(prompt) | set(counts)) if params.repetition_penalty != 1 else set()
        tok = s.draw_bounded(lo, up, lambda ids: logits[ids], max_rows)
        fallbacks += tok is None or s.head_reads > reads
        if tok is None:
            tok = s.choose(np.arange(len(logits)), logits)
        drawn[int(tok)] += 1
    return drawn, fallbacks, s.rescored


@pytest.mark.parametrize("name", list(SETTINGS))
def test_bounded_draws_follow_the_exact_distribution(name: str) -> None:
    params, counts = SETTINGS[name]
    logits = big_logits()
    want = target(logits, params, counts)
    n = 12000
    drawn, fallbacks, rows = bounded_draws(logits, params, n, counts)
    assert not drawn[want == 0].any(), "a token the truncation excludes was drawn"
    assert chi_square_p(drawn, want) > 1e-3  # seeded: the same draws every run
    # what it costs: nearly every draw from the bounds and a few rows, far fewer than the whole head's
    assert fallbacks <= n // 20 and rows < n * BIG_V / 10


@pytest.mark.parametrize("name", ["t1.0", "t0.7-top_p0.9", "t0.7-penalties", "t0.8-top_k40"])
def test_the_flat_tail_block_keeps_the_draw_exact(name: str, monkeypatch) -> None:
    """The envelope's tail block (tokens far below the best, held at one flat weight) drawn often: with TAIL_LOG at
    1.5 temperatures, most of the vocabulary is in it, proposals land there and widen the universe."""
    from edgeflow.engines import sampling

    monkeypatch.setattr(sampling, "TAIL_LOG", 1.5)
    params, counts = SETTINGS[name]
    logits = big_logits(3)
    drawn, _, _ = bounded_draws(logits, params, 6000, counts)
    want = target(logits, params, counts)
    assert not drawn[want == 0].any()
    assert chi_square_p(drawn, want) > 1e-3


@pytest.mark.parametrize("name", ["t1.0", "t0.7-top_p0.9"])
def test_loose_bounds_on_the_favourites_keep_the_draw_exact_and_cheap(name: str) -> None:
    """The favourites' upper bounds far above their logits: most proposals land on them again after their rescore, so
    the envelope's redraws (and its rebuilt running sum, after REDRAWS in a row) carry the draw. Exact, and still a
    handful of rows per draw."""
    params, counts = SETTINGS[name]
    logits = big_logits(4)
    lo, up = logits - 0.05, logits + 0.05
    top = np.argsort(-logits)[:3]
    up[top] += 4.0 * params.temperature  # e^4 times their weight in the envelope
    s = Sampler(params)
    n = 8000
    drawn, fallbacks = np.zeros(BIG_V, np.int64), 0
    for _ in range(n):
        s.output_counts = Counter()
        tok = s.draw_bounded(lo, up, lambda ids: logits[ids], 1000)
        fallbacks += tok is None
        drawn[int(tok if tok is not None else s.choose(np.arange(BIG_V), logits))] += 1
    want = target(logits, params, counts)
    assert not drawn[want == 0].any()
    assert chi_square_p(drawn, want) > 1e-3
    assert fallbacks == 0 and s.rescored < n * (BIG_V / 10 if params.top_p < 1 else 8)


def test_the_distribution_check_tells_a_near_miss_apart() -> None:
    """The test above can fail: draws from temperature 0.75 judged against 0.7 are rejected."""
    logits = big_logits()
    drawn, _, _ = bounded_draws(logits, SamplingParams(temperature=0.75, top_p=0.9, seed=1), 12000)
    assert chi_square_p(drawn, target(logits, SamplingParams(temperature=0.7, top_p=0.9), Counter())) < 1e-6


@pytest.mark.parametrize("name", list(TOP_K_SETTINGS))
def test_bounded_top_k_draws_the_token_the_whole_head_draws(name: str) -> None:
    """top_k rescores its candidates in descending upper bound and stops once the k-th logit found lies above every
    row left. Token for token from the same seed, that is the draw `choose` makes over the whole head, on 300 steps of
    tied logits."""
    params, counts = TOP_K_SETTINGS[name]
    bounded, whole = Sampler(params), Sampler(params)
    for step in range(300):
        logits, lo, up = tied_logits_and_bounds(step)
        for s in (bounded, whole):
            s.output_counts = Counter(counts)
            s.seen = set(counts) if params.repetition_penalty != 1 else set()
        tok = bounded.draw_bounded(lo, up, lambda ids: logits[ids], 10**6)
        assert tok is not None and int(tok) == int(whole.choose(np.arange(BIG_V), logits)), f"step {step}"


def test_bounded_top_k_stops_rescoring_once_the_top_k_is_known() -> None:
    """Bounds up to 2.1 logits wide on each side (the demo student's int8 head): of the rows whose upper bound reaches
    the 40th lower bound, about half need rescoring (the rows above the 40th logit, in descending upper bound)."""
    from edgeflow.engines.sampling import _top_k_rows, numpy_universe

    params = SamplingParams(temperature=0.8, top_k=40, seed=1)
    s, candidates = Sampler(params), 0
    for step in range(50):
        rng = np.random.default_rng(step)
        logits = rng.normal(0, 2.5, BIG_V)
        lo, up = logits - rng.uniform(0, 2.1, BIG_V), logits + rng.uniform(0, 2.1, BIG_V)
        candidates += len(_top_k_rows(lo, up, params.top_k, numpy_universe(up, params.temperature, False)))
        s.output_counts = Counter()
        assert s.draw_bounded(lo, up, lambda ids: logits[ids], 10**6) is not None
    assert s.rescored < 0.7 * candidates


def test_bounded_greedy_is_the_first_maximum_of_the_penalised_logits() -> None:
    logits = np.round(big_logits(1), 1)  # ties among the top logits
    counts = Counter({int(np.argmax(logits)): 1})
    for params in (SamplingParams(), SamplingParams(presence_penalty=0.3), SamplingParams(repetition_penalty=1.5)):
        s = Sampler(params)
        s.output_counts.update(counts)
        s.seen |= set(counts) if params.repetition_penalty != 1 else set()
        adj = s.penalise(np.arange(BIG_V), logits)
        tok = s.draw_bounded(logits - 0.2, logits + 0.2, lambda ids: logits[ids], 1000)
        assert int(tok) == int(np.argmax(adj))


def test_bounded_draw_gives_the_step_to_the_full_head_when_rows_run_out_or_a_bound_is_wrong() -> None:
    logits = big_logits(2)
    # top_k 200 needs at least 200 rows: with 100 allowed, the caller reads the whole head
    assert Sampler(SamplingParams(temperature=1.0, top_k=200)).draw_bounded(logits - 0.1, logits + 0.1, lambda i: logits[i], 100) is None
    # a bound the exact logit breaks: refused, never drawn from
    lo, up = logits - 0.1, logits + 0.1
    up[np.argmax(logits)] -= 0.5
    s = Sampler(SamplingParams(temperature=0.05, seed=0))  # nearly every proposal is the broken row
    assert s.draw_bounded(lo, up, lambda i: logits[i], 1000) is None
    # loose bounds: proposals keep being rejected, and after REJECTION_TRIES the step goes to the full head
    from edgeflow.engines.sampling import REJECTION_TRIES

    s = Sampler(SamplingParams(temperature=0.1, seed=0))
    assert s.draw_bounded(logits - 0.1, logits + 30.0, lambda i: logits[i], 10**6) is None
    assert s.rescored <= REJECTION_TRIES


def test_set_fields_and_plain_greedy() -> None:
    assert SamplingParams().plain_greedy and SamplingParams().set_fields() == []
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    assert not p.plain_greedy and p.set_fields() == ["logprobs", "top_logprobs"]
