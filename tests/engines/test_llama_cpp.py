"""The llama.cpp backend (edgeflow/engines/llama_cpp/) on a 3-layer student of the real teacher.

Checkpoints are made with llm-compressor (RTN, no calibration data): int4 asymmetric and symmetric g64, int8
symmetric per channel, the mixed W8-attention/W4-MLP recipe and an int8 asymmetric one no block holds. The
conversion is checked against the checkpoint's own integers with the gguf package's dequantizers (llama.cpp's
block formulas); the engines run through llama-cpp-python.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llama_cpp")
pytest.importorskip("llmcompressor")

from edgeflow.engines import EngineIncompatibleError, get_backend  # noqa: E402
from edgeflow.engines import llama_cpp  # noqa: E402
from edgeflow.engines.checkpoint import InexactWeights, layer, load_dequantized, load_tensors, split_tensors  # noqa: E402
from edgeflow.engines.sampling import SamplingParams  # noqa: E402
from edgeflow.distill.student import keep_layers  # noqa: E402

KEEP_LAYERS = (0, 15, 29)
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")
EOS = 2
W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}
W8 = {"num_bits": 8, "type": "int", "strategy": "channel"}
RECIPES = {
    "asym4": {"group_0": {"targets": ["Linear"], "weights": W4 | {"symmetric": False}}},
    "sym4": {"group_0": {"targets": ["Linear"], "weights": W4 | {"symmetric": True}}},
    "sym8": {"group_0": {"targets": ["Linear"], "weights": W8 | {"symmetric": True}}},
    "mixed": {"attn": {"targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "weights": W8 | {"symmetric": True}},
              "mlp": {"targets": [r"re:.*mlp\.(gate|up|down)_proj$"], "weights": W4 | {"symmetric": True}}},
    "asym8": {"group_0": {"targets": ["Linear"], "weights": W8 | {"symmetric": False}}},
}


@pytest.fixture(scope="session")
def lc_teacher() -> Path:
    value = os.environ.get("EDGEFLOW_TEST_TEACHER")
    if not value or not (Path(value) / "config.json").exists():
        pytest.skip("$EDGEFLOW_TEST_TEACHER does not name the converted teacher")
    return Path(value)


@pytest.fixture(scope="session")
def lc_checkpoints(lc_teacher: Path, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("llama_cpp_ckpt")
    model = keep_layers(AutoModelForCausalLM.from_pretrained(lc_teacher, dtype=torch.float32), KEEP_LAYERS)
    dense = root / "dense"
    model.save_pretrained(dense)
    AutoTokenizer.from_pretrained(lc_teacher).save_pretrained(dense)

    class _Lazy(dict):
        def __missing__(self, name: str) -> Path:
            from llmcompressor import oneshot
            from llmcompressor.modifiers.quantization import QuantizationModifier

            m = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
            recipe = QuantizationModifier(config_groups=RECIPES[name], ignore=["lm_head"])
            out = root / name
            oneshot(model=m, recipe=recipe, output_dir=str(out), save_compressed=True)
            AutoTokenizer.from_pretrained(dense).save_pretrained(out)
            self[name] = out
            return out

    found = _Lazy()
    found["dense"] = dense
    return found


@pytest.fixture(scope="session")
def lc_engines(lc_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama_cpp_engines")

    class _Lazy(dict):
        def __missing__(self, name: str) -> Path:
            out = root / name
            llama_cpp.build(lc_checkpoints[name], out, {})
            self[name] = out
            return out

    return _Lazy()


@pytest.fixture(scope="session")
def lc_sessions(lc_engines) -> dict:
    class _Lazy(dict):
        def __missing__(self, name: str):
            self[name] = llama_cpp.load(lc_engines[name])
            return self[name]

    return _Lazy()


def _prompt_ids(ckpt: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in PROMPTS]


def _gguf_weights(engine: Path) -> dict[str, np.ndarray]:
    """Every tensor of the engine's GGUF, dequantized by the gguf package (llama.cpp's block formulas), [rows, cols]."""
    from gguf import GGUFReader, quants

    out = {}
    for t in GGUFReader(str(engine / llama_cpp.GGUF_FILE)).tensors:
        out[t.name] = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return out


def _expected(ckpt: Path) -> dict[str, tuple[np.ndarray, str]]:
    """{gguf name: (the checkpoint's dequantized weight in llama.cpp's row order, expected block type)}."""
    config = json.loads((ckpt / "config.json").read_text())
    schemes = llama_cpp.detect_schemes(ckpt)
    tensors = load_tensors(ckpt)
    out = {}
    for prefix in split_tensors(tensors, ckpt)[1]:
        s = llama_cpp.layer_scheme(tensors, prefix, schemes)
        q = layer(tensors, prefix, s)
        w = (q.q.astype(np.float32) - np.repeat(q.zero, q.group_size, axis=1)) * np.repeat(q.scale, q.group_size, axis=1)
        if (n := llama_cpp._rope_heads(prefix, config)) is not None:
            w = llama_cpp.permute_rope_rows(w, n)
        kind = "Q8_0" if s.bits == 8 else ("Q4_0" if s.symmetric else "Q4_1")
        out[llama_cpp._gguf_name(prefix + ".weight")] = (w, kind)
    return out


@pytest.mark.parametrize("name", ["asym4", "sym4", "sym8", "mixed"])
def test_blocks_hold_the_checkpoints_integers_up_to_the_recorded_fp16_rounding(name, lc_checkpoints, lc_engines):
    from gguf import GGUFReader

    meta = json.loads((lc_engines[name] / "engine.json").read_text())
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(lc_engines[name] / llama_cpp.GGUF_FILE)).tensors}
    got = _gguf_weights(lc_engines[name])
    expected = _expected(lc_checkpoints[name])
    assert len(expected) == 3 * 7
    for gname, (w, kind) in expected.items():
        assert types[gname] == kind, gname
        bound = meta["rounding"][kind]["weight_abs"]
        err = float(np.abs(got[gname] - w).max())
        assert err <= bound * (1 + 1e-6) + 1e-12, (gname, err, bound)
    for r in meta["rounding"].values():  # fp16 keeps 11 significant bits: half an ulp, relative to the block's scale
        assert r["scale_rel"] <= 2**-11 and r["m_rel"] <= 16 * 2**-11, r
    kinds = {k for _, k in expected.values()}
    assert meta["precision"] == "+".join(sorted(k.lower() for k in kinds))
    assert meta["quantization"] and meta["dequantized"] is None
    assert types["token_embd.weight"] == "F32" and "output.weight" not in types  # tied head: the exact f32 table


def test_fp16_representable_scales_convert_bit_exactly(lc_checkpoints, tmp_path):
    """Q4_0 and Q8_0 round nothing but the scales: with fp16-valued scales the blocks give the very weights."""
    import shutil

    from safetensors.numpy import load_file, save_file

    for name in ("sym4", "sym8"):
        ckpt = tmp_path / name
        shutil.copytree(lc_checkpoints[name], ckpt)
        [f] = ckpt.glob("*.safetensors")
        t = load_file(str(f))
        t = {k: (v.astype(np.float16).astype(v.dtype) if k.endswith("weight_scale") else v) for k, v in t.items()}
        save_file(t, str(f), metadata={"format": "pt"})
        meta = llama_cpp.build(ckpt, tmp_path / f"{name}-engine", {})
        got = _gguf_weights(tmp_path / f"{name}-engine")
        for gname, (w, _) in _expected(ckpt).items():
            assert np.array_equal(got[gname], w), gname
        assert all(r["weight_abs"] == 0.0 and r["scale_rel"] == 0.0 for r in meta["rounding"].values())


def test_gguf_metadata_describes_the_model(lc_checkpoints, lc_engines):
    from gguf import GGUFReader

    config = json.loads((lc_checkpoints["asym4"] / "config.json").read_text())
    r = GGUFReader(str(lc_engines["asym4"] / llama_cpp.GGUF_FILE))
    field = lambda k: r.get_field(k).contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == 3 and field("llama.embedding_length") == config["hidden_size"]
    assert field("llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert field("llama.rope.freq_base") == pytest.approx(config["rope_parameters"]["rope_theta"])
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"] and tokens[EOS] == "<|im_end|>"
    assert field("tokenizer.ggml.eos_token_id") == EOS and field("tokenizer.ggml.merges")


def _hf_logits(model_dir: Path, ids: list[int], dequantized: bool = False) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = load_dequantized(model_dir) if dequantized else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_score_of_the_dense_engine_is_the_fp_model(lc_checkpoints, lc_sessions):
    """f32 weights: llama.cpp's logits are the Hugging Face model's up to float summation order."""
    session = lc_sessions["dense"]
    for ids in _prompt_ids(lc_checkpoints["dense"]):
        got, want = llama_cpp.score(session, ids), _hf_logits(lc_checkpoints["dense"], ids)
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("name", ["asym4", "sym4"])
def test_quantized_engine_agrees_with_its_fake_quantized_model(name, lc_checkpoints, lc_sessions):
    """int4 blocks with llama.cpp's q8 activations: top-1 against the exactly dequantized model (engine parity)."""
    agree = total = 0
    for ids in _prompt_ids(lc_checkpoints[name]):
        got, want = llama_cpp.score(lc_sessions[name], ids), _hf_logits(lc_checkpoints[name], ids, dequantized=True)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9, agree / total


def test_generate_greedy_sampling_stops_and_concurrency(lc_checkpoints, lc_sessions):
    session = lc_sessions["asym4"]
    ids = _prompt_ids(lc_checkpoints["asym4"])[0]
    greedy = list(llama_cpp.generate(session, ids, 12, [EOS]))
    assert greedy and greedy == list(llama_cpp.generate(session, ids, 12, [EOS]))
    assert greedy[0] == int(llama_cpp.score(session, ids)[-1].argmax())
    # a stop id ends the stream before it is yielded
    assert list(llama_cpp.generate(session, ids, 12, [greedy[3]])) == greedy[:3]
    # seeded sampling is reproducible, logprobs ride on the tokens
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=7, logprobs=True, top_logprobs=2)
    a = list(llama_cpp.generate(session, ids, 10, [EOS], params))
    assert a == list(llama_cpp.generate(session, ids, 10, [EOS], params))
    assert all(t.logprob is not None and len(t.top_logprobs) == 2 for t in a)
    assert llama_cpp.sampling_support() == frozenset(llama_cpp.PARAMETERS)
    # two streams at once use two contexts and give the sequential answers
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, list(llama_cpp.generate(session, ids, 12, [EOS]))))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {0: greedy, 1: greedy}
    with pytest.raises(ValueError, match="exceed the engine's context length"):
        list(llama_cpp.generate(session, ids, session.context_length, [EOS]))


def test_a_scheme_no_block_holds_builds_dense_or_is_refused(lc_checkpoints, tmp_path):
    with pytest.raises(InexactWeights, match=r"num_bits=8 symmetric=False"):
        llama_cpp.build(lc_checkpoints["asym8"], tmp_path / "refused", {"inexact_weights": "error"})
    assert not (tmp_path / "refused" / "engine.json").exists()
    meta = llama_cpp.build(lc_checkpoints["asym8"], tmp_path / "dense", {})
    assert meta["precision"] == "fp32" and "symmetric=False" in meta["dequantized"]["reason"]
    got = _gguf_weights(tmp_path / "dense")
    want = load_dequantized(lc_checkpoints["asym8"]).state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(got["blk.0.ffn_down.weight"], want)


def test_the_context_is_capped_at_the_trained_length(lc_checkpoints, tmp_path):
    llama_cpp.build(lc_checkpoints["sym4"], tmp_path / "long", {"n_ctx": 16384, "contexts": 1})
    trained = json.loads((lc_checkpoints["sym4"] / "config.json").read_text())["max_position_embeddings"]
    session = llama_cpp.load(tmp_path / "long")
    assert trained < 16384 and session.context_length == trained
    session.close()


def test_check_compatible_names_both_sides(lc_engines, tmp_path):
    import shutil

    eng = tmp_path / "eng"
    shutil.copytree(lc_engines["sym4"], eng)
    meta = json.loads((eng / "engine.json").read_text())
    (eng / "engine.json").write_text(json.dumps(meta | {"writer": "edgeflow gguf writer 0"}))
    with pytest.raises(EngineIncompatibleError, match="written by 'edgeflow gguf writer 0', this device reads"):
        llama_cpp.check_compatible(eng)
    (eng / "engine.json").write_text(json.dumps(meta | {"backend": "cpu"}))
    with pytest.raises(EngineIncompatibleError, match="engine backend is 'cpu'"):
        llama_cpp.check_compatible(eng)
    with pytest.raises(ValueError, match=r"unknown llama_cpp engine profile keys \['threads'\]"):
        llama_cpp.build(Path("unused"), tmp_path / "x", {"threads": 2})
    assert get_backend("llama_cpp") is llama_cpp


def test_the_gate_runs_on_llama_cpp_engines(lc_checkpoints, lc_engines):
    """The consistency stage's own functions: the FP reference (with the fake-quantized pass), then run_gate."""
    from edgeflow.profile import GateConfig
    from edgeflow.evaluation.gate import run_gate
    from edgeflow.evaluation.reference import compute_reference

    seqs = _prompt_ids(lc_checkpoints["dense"])
    ref = compute_reference(lc_checkpoints["dense"], {"asym4": lc_checkpoints["asym4"]}, seqs, seqs[:2], 6, 8, seqs[0], [EOS])
    variants = [{"name": "fp32", "engine_dir": str(lc_engines["dense"]), "size_mb": 1.0, "quantized": False},
                {"name": "asym4", "engine_dir": str(lc_engines["asym4"]), "size_mb": 1.0, "quantized": True}]
    rows, _ = run_gate(ref, variants, GateConfig(min_top1_agreement=0.5, min_engine_parity=0.9, greedy_tokens=6), "llama_cpp")
    by = {r["name"]: r for r in rows}
    assert by["fp32"]["top1_agreement"] >= 0.95 and by["fp32"]["greedy_exact"] == 1.0
    assert by["asym4"]["metrics"]["engine_parity"] >= 0.9 and by["asym4"]["decode_tok_s"] > 0
