"""Sampling shared by every engine backend: one definition of the OpenAI parameters and the math.

    p = SamplingParams(temperature=0.7, top_p=0.9, seed=1); s = Sampler(p, prompt_ids=[1, 2])
    token = s.choose(np.arange(vocab), logits)      # a Token (an int) with .logprob and .top_logprobs

A backend hands `choose` the exact fp32 logits of every token and gets back the token to emit. A backend
that can bound every logit cheaply (cpu_native's int8 head) calls `draw_bounded` instead: the same
distribution, exactly, from the bounds and the exact logits of the few rows it asks for (rejection
sampling; see its docstring), or None when that would need more rows than reading the whole head.
cpu_native runs the same algorithm in C (q4.c's sample_bounded, one call a step, taking the penalties from
`penalty_table` and its uniforms from `uniforms`; its tests hold it to the same distributions), and keeps
`draw_bounded` for Gemma 2's softcapped logits.
Backends with their own sampler on the device (TensorRT-LLM) only use `SamplingParams` and state what
they support in `sampling_support()`.

Order of operations (vLLM's): repetition_penalty (prompt and output tokens; a positive logit is
divided by it, a negative one multiplied), then frequency_penalty x count and presence_penalty on
output tokens (OpenAI's definition), then temperature, top_k, top_p, and a draw from the seeded
generator. temperature == 0 is greedy over the penalised logits.

`logprob` and `top_logprobs` are the model's own distribution (log-softmax of the raw logits at
temperature 1, before penalties and truncation), vLLM's default `raw_logprobs`, so they compare
directly with the FP model's.
"""
from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# How many proposals draw_bounded makes before it gives the step to the full head. Each proposal is accepted with
# probability exp((logit - upper bound) / temperature) times the nucleus's share: with cpu_native's bounds at
# temperature 0.7 most steps accept within the first few; 64 leaves a full pass to steps where the bound is loose or
# top_p keeps a small share of a flat distribution.
REJECTION_TRIES = 64
# Draws of already-rescored tokens in a row after which a proposal rebuilds the envelope's running sum (_Envelope.propose).
REDRAWS = 8
# Rows rescored per round while a nucleus membership is undecided (grown 4x per round, up to the caller's cap).
NUCLEUS_ROWS = 256

# The parameters a request may set. A backend's sampling_support() returns the subset it honours;
# the server answers 400 naming the parameter and the engine for any other that a request sets.
PARAMETERS = (
    "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logprobs", "top_logprobs",
)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the decoder; the defaults are greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps every token
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("temperature", self.temperature, 0.0 <= self.temperature <= 2.0, "0 <= temperature <= 2"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "0 < top_p <= 1"),
            ("top_k", self.top_k, self.top_k >= -1, "top_k >= -1 (0 or -1: off)"),
            ("frequency_penalty", self.frequency_penalty, -2.0 <= self.frequency_penalty <= 2.0, "-2 <= frequency_penalty <= 2"),
            ("presence_penalty", self.presence_penalty, -2.0 <= self.presence_penalty <= 2.0, "-2 <= presence_penalty <= 2"),
            ("repetition_penalty", self.repetition_penalty, 0.0 < self.repetition_penalty <= 10.0, "0 < repetition_penalty <= 10"),
            ("top_logprobs", self.top_logprobs, 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"0 <= top_logprobs <= {MAX_TOP_LOGPROBS}"),
        ]
        for name, value, ok, rule in checks:
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{name}={value!r} is out of range; it must satisfy {rule}")

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else asked: a backend's exact-argmax path gives the same tokens."""
        return self.temperature == 0 and not self.penalised and not self.logprobs

    def set_fields(self) -> list[str]:
        """Parameters that differ from greedy decoding's defaults (what a backend must support)."""
        default = SamplingParams()
        return [p for p in PARAMETERS if getattr(self, p) != getattr(default, p)]


GREEDY = SamplingParams()


class Token(int):
    """A generated token id (an int) with its log-probability and the most likely alternatives."""

    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]

    def __new__(cls, token: int, logprob: float | None = None, top_logprobs: Iterable[tuple[int, float]] = ()) -> Token:
        obj = super().__new__(cls, int(token))
        obj.logprob = logprob
        obj.top_logprobs = tuple(top_logprobs)
        return obj


@dataclass
class Sampler:
    """Per-request decoding state: the seeded generator and the token counts the penalties use."""

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    seed: int = field(init=False)
    output_counts: Counter = field(init=False)
    seen: set[int] = field(init=False)
    rescored: int = field(init=False, default=0)  # rows draw_bounded asked `exact` for, over the request
    head_reads: int = field(init=False, default=0)  # nucleus decisions that needed every row (draw_bounded)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        # PCG64 from the seed alone: the same seed and request give the same tokens on any host.
        self._rng = np.random.Generator(np.random.PCG64(self.seed & ((1 << 64) - 1)))
        self.output_counts = Counter()
        self.seen = {int(t) for t in self.prompt_ids} if self.params.repetition_penalty != 1 else set()

    # ---------------------------------------------------------------------------- penalties
    def penalise(self, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The penalised logits of `ids`. Monotone in each logit, so it maps bounds to bounds too."""
        p = self.params
        if not p.penalised:
            return logits
        out = np.array(logits, dtype=np.float64, copy=True)
        if p.repetition_penalty != 1 and self.seen:
            # sorted + searchsorted: np.isin cost ~0.15 ms a call
            seen = np.sort(np.fromiter(self.seen, np.int64, len(self.seen)))
            hit = seen[np.minimum(np.searchsorted(seen, ids), len(seen) - 1)] == ids
            v = out[hit]
            out[hit] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.output_counts:
            keys = np.fromiter(self.output_counts.keys(), dtype=np.int64)
            counts = np.fromiter(self.output_counts.values(), dtype=np.float64)
            order = np.argsort(keys)
            sk, sc = keys[order], counts[order]
            pos = np.minimum(np.searchsorted(sk, ids), len(sk) - 1)
            hit = sk[pos] == ids
            out[hit] -= p.frequency_penalty * sc[pos[hit]] + p.presence_penalty
        return out

    # ---------------------------------------------------------------------------- the draw
    def choose(self, ids: np.ndarray, logits: np.ndarray) -> Token:
        """Pick the next token among `ids` (exact raw logits `logits`): the whole vocabulary, or a set that holds
        every token the request's truncation can keep."""
        ids = np.asarray(ids, dtype=np.int64)
        raw = np.asarray(logits, dtype=np.float64)
        adj = self.penalise(ids, raw)
        p = self.params
        if p.temperature == 0:
            i = int(np.argmax(adj))  # the first maximum: the lowest id among ties
        else:
            i = self._draw(ids, adj / p.temperature)
        token = int(ids[i])
        self._count(token)
        if not p.logprobs:
            return Token(token)
        lse = _logsumexp(raw)
        top = ()
        if p.top_logprobs:
            k = min(p.top_logprobs, len(ids))
            best = np.argpartition(-raw, k - 1)[:k]
            best = best[np.lexsort((ids[best], -raw[best]))]
            top = tuple((int(ids[b]), float(raw[b] - lse)) for b in best)
        return Token(token, float(raw[i] - lse), top)

    def penalised_bounds(self, lower: np.ndarray, upper: np.ndarray,
                         in_place: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Bounds on every token's penalised logit from bounds on its raw one (penalties are monotone); written over
        `lower` and `upper` themselves when `in_place` (float64 arrays the caller gives up), else into copies."""
        lo, up = np.asarray(lower, np.float64), np.asarray(upper, np.float64)
        if not self.params.penalised:
            return lo, up
        touched = np.asarray(sorted(self.seen | set(self.output_counts)), dtype=np.int64)
        if not len(touched):
            return lo, up
        if not (in_place and lo is lower and up is upper):
            lo, up = lo.copy(), up.copy()
        lo[touched] = self.penalise(touched, lo[touched])
        up[touched] = self.penalise(touched, up[touched])
        return lo, up

    def draw_bounded(self, lower: np.ndarray, upper: np.ndarray, exact: Callable[[np.ndarray], np.ndarray],
                     max_rows: int, universe: UniverseFn | None = None, scratch: bool = False) -> Token | None:
        """The next token, distributed exactly as `choose` over the whole vocabulary would draw it, from bounds
        lower[i] <= logit[i] <= upper[i] on every raw logit and `exact(ids)`, the exact raw logits of the rows asked
        for. None when the draw is better made from the whole head (top_k or greedy would rescore more than `max_rows`
        rows, or REJECTION_TRIES proposals were all rejected): the caller then reads it and calls `choose`. Either way
        the token has the same distribution: whether None comes back does not depend on which token a proposal was.
        Not for logprobs, whose normaliser needs every logit. `universe` computes the tokens a step works on and their
        envelope weights (`numpy_universe` by default; cpu_native passes q4.c's, the same set with weights that only
        bound these from above, which the acceptance ratio makes exact). `scratch`: `lower` and `upper` are the caller's
        to lose (penalties are applied to them in place instead of to copies).

        * temperature 0: the rows whose upper bound reaches the best lower bound are rescored; the first maximum wins.
        * top_k: the rows whose upper bound reaches the k-th largest lower bound hold the top k. They are rescored in
          descending order of upper bound (k rows, then k/2 at a time) until the k-th largest z = logit / T found
          lies above the next row's upper bound / T, so no row left can reach the top k. `choose` draws among them
          (top_p then applies inside the top k, as over the whole vocabulary): the token the whole head gives for
          the same uniform.
        * otherwise, rejection sampling (`_Envelope`): propose token i with probability proportional to
          exp(upper_i / T), rescore that one row, accept with probability exp((logit_i - upper_i) / T) <= 1. An
          accepted proposal has probability proportional to exp(logit_i / T): the softmax, exactly. A rescored row's
          exact logit is kept for the rest of the step, so proposing it again costs no row, and proposals come from
          the envelope with each rescored row at its exact weight (adaptive rejection: `_Envelope.propose`); each
          round is a valid rejection step whatever came before it, so the draw stays exact. With top_p < 1 an accepted token is kept if it lies in the
          nucleus (the tokens before it, in descending logit and ascending id order, hold less than top_p of the
          mass) and drawn again otherwise, which conditions the softmax on the nucleus. Membership is decided
          from the bounds, rescoring the rows that keep it open (`_Envelope.in_nucleus`).
        """
        p = self.params
        lo, up = self.penalised_bounds(lower, upper, in_place=scratch)
        v = len(lo)
        universe = universe or numpy_universe
        if p.temperature == 0 or (0 < p.top_k < v):
            ids = (np.flatnonzero(up >= float(lo.max())) if p.temperature == 0
                   else _top_k_rows(lo, up, p.top_k, universe(up, p.temperature, False)))
            if len(ids) > max_rows:
                return None
            if p.temperature != 0:  # rescored in descending upper bound, only as far as the top k needs
                ids = ids[np.argsort(-up[ids], kind="stable")]
            done, raw, pen = 0, np.empty(len(ids)), np.empty(len(ids))
            while done < len(ids):
                step = len(ids) if p.temperature == 0 else p.top_k if not done else max(p.top_k // 2, 8)
                part, at = ids[done:done + step], slice(done, done + step)
                raw[at] = exact(part)
                pen[at] = self.penalise(part, raw[at])
                self.rescored += len(part)
                if not np.all((pen[at] >= lo[part]) & (pen[at] <= up[part])):
                    return None  # a bound that does not hold would make the draw wrong: refuse the shortcut instead
                done += len(part)
                if p.temperature != 0 and p.top_k <= done < len(ids) and (
                        np.partition(pen[:done], done - p.top_k)[done - p.top_k] / p.temperature
                        > up[ids[done]] / p.temperature):
                    break  # the k-th largest z = logit / T found lies above every row left's: none can reach the top k
            return self.choose(ids[:done], raw[:done])
        env = _Envelope(self, lo, up, exact, max_rows, universe(up, p.temperature, True))
        for _ in range(REJECTION_TRIES):
            k, weight = env.propose(self._rng)
            q = env.exact_logit(k)
            if q is None:
                return None
            if self._rng.random() * weight >= math.exp(q / env.t - env.zmax):
                continue  # rejected: the bound overstated this row
            token = int(env.ids[k])  # before the nucleus test, which may widen the universe (and renumber it)
            if p.top_p < 1.0:
                inside = env.in_nucleus(k, p.top_p)
                if inside is None:
                    return None
                if not inside:
                    continue
            self._count(token)
            return Token(token)
        return None

    def _draw(self, ids: np.ndarray, z: np.ndarray) -> int:
        """Index into `ids` of a draw from softmax(z) truncated by top_k and top_p. Candidates are taken in
        (descending z, ascending id) order wherever truncation needs an order, in ascending id order
        otherwise, so the draw never depends on the order a backend lists them in. Only the head of the
        distribution that truncation can keep is sorted (a vocabulary-wide sort costs ~6 ms per token)."""
        p = self.params
        zmax = float(z.max())
        w = np.exp(z - zmax)
        if 0 < p.top_k <= len(ids):  # len(ids) == top_k: draw_bounded's rows, ordered as the whole head's top k
            keep = _first(p.top_k, ids, z)
        elif p.top_p < 1.0:
            keep = None
        else:  # no truncation: ids are ascending in every backend, no sort needed
            order = np.argsort(ids, kind="stable") if len(ids) > 1 and np.any(ids[1:] < ids[:-1]) else None
            return self._pick(order if order is not None else np.arange(len(ids)), w)
        if p.top_p < 1.0:
            total = float(w.sum()) if keep is None else float(w[keep].sum())
            pool = np.arange(len(ids)) if keep is None else keep
            m = min(len(pool), 256)
            while True:  # the smallest head of the sorted distribution whose mass reaches top_p
                head = pool if m >= len(pool) else pool[_first(m, ids[pool], z[pool])]
                head = head[np.lexsort((ids[head], -z[head]))]
                cum = np.cumsum(w[head]) / total
                if m >= len(pool) or cum[-1] >= p.top_p:
                    break
                m *= 4
            cut = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            return self._pick(head[:cut], w)
        keep = keep[np.lexsort((ids[keep], -z[keep]))]
        return self._pick(keep, w)

    def _pick(self, order: np.ndarray, w: np.ndarray) -> int:
        """One draw among `order` (indices) with weights w[order]: the seeded generator's next uniform."""
        cum = np.cumsum(w[order])
        j = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return int(order[min(j, len(order) - 1)])

    def penalty_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What `penalise` does to each token it touches, for a draw made outside this class: their ids (ascending),
        1 where the repetition penalty applies, and what is then subtracted (frequency x count + presence)."""
        p = self.params
        seen = self.seen if p.repetition_penalty != 1 else set()
        counted = self.output_counts if (p.frequency_penalty or p.presence_penalty) else {}
        ids = sorted(seen | set(counted))
        rep = np.array([i in seen for i in ids], np.int32)
        sub = np.array([p.frequency_penalty * float(counted[i]) + p.presence_penalty if i in counted else 0.0 for i in ids],
                       np.float64)
        return np.array(ids, np.int64), rep, sub

    def uniforms(self, n: int) -> np.ndarray:
        """The request's next n uniforms in [0, 1) from its seeded generator (for a draw made outside this class)."""
        return self._rng.random(n)

    def emit(self, token: int) -> Token:
        """A token drawn outside this class (by the same rule), counted for the penalties as `choose` counts its own."""
        self._count(int(token))
        return Token(int(token))

    def _count(self, token: int) -> None:
        self.output_counts[token] += 1
        if self.params.repetition_penalty != 1:
            self.seen.add(token)


def _first(k: int, ids: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Indices of the k first candidates in (descending z, ascending id) order, in no order: a partition, with the
    ties at the k-th place broken by id (np.argpartition breaks them by position, which differs between backends)."""
    kth = z[np.argpartition(-z, k - 1)[k - 1]]
    above = np.flatnonzero(z > kth)
    tied = np.flatnonzero(z == kth)
    if len(above) + len(tied) > k:
        tied = tied[np.argsort(ids[tied], kind="stable")[: k - len(above)]]
    return np.concatenate([above, tied])


# Tokens whose upper bound lies this many temperatures below the best one's weigh less than e^-TAIL_LOG each: the
# envelope holds them as one flat block of that weight (a valid bound on each), so a step works only on the tokens
# that can matter. 20: the block's total over a 262k vocabulary is below 5e-4 of the favourite's weight, so a
# proposal lands there (and widens the step to every row) about once in 2,000 steps at most; on the demo student
# the universe at temperature 0.7 is 250-21,000 of 49,152 tokens against 45,000-49,152 at 40 (docs/benchmarks/history/2026-12-05.md, "Exact sampling without the fp32 head").
TAIL_LOG = 20.0


class Universe(NamedTuple):
    """The tokens a sampled step works on: those whose upper bound is at least `cut` = (zmax - TAIL_LOG) * T, with
    zmax = max(upper) / T, ascending (`ids`); with weights asked for, each one's envelope weight, at least
    exp(upper / T - zmax), and their running sum `cum`."""

    ids: np.ndarray
    weight: np.ndarray | None
    cum: np.ndarray | None
    zmax: float
    cut: float


UniverseFn = Callable[[np.ndarray, float, bool], Universe]


def numpy_universe(up: np.ndarray, t: float, weights: bool) -> Universe:
    """The universe of upper bounds `up` at temperature t (numpy; the weights exactly exp(up / t - zmax))."""
    zmax = float(up.max()) / t
    cut = (zmax - TAIL_LOG) * t
    ids = np.flatnonzero(up >= cut)
    if not weights:
        return Universe(ids, None, None, zmax, cut)
    weight = np.exp(up[ids] / t - zmax)
    return Universe(ids, weight, np.cumsum(weight), zmax, cut)


def _top_k_rows(lo: np.ndarray, up: np.ndarray, k: int, near_tokens: Universe) -> np.ndarray:
    """The rows that can be among the k largest logits: upper bound >= the k-th largest lower bound. The threshold is
    taken among the universe's tokens, those within TAIL_LOG temperatures of the best upper bound (a lower one: a
    superset, still holding the top k); a vocabulary-wide partition costs ~0.8 ms a step on the demo's 49,152 tokens."""
    v = len(lo)
    cut, near = near_tokens.cut, near_tokens.ids
    if len(near) >= k:
        threshold = float(np.partition(lo[near], len(near) - k)[len(near) - k])
        if threshold >= cut:  # every token outside `near` has its upper bound below it
            return near[up[near] >= threshold]
    return np.flatnonzero(up >= float(np.partition(lo, v - k)[v - k]))


class _Envelope:
    """draw_bounded's proposal and what it has learnt in one step: the universe of tokens whose upper bound is within
    TAIL_LOG temperatures of the best (`ids`, ascending; k below is an index into it), each one's proposal weight
    `prop` (at least exp(bound / T - zmax)) summed in `cum`, and the exact penalised logits of the rows rescored so far
    (`pen`, NaN elsewhere). The rest of the vocabulary is the tail block: `tail` tokens of weight e^-TAIL_LOG each,
    taken into the universe (every row) only if a proposal lands there."""

    def __init__(self, sampler: Sampler, lo: np.ndarray, up: np.ndarray, exact: Callable[[np.ndarray], np.ndarray],
                 max_rows: int, start: Universe):
        self.s, self.exact, self.budget = sampler, exact, int(max_rows)
        self.t = sampler.params.temperature
        self.lo_all, self.up_all = lo, up
        self.zmax, self.cut = start.zmax, start.cut
        self._universe(start.ids, {}, start.weight, start.cum)

    def _universe(self, ids: np.ndarray, known: dict[int, float], prop: np.ndarray | None = None,
                  cum: np.ndarray | None = None) -> None:
        self.ids = ids
        self.tail = len(self.lo_all) - len(ids)
        self._lo = self._up = None  # the universe's bounds, gathered when a nucleus test needs them
        self.pen = np.full(len(ids), np.nan)
        if prop is None:  # a widened universe: the rescored tokens propose with their exact weights
            prop = np.exp(self.up_all[ids] / self.t - self.zmax)
        for i, q in known.items():
            k = int(np.searchsorted(ids, i))
            self.pen[k] = q
            prop[k] = math.exp(q / self.t - self.zmax)
        self.prop, self.cum = prop, (np.cumsum(prop) if cum is None or known else cum)

    @property
    def lo(self) -> np.ndarray:
        if self._lo is None:
            self._lo = self.lo_all[self.ids]
        return self._lo

    @property
    def up(self) -> np.ndarray:
        if self._up is None:
            self._up = self.up_all[self.ids]
        return self._up

    def _widen(self) -> None:
        """Take every token into the universe (a proposal fell in the tail, or a decision needs the tail's order)."""
        known = {int(self.ids[k]): float(self.pen[k]) for k in np.flatnonzero(~np.isnan(self.pen))}
        self._universe(np.arange(len(self.lo_all)), known)

    def _tighten(self) -> None:
        """Proposal weights of the rescored rows down to their exact ones, and the running sum again."""
        ks = np.flatnonzero(~np.isnan(self.pen))
        self.prop[ks] = np.exp(self.pen[ks] / self.t - self.zmax)
        self.cum = np.cumsum(self.prop)

    def propose(self, rng: np.random.Generator) -> tuple[int, float]:
        """(k, weight) of a proposal from the envelope in which every rescored row weighs exactly its softmax weight
        (adaptive rejection sampling: a rejected token does not draw the next proposals to itself again). That
        envelope is drawn from without rewriting the running sum per rescore (~30 us over a 40,000-token universe):
        a draw from `cum` that lands on a rescored row stands with probability exact / proposal weight, and is drawn
        again otherwise (the mass its rescore removed); after REDRAWS of those in a row the sum is rebuilt. A rescored
        row comes back with its exact weight, so the caller's acceptance ratio is 1 for it. A proposal in the tail
        block has the block's weight e^-TAIL_LOG (its own bound is below it) and widens the universe."""
        tail_w = math.exp(-TAIL_LOG)
        for attempt in range(REDRAWS + 1):
            if attempt == REDRAWS:
                self._tighten()
            r = rng.random() * (float(self.cum[-1]) + self.tail * tail_w)
            if r >= self.cum[-1] and self.tail:
                tail_ids = np.flatnonzero(self.up_all < self.cut)
                i = int(tail_ids[min(int((r - self.cum[-1]) / tail_w), len(tail_ids) - 1)])
                self._widen()
                return int(np.searchsorted(self.ids, i)), tail_w
            k = min(int(np.searchsorted(self.cum, r, side="right")), len(self.ids) - 1)
            q, w = self.pen[k], float(self.prop[k])
            if q != q:  # NaN: not rescored yet
                return k, w
            exact = math.exp(q / self.t - self.zmax)
            if rng.random() * w < exact:
                return k, exact
        raise AssertionError("unreachable: after _tighten a rescored row's draw always stands")

    def exact_logit(self, k: int) -> float | None:
        """Row k's exact penalised logit (rescored now unless known; the row budget does not refuse a proposal's row);
        None when its bound does not hold. One row is most of a step's rescoring: no array arithmetic here."""
        q = float(self.pen[k])
        if q == q:
            return q
        ids = self.ids[k:k + 1]
        q = float(self.s.penalise(ids, np.asarray(self.exact(ids), np.float64))[0])
        self.budget -= 1
        self.s.rescored += 1
        self.pen[k] = q
        i = int(ids[0])
        return q if self.lo_all[i] <= q <= self.up_all[i] else None

    def rescore(self, ks: np.ndarray, force: bool = False) -> bool:
        """Exact logits for the universe rows `ks` not known yet (within the row budget unless forced). False when the
        budget refuses, or when a bound does not hold (the draw would be wrong: the caller gives up)."""
        ks = np.asarray(ks, np.int64)
        ks = ks[np.isnan(self.pen[ks])]
        if not len(ks):
            return True
        if len(ks) > self.budget and not force:
            return False
        ids = self.ids[ks]
        pen = self.s.penalise(ids, np.asarray(self.exact(ids), np.float64))
        self.pen[ks] = pen
        self.budget -= len(ks)
        self.s.rescored += len(ks)
        return bool(np.all((pen >= self.lo_all[ids]) & (pen <= self.up_all[ids])))

    def in_nucleus(self, j: int, q: float) -> bool | None:
        """Is universe row j (rescored) among the tokens top_p = q keeps? With A the mass of the tokens before it and B
        the rest (j included), it is kept iff A < q (A + B), i.e. A (1 - q) < q B. Rows not rescored contribute their
        bounds (the tail block its total, on either side unless j's logit is above every tail bound); an undecided
        test rescores the rows that weigh most in it and asks again; when the row budget is spent, every row is read
        (the whole head), which decides it. None only when a bound proves wrong."""
        rows = NUCLEUS_ROWS
        tail_w = math.exp(-TAIL_LOG)
        lj, t, i = float(self.pen[j]), self.t, int(self.ids[j])
        tail_before = 0.0 if lj >= self.cut else self.tail * tail_w  # every tail logit is below cut
        # First, in two passes over the universe: A at most the tokens that can come before j (a rescored one before it,
        # or one whose upper bound reaches its logit), at their upper weights; B at least the rescored tokens from j on.
        # Decides most draws (a likely token, few others near it) before the full test's bounds on every token.
        known = np.flatnonzero(~np.isnan(self.pen))
        pen = self.pen[known]
        first = (pen > lj) | ((pen == lj) & (self.ids[known] < i))
        w = np.exp(pen / t - self.zmax)
        reach = np.flatnonzero(self.up >= lj)
        open_reach = reach[np.isnan(self.pen[reach])]
        a_hi = float(w[first].sum()) + float(self.prop[open_reach].sum()) + tail_before
        if a_hi * (1 - q) < q * float(w[~first].sum()):
            return True
        universe = None
        while True:
            if universe is not self.ids:  # per universe: what does not change while rows are rescored
                universe = idx = self.ids
                lo_before, up_after = self.lo > lj, self.up < lj
                w_lo_all = np.exp(np.where(lo_before | up_after, self.lo, -np.inf) / t - self.zmax)
            # the rescored rows: exact weights, before j (a higher logit, or the same and a lower id) or after it
            unknown = np.isnan(self.pen)
            kk = np.flatnonzero(~unknown)
            pen = self.pen[kk]
            w = np.exp(pen / t - self.zmax)
            first = (pen > lj) | ((pen == lj) & (idx[kk] < i))
            # the others by their bounds: surely before j, surely after it, or either
            sure_before, sure_after = unknown & lo_before, unknown & up_after
            either = unknown ^ sure_before ^ sure_after
            tail = self.tail * tail_w
            a_exact, b_exact = float(w[first].sum()), float(w[~first].sum())
            open_up = float(np.sum(self.prop, where=either))
            a_lo = a_exact + float(np.sum(w_lo_all, where=sure_before))
            a_hi = a_exact + float(np.sum(self.prop, where=sure_before)) + open_up + tail_before
            b_lo = b_exact + float(np.sum(w_lo_all, where=sure_after))
            b_hi = b_exact + float(np.sum(self.prop, where=sure_after)) + open_up + tail
            if a_hi * (1 - q) < q * b_lo:
                return True
            if a_lo * (1 - q) >= q * b_hi:
                return False
            gap = np.where(unknown, self.prop - w_lo_all, 0.0)
            take = min(rows, int(np.count_nonzero(gap)), self.budget)
            if take == 0:
                # The rows allowed are spent (or only the tail is left): read every row, which decides it. Giving up
                # here instead would skew the draw against the tokens whose membership is hard to decide.
                self.s.head_reads += 1
                if self.tail:
                    self._widen()
                if not self.rescore(np.flatnonzero(np.isnan(self.pen)), force=True):
                    return None
                continue
            if not self.rescore(np.argpartition(-gap, take - 1)[:take]):
                return None
            rows *= 4


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.exp(x - m).sum()))
