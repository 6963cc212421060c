"""llama_cpp on every family edgeflow/model/architecture.py describes (tiny random models and tokenizers from tests/helpers/families.py).

Each family is written as the GGUF architecture llama.cpp's own converter uses (llama with rope_freqs for Llama 3.x,
qwen2, qwen3, gemma2, gemma3) and run by llama-cpp-python. Per family: the fp32 engine's logits against transformers'
within LOGIT_BOUND (absolute, every position and vocabulary entry; 1.2e-3 to 3.2e-3 measured on the AMD EPYC AVX-512
box, where llama.cpp multiplies f32 weights by f32 activations in its own summation order; without the query-scale
fold Gemma's differ by 0.16 to 0.46) and the same greedy tokens, on prompts longer than the sliding window; and an int4
g64 RTN engine whose top-1 agrees with the fake-quantized model on at least 90 % of positions (llama.cpp quantizes
activations to q8 blocks for int4 weights, so exact greedy equality is not its contract; test_llama_cpp.py holds the
same bar on the real model). Mistral runs as llama.cpp's llama graph without a window and is refused with one.
About 60 s on 2 CPU cores.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")
pytest.importorskip("llmcompressor")

from edgeflow.engines import llama_cpp  # noqa: E402
from edgeflow.engines.checkpoint import load_dequantized  # noqa: E402
from tests.helpers.families import (  # noqa: E402
    FAMILY_MODELS, WINDOW, build_tiny, family_prompts, fp32_worst_logit_diff, rtn_int4,
)

NEW_TOKENS = 10
LOGIT_BOUND = 1e-2
# Mistral runs only without a window here (llama.cpp's llama graph has none): its Mistral-7B-v0.2+ configs say null.
RUNS = {mt: {"sliding_window": None} if mt == "mistral" else {} for mt in FAMILY_MODELS}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3"}


@pytest.fixture(scope="session", autouse=True)
def _export_teacher() -> None:
    """These tests need no teacher: override the engines-wide autouse fixture of tests/conftest.py."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lc-families")
    return {mt: build_tiny(mt, root / mt, **RUNS[mt]) for mt in FAMILY_MODELS}


def _gguf_field(engine: Path, key: str):
    from gguf import GGUFReader

    field = GGUFReader(str(engine / llama_cpp.GGUF_FILE)).get_field(key)
    return None if field is None else field.contents()


@pytest.mark.parametrize("model_type", list(FAMILY_MODELS))
def test_fp32_logits_and_greedy_tokens_match_transformers(model_type: str, models, tmp_path: Path, record_property) -> None:
    engine = tmp_path / "engine"
    llama_cpp.build(models[model_type], engine, {})
    assert _gguf_field(engine, "general.architecture") == GGUF_ARCH[model_type]
    session = llama_cpp.load(engine)
    model = load_dequantized(models[model_type])
    worst = fp32_worst_logit_diff(llama_cpp, session, model, NEW_TOKENS)
    record_property("max_abs_logit_diff", worst)
    assert worst < LOGIT_BOUND, f"{model_type}: max |llama.cpp - transformers| = {worst}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_int4_engine_agrees_with_its_fake_quantized_model(model_type: str, models, tmp_path: Path) -> None:
    ckpt = rtn_int4(models[model_type], tmp_path / "int4")
    engine = tmp_path / "engine"
    meta = llama_cpp.build(ckpt, engine, {})
    assert meta["precision"] == "q4_1"
    session = llama_cpp.load(engine)
    model = load_dequantized(ckpt)
    agree = total = 0
    for ids in family_prompts():
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        got = llama_cpp.score(session, ids)
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9, f"{model_type}: top-1 agreement {agree}/{total}"


def test_gemma_layers_keep_their_own_window_rope_and_norms(models, tmp_path: Path) -> None:
    """What the gemma3 GGUF says: each layer's sliding flag, both RoPE bases, the linear factor, and (1 + w) norms."""
    from gguf import GGUFReader

    engine = tmp_path / "engine"
    llama_cpp.build(models["gemma3_text"], engine, {})
    assert _gguf_field(engine, "gemma3.attention.sliding_window_pattern") == [True, False, True]
    assert _gguf_field(engine, "gemma3.attention.sliding_window") == WINDOW
    assert _gguf_field(engine, "gemma3.rope.freq_base_swa") == 10000.0
    assert _gguf_field(engine, "gemma3.rope.freq_base") == 1000000.0
    assert _gguf_field(engine, "gemma3.rope.scaling.factor") == 4.0
    tensors = {t.name: np.asarray(t.data) for t in GGUFReader(str(engine / llama_cpp.GGUF_FILE)).tensors}
    hf = load_dequantized(models["gemma3_text"]).state_dict()
    np.testing.assert_array_equal(tensors["blk.1.ffn_norm.weight"],
                                  hf["model.layers.1.pre_feedforward_layernorm.weight"].numpy() + np.float32(1))


@pytest.mark.parametrize("model_type, overrides, field", [
    ("mistral", {"sliding_window": WINDOW}, "sliding_window=8"),
    ("qwen2", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}, "rope_type 'llama3'"),
    ("llama", {"mlp_bias": True}, "MLP bias"),
])
def test_what_the_gguf_graphs_cannot_compute_is_refused_before_any_work(model_type, overrides, field, tmp_path):
    dense = build_tiny(model_type, tmp_path / "model", **overrides)
    with pytest.raises(ValueError, match="cpu_native") as err:
        llama_cpp.build(dense, tmp_path / "engine", {})
    assert field in str(err.value)
    assert not (tmp_path / "engine" / llama_cpp.GGUF_FILE).exists()
