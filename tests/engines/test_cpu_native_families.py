"""cpu_native on every family edgeflow/model/architecture.py describes (tiny random models from tests/helpers/families.py).

Per family: the fp32 engine's logits against transformers' within LOGIT_BOUND (absolute, every position and
vocabulary entry; 3e-6 to 6e-6 measured on the AMD EPYC, AVX-512 BF16 box) and the same greedy tokens, and an int4
g64 RTN engine whose greedy tokens equal the fake-quantized HF model's, on prompts longer than the sliding window.
Gemma 2's reference runs eager attention (edgeflow.model.architecture.transformers_kwargs): transformers' default sdpa path
drops its attention softcap. About 20 s on 2 CPU cores.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llmcompressor")

from edgeflow.engines import cpu_native  # noqa: E402
from tests.helpers.require import require_cpu_native  # noqa: E402
from tests.helpers.families import (  # noqa: E402
    FAMILY_MODELS, build_tiny, family_prompts, fp32_worst_logit_diff, hf_greedy, rtn_int4,
)

require_cpu_native(module=True)

NEW_TOKENS = 12
LOGIT_BOUND = 1e-4  # max |engine - HF| over every position and vocabulary entry, fp32 weights


@pytest.fixture(scope="session", autouse=True)
def _export_teacher() -> None:
    """These tests need no teacher: override the engines-wide autouse fixture of tests/conftest.py."""


@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(tmp_path_factory) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv(cpu_native.CACHE_ENV, str(tmp_path_factory.mktemp("native-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {mt: build_tiny(mt, root / mt) for mt in FAMILY_MODELS}


@pytest.mark.parametrize("model_type", list(FAMILY_MODELS))
def test_fp32_logits_and_greedy_tokens_match_transformers(model_type: str, models, tmp_path: Path, record_property) -> None:
    from edgeflow.engines.checkpoint import load_dequantized

    cpu_native.build(models[model_type], tmp_path / "engine", {})
    session = cpu_native.load(tmp_path / "engine")
    assert session.meta["architecture"]["model_type"] == model_type
    model = load_dequantized(models[model_type])
    worst = fp32_worst_logit_diff(cpu_native, session, model, NEW_TOKENS)
    record_property("max_abs_logit_diff", worst)
    assert worst < LOGIT_BOUND, (model_type, worst)


@pytest.mark.parametrize("model_type", list(FAMILY_MODELS))
def test_int4_greedy_equals_the_fake_quantized_model(model_type: str, models, tmp_path: Path) -> None:
    from edgeflow.engines.checkpoint import load_dequantized

    ckpt = rtn_int4(models[model_type], tmp_path / "int4")
    meta = cpu_native.build(ckpt, tmp_path / "engine", {})
    assert meta["weights"] == "int4-g64"
    session = cpu_native.load(tmp_path / "engine")
    model = load_dequantized(ckpt)
    for ids in family_prompts():
        assert list(cpu_native.generate(session, ids, NEW_TOKENS, [])) == hf_greedy(model, ids, NEW_TOKENS), model_type


def test_gemma2_softcapped_sampling_draws_from_the_capped_distribution(models, tmp_path: Path) -> None:
    """Gemma 2's final softcap bounds every logit by the cap: the engine's sampled logprobs are those of the capped
    logits (the model's), which the raw head's logits would exceed."""
    from edgeflow.engines.sampling import SamplingParams

    cpu_native.build(models["gemma2"], tmp_path / "engine", {})
    session = cpu_native.load(tmp_path / "engine")
    ids = family_prompts()[1]
    logits = cpu_native.score(session, ids)
    assert float(np.abs(logits).max()) <= 5.0
    [tok] = list(cpu_native.generate(session, ids, 1, [], SamplingParams(temperature=1.0, seed=3, logprobs=True)))
    ref = logits[-1].astype(np.float64)
    ref = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
    assert abs(tok.logprob - ref[int(tok)]) < 1e-4
