"""generate_many: prompts in flight together through a real engine give what each gives alone, in prompt order."""
from __future__ import annotations

import numpy as np

from edgeflow.engines import generate_many, get_backend
from edgeflow.engines.sampling import SamplingParams


def test_prompts_in_flight_together_give_each_prompts_own_tokens_and_a_refused_prompt_its_error(tiny_llama, tmp_path):
    backend = get_backend("cpu_native")
    engine = tmp_path / "engine"
    backend.build(tiny_llama, engine, {})
    session = backend.load(engine)
    rng = np.random.default_rng(11)
    good = [rng.integers(3, 500, size=int(n)).tolist() for n in (5, 17, 2, 9, 30, 4, 12)]
    refused = [10**7]  # outside the vocabulary: the engine refuses it with a ValueError
    prompts = good[:3] + [refused] + good[3:]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    for sampling in (None, sampled):
        alone = [list(backend.generate(session, p, 6, [], sampling)) for p in good]
        together = generate_many(backend, session, prompts, 6, [], sampling)
        assert isinstance(together[3], ValueError) and "out of range" in str(together[3])
        assert together[:3] + together[4:] == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts' answers differ, so an order mix-up would show
    assert generate_many(backend, session, [], 6, []) == []
