"""Sampling statistics the sampler's tests and the native engine's share: the distribution a request draws from, written
out from its definition; a chi-square test against it; the settings and logits they sweep."""
from __future__ import annotations

from collections import Counter

import numpy as np

from edgeflow.engines.sampling import SamplingParams


BIG_V = 3000


def penalised(logits: np.ndarray, params: SamplingParams, counts: Counter, prompt: tuple[int, ...] = ()) -> np.ndarray:
    """The penalties from their published definitions, written out here, not taken from the code under test:
    - repetition (Keskar et al. 2019, CTRL, section 4.1; Hugging Face's RepetitionPenaltyLogitsProcessor): every token
      of the prompt or the output so far, logit / penalty where the logit is positive, logit * penalty otherwise;
    - frequency and presence (OpenAI's API reference, "Frequency and presence penalties"):
      mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c[j] the times j was generated so far.
    Repetition first, then the other two (vLLM's order, and the server's)."""
    z = logits.astype(np.float64).copy()
    if params.repetition_penalty != 1:
        for j in set(prompt) | set(counts):
            z[j] = z[j] / params.repetition_penalty if z[j] > 0 else z[j] * params.repetition_penalty
    for j, c in counts.items():
        z[j] = z[j] - c * params.frequency_penalty - float(c > 0) * params.presence_penalty
    return z


def target(logits: np.ndarray, params: SamplingParams, counts: Counter, prompt: tuple[int, ...] = ()) -> np.ndarray:
    """The distribution a request draws from, written out from the definition (penalties by `penalised`, from their
    published definitions): softmax(penalised / T), truncated to the top_k, then to the smallest head, in descending
    logit and ascending id order, whose mass reaches top_p."""
    ids = np.arange(len(logits))
    z = penalised(logits, params, counts, prompt) / params.temperature
    order = np.lexsort((ids, -z))
    w = np.exp(z[order] - z.max())
    if 0 < params.top_k < len(ids):
        order, w = order[: params.top_k], w[: params.top_k]
    before = np.concatenate([[0.0], np.cumsum(w)[:-1]]) / w.sum()
    keep = before < params.top_p
    out = np.zeros(len(logits))
    out[order[keep]] = w[keep] / w[keep].sum()
    return out


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of observed counts against probabilities: tokens expected >= 5 times each, the rest as one bin
    (a token drawn that the distribution excludes fails the caller's own check first)."""
    from scipy.stats import chisquare

    n = counts.sum()
    big = probs * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    if exp[-1] < 5:  # fold a thin tail into the smallest kept bin
        obs, exp = np.append(obs[:-2], obs[-2] + obs[-1]), np.append(exp[:-2], exp[-2] + exp[-1])
    return float(chisquare(obs, exp).pvalue)


def big_logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.5, BIG_V)


# The 20 most likely tokens of the logits the draws are tested on (big_logits(0): the Python draw's, big_logits(5):
# q4.c's), counted 1 to 4 times in the penalties setting: the tokens that carry the mass carry different counts, so a
# frequency penalty that forgot `* count` draws visibly differently.
_FAVOURITES = {int(i) for seed in (0, 5) for i in np.argsort(-big_logits(seed))[:20]}

SETTINGS = {
    "t0.7-top_p0.9": (SamplingParams(temperature=0.7, top_p=0.9, seed=1), Counter()),
    "t1.0": (SamplingParams(temperature=1.0, seed=2), Counter()),
    "t0.7-penalties": (SamplingParams(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3,
                                      seed=3), Counter({int(i): 1 + int(i) % 4 for i in sorted(set(range(0, BIG_V, 7)) | _FAVOURITES)})),
    "t1.3-top_p0.5": (SamplingParams(temperature=1.3, top_p=0.5, seed=4), Counter()),
    "t0.9-top_k40-top_p0.8": (SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=5), Counter()),
    "t0.8-top_k40": (SamplingParams(temperature=0.8, top_k=40, seed=6), Counter()),
    "t1.5-top_k3-penalties": (SamplingParams(temperature=1.5, top_k=3, presence_penalty=1.0, seed=7),
                              Counter({int(i): 1 for i in range(0, BIG_V, 3)})),
}


TOP_K_SETTINGS = {
    "t0.8-top_k40": (SamplingParams(temperature=0.8, top_k=40, seed=6), Counter()),
    "t0.9-top_k40-top_p0.8": (SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=5), Counter()),
    "t1.5-top_k3-penalties": (SamplingParams(temperature=1.5, top_k=3, presence_penalty=0.5, repetition_penalty=1.5,
                                             seed=7), Counter({int(i): 1 for i in range(0, BIG_V, 3)})),
}


def tied_logits_and_bounds(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits on a 0.5 grid (many ties at the k-th place) with bounds exact on half the rows and up to 2.0 wide on
    the others: a row left unrescored can have its upper bound equal to the k-th logit found and a lower id."""
    rng = np.random.default_rng(1000 + step)
    logits = np.round(rng.normal(0, 2.5, BIG_V) * 2) / 2
    loose = rng.random(BIG_V) < 0.5
    return logits, logits - loose * rng.uniform(0, 2.0, BIG_V), logits + loose * rng.uniform(0, 2.0, BIG_V)
