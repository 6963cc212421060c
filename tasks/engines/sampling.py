"""Sampling shared by every engine backend: one definition of the OpenAI parameters and the math.

    p = SamplingParams(temperature=0.7, top_p=0.9, seed=1); s = Sampler(p, prompt_ids=[1, 2])
    token = s.choose(np.arange(vocab), logits)      # a Token (an int) with .logprob and .top_logprobs

A backend hands `choose` the exact fp32 logits of the tokens that matter (all of them, or, in
cpu_native, every token whose probability can exceed EPSILON, found with the int8 head's bounds),
and gets back the token to emit. Backends with their own sampler on the device (TensorRT-LLM) only
use `SamplingParams` and state what they support in `sampling_support()`.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Probability below which a token may be left out of the candidates a backend rescores exactly
# (cpu_native). Each left-out token has p < EPSILON; the total left out is bounded per step and kept
# in `Sampler.max_excluded_mass`. 1e-6 keeps the candidate set to a few hundred rows of a 49k
# vocabulary at temperature 0.7 on the demo student, a fraction of one full fp32 head pass.
EPSILON = 1e-6

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
    max_excluded_mass: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        # PCG64 from the seed alone: the same seed and request give the same tokens on any host.
        self._rng = np.random.Generator(np.random.PCG64(self.seed & ((1 << 64) - 1)))
        self.output_counts = Counter()
        self.seen = {int(t) for t in self.prompt_ids} if self.params.repetition_penalty != 1 else set()

    # ---------------------------------------------------------------------------- the logit window
    def margin(self) -> float:
        """How far (in raw logits) below the best token a token must be to have p < EPSILON in every
        distribution this request reads: the sampled one (at its temperature) and, for logprobs, the raw one."""
        t = self.params.temperature
        scale = max(t, 1.0) if self.params.logprobs else t
        return scale * math.log(1.0 / EPSILON)

    def penalise(self, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The penalised logits of `ids`. Monotone in each logit, so it maps bounds to bounds too."""
        p = self.params
        if not p.penalised:
            return logits
        out = np.array(logits, dtype=np.float64, copy=True)
        if p.repetition_penalty != 1 and self.seen:
            hit = np.isin(ids, np.fromiter(self.seen, dtype=np.int64))
            v = out[hit]
            out[hit] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self.output_counts:
            keys = np.fromiter(self.output_counts.keys(), dtype=np.int64)
            counts = np.fromiter(self.output_counts.values(), dtype=np.float64)
            order = np.argsort(keys)
            sk, sc = keys[order], counts[order]
            pos = np.clip(np.searchsorted(sk, ids), 0, len(sk) - 1)
            hit = sk[pos] == ids
            out[hit] -= p.frequency_penalty * sc[pos[hit]] + p.presence_penalty
        return out

    # ---------------------------------------------------------------------------- the draw
    def choose(self, ids: np.ndarray, logits: np.ndarray, excluded_mass: float = 0.0) -> Token:
        """Pick the next token among `ids` (exact raw logits `logits`); `excluded_mass` bounds the
        probability of every token not in `ids` (0 when `ids` is the whole vocabulary)."""
        ids = np.asarray(ids, dtype=np.int64)
        raw = np.asarray(logits, dtype=np.float64)
        adj = self.penalise(ids, raw)
        p = self.params
        if p.temperature == 0:
            i = int(np.argmax(adj))  # the first maximum: the lowest id among ties
        else:
            i = self._draw(ids, adj / p.temperature)
        token = int(ids[i])
        self.max_excluded_mass = max(self.max_excluded_mass, float(excluded_mass))
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

    def _draw(self, ids: np.ndarray, z: np.ndarray) -> int:
        """Index into `ids` of a draw from softmax(z) truncated by top_k and top_p. Candidates are taken in
        (descending z, ascending id) order wherever truncation needs an order, in ascending id order
        otherwise, so the draw never depends on the order a backend lists them in. Only the head of the
        distribution that truncation can keep is sorted (a vocabulary-wide sort costs ~6 ms per token)."""
        p = self.params
        zmax = float(z.max())
        w = np.exp(z - zmax)
        if p.top_k > 0 and p.top_k < len(ids):
            keep = np.argpartition(-z, p.top_k - 1)[: p.top_k]
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
                head = pool if m >= len(pool) else pool[np.argpartition(-z[pool], m - 1)[:m]]
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

    def _count(self, token: int) -> None:
        self.output_counts[token] += 1
        if self.params.repetition_penalty != 1:
            self.seen.add(token)


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.exp(x - m).sum()))


def excluded_mass_bound(upper: np.ndarray, best: float, kept_logits: np.ndarray, temperature: float) -> float:
    """Upper bound on the total probability of tokens left out of the candidates: each left-out token's
    logit is at most `upper` (its bound), and the normaliser is at least the kept tokens' own sum."""
    if len(upper) == 0:
        return 0.0
    t = temperature if temperature > 0 else 1.0
    out = float(np.exp((np.asarray(upper, np.float64) - best) / t).sum())
    kept = float(np.exp((np.asarray(kept_logits, np.float64) - best) / t).sum())
    return out / (kept + out)
