"""Real-model tests of the CPU engine backend (edgeflow/engines/cpu_onnx.py).

They build a 3-layer student of the teacher named by $EDGEFLOW_TEST_TEACHER (a SmolLM2-style
LlamaForCausalLM directory), RTN int4 g64 checkpoints of it with llm-compressor (asymmetric and
symmetric), and onnxruntime-genai engines from those; about 1.5 min on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("llmcompressor")

from edgeflow.tracking.artifacts import sha256_tree  # noqa: E402
from edgeflow.engines import EngineIncompatibleError, get_backend  # noqa: E402
from edgeflow.engines import cpu_onnx  # noqa: E402
from edgeflow.engines.checkpoint import WeightScheme, write_gptq_int4  # noqa: E402
from edgeflow.distill.student import keep_layers  # noqa: E402

TEACHER_ENV = "EDGEFLOW_TEST_TEACHER"
KEEP_LAYERS = (0, 15, 29)  # a layer-dropped student, like the pipeline's (same widths, 3 layers)
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
)
NEW_TOKENS = 32
EOS = 2  # <|im_end|>, also pad


# ---------------------------------------------------------------------------------------------
# fixtures: teacher -> 3-layer student -> RTN int4 checkpoints -> engines (built once per session)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cpu_teacher() -> Path:
    value = os.environ.get(TEACHER_ENV)
    if not value:
        pytest.skip(f"${TEACHER_ENV} is not set: it must name a local HF LlamaForCausalLM teacher directory")
    path = Path(value)
    if not (path / "config.json").exists():
        pytest.skip(f"${TEACHER_ENV}={value} has no config.json (teacher checkpoint missing)")
    return path


def _rtn_int4(dense: Path, out: Path, symmetric: bool) -> Path:
    """RTN W4A16 group-64 with llm-compressor (no calibration data), saved pack-quantized."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 64}
    recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, output_dir=str(out), save_compressed=True)
    AutoTokenizer.from_pretrained(dense).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def checkpoints(cpu_teacher: Path, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("cpu_onnx_ckpt")
    model = keep_layers(AutoModelForCausalLM.from_pretrained(cpu_teacher, dtype=torch.float32), KEEP_LAYERS)
    dense = root / "dense"
    model.save_pretrained(dense)
    AutoTokenizer.from_pretrained(cpu_teacher).save_pretrained(dense)
    return {
        "dense": dense,
        "asym": _rtn_int4(dense, root / "asym", symmetric=False),
        "sym": _rtn_int4(dense, root / "sym", symmetric=True),
    }


@pytest.fixture(scope="session")
def engines(checkpoints: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """Engines built on demand (default profile), cached for the session."""
    root = tmp_path_factory.mktemp("cpu_onnx_engines")

    class _Lazy(dict):
        def __missing__(self, name: str) -> Path:
            out = root / name
            cpu_onnx.build(checkpoints[name], out, {})
            self[name] = out
            return out

    return _Lazy()


@pytest.fixture(scope="session")
def sessions(engines) -> dict:
    class _Lazy(dict):
        def __missing__(self, name: str):
            self[name] = cpu_onnx.load(engines[name])
            return self[name]

    return _Lazy()


def _hf_model(path: Path):
    """The reference: dense HF model, or the fake-quantized (dequantized) HF model of a compressed one."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs = {}
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _chat_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        out.append([int(i) for i in ids])
    return out


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
        )
    new = out[0, len(ids):].tolist()
    return new[:-1] if new and new[-1] == EOS else new


# ---------------------------------------------------------------------------------------------
# 1. repack exactness
# ---------------------------------------------------------------------------------------------


def _unpack_int4_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 words packing 8 nibbles along dim 1 (nibble i of a word at bits 4i) -> uint8 [n, rows]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    out = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift is fine: we mask 4 bits
    return out.reshape(packed.shape[0], -1)[:, :rows].to(torch.uint8)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Reference dequantization of a GPTQ-format layer (AutoGPTQ v1: zeros stored minus one) -> float32 [out, in]."""
    q = _unpack_int4_rows(qweight.T.contiguous(), qweight.shape[0] * 8).to(torch.float32)  # [out, in]
    z = ((_unpack_int4_rows(qzeros, qzeros.shape[1] * 8).to(torch.int16) + 1) & 0xF).to(torch.float32)  # [groups, out]
    s = scales.to(torch.float32)  # [groups, out]
    return (q - z.T.repeat_interleave(group_size, dim=1)) * s.T.repeat_interleave(group_size, dim=1)


@pytest.mark.parametrize("variant", ["asym", "sym"])
def test_repack_is_bit_exact(variant: str, checkpoints, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    ckpt = checkpoints[variant]
    scheme = cpu_onnx.detect_scheme(ckpt)
    assert scheme == WeightScheme(bits=4, strategy="group", group_size=64, symmetric=variant == "sym", format="pack-quantized")
    write_gptq_int4(ckpt, tmp_path, scheme)
    gptq = load_file(str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": variant == "sym",
                   "desc_act": False, "checkpoint_format": "gptq"}

    reference = _hf_model(ckpt).state_dict()  # compressed-tensors' own dequantization, via transformers
    prefixes = sorted(k[: -len(".qweight")] for k in gptq if k.endswith(".qweight"))
    assert len(prefixes) == 7 * len(KEEP_LAYERS)
    for p in prefixes:
        n_in = gptq[f"{p}.qweight"].shape[0] * 8
        assert torch.equal(gptq[f"{p}.g_idx"], torch.arange(n_in, dtype=torch.int32) // 64)
        w = dequantize_gptq(gptq[f"{p}.qweight"], gptq[f"{p}.qzeros"], gptq[f"{p}.scales"], 64)
        ref = reference[f"{p}.weight"].to(torch.float32)
        assert w.shape == ref.shape, p
        assert torch.equal(w, ref), f"{p}: max |diff| {(w - ref).abs().max().item():.3g}"
    if variant == "sym":  # symmetric zero point 8 is stored GPTQ-style as 8 - 1 = 7 in every nibble
        qz = gptq[f"{prefixes[0]}.qzeros"]
        assert torch.equal(qz, torch.full_like(qz, 0x77777777))
    # Non-linear tensors are carried over unchanged.
    assert torch.equal(gptq["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------
# 2. engine parity vs the fake-quantized HF model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["asym", "sym"])
def test_int4_engine_matches_fake_quant_hf(variant: str, checkpoints, sessions, record_property) -> None:
    ckpt = checkpoints[variant]
    model = _hf_model(ckpt)
    session = sessions[variant]
    agree = total = 0
    top1 = []
    for ids in _chat_ids(ckpt):
        ref = _hf_greedy(model, ids, NEW_TOKENS)
        got = list(cpu_onnx.generate(session, ids, NEW_TOKENS, [EOS]))
        agree += sum(a == b for a, b in zip(ref, got))
        total += max(len(ref), len(got))
        seq = ids + ref
        logits = cpu_onnx.score(session, seq)
        assert logits.shape == (len(seq), model.config.vocab_size) and logits.dtype == np.float32
        with torch.no_grad():
            hf = model(torch.tensor([seq])).logits[0].numpy()
        top1.append(float((logits.argmax(-1) == hf.argmax(-1)).mean()))
    agreement, score_top1 = agree / total, float(np.mean(top1))
    record_property("token_agreement", agreement)
    record_property("score_top1", score_top1)
    print(f"{variant}: greedy token agreement {agreement:.4f}, score top-1 {score_top1:.4f}")
    assert agreement >= 0.98, f"greedy token agreement {agreement:.4f} < 0.98"
    assert score_top1 >= 0.98, f"score() top-1 agreement {score_top1:.4f} < 0.98"


# ---------------------------------------------------------------------------------------------
# 3. dense fp32 engine = HF logits
# ---------------------------------------------------------------------------------------------


def test_dense_fp32_engine_logits_match_hf(checkpoints, engines, sessions) -> None:
    ckpt = checkpoints["dense"]
    meta = json.loads((engines["dense"] / "engine.json").read_text())
    assert meta["precision"] == "fp32" and meta["quantization"] is None
    model = _hf_model(ckpt)
    ids = _chat_ids(ckpt)[0]
    logits = cpu_onnx.score(sessions["dense"], ids)
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, hf, atol=1e-3, rtol=0)
    # generate() continues exactly like HF greedy
    assert list(cpu_onnx.generate(sessions["dense"], ids, 8, [EOS])) == _hf_greedy(model, ids, 8)


def test_generate_stops_before_stop_token_and_at_max_new_tokens(checkpoints, sessions) -> None:
    session = sessions["asym"]
    ids = _chat_ids(checkpoints["asym"])[1]
    free = list(cpu_onnx.generate(session, ids, 12, []))
    assert len(free) == 12
    cut = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    assert list(cpu_onnx.generate(session, ids, 12, [free[cut]])) == free[:cut]
    assert list(cpu_onnx.generate(session, ids, 0, [])) == []


def _last_logits_of_served_model(session, ids: list[int]) -> np.ndarray:
    """Last-position logits from the served (lm_head-pruned) decoder, via og's get_logits()."""
    gen = cpu_onnx._generator(session, len(ids) + 1)
    gen.append_tokens(np.asarray([ids], dtype=np.int32))
    return np.asarray(gen.get_logits()).reshape(-1)


def test_score_graph_agrees_with_served_graph(checkpoints, sessions) -> None:
    """score.onnx (prune removed) and model.onnx (pruned) give the same last-position logits."""
    session = sessions["asym"]
    assert session.meta["score_model"] == "score.onnx"
    ids = _chat_ids(checkpoints["asym"])[0]
    np.testing.assert_allclose(cpu_onnx.score(session, ids)[-1], _last_logits_of_served_model(session, ids),
                               atol=1e-4, rtol=0)


def test_fast_profile_builds_int8_head_at_level_4(checkpoints, tmp_path: Path) -> None:
    """accuracy_level 4 + int8 lm_head: builds, records the lm_head edit, and serves/scores consistently."""
    import onnx

    out = tmp_path / "fast"
    meta = cpu_onnx.build(checkpoints["sym"], out, {"accuracy_level": 4, "lm_head": "int8"})
    assert meta["builder_options"]["matmul_mixed_precision"] == "last_matmul:int8"
    assert meta["builder_options"]["shared_embeddings"] == "false"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    levels = {n.name: next(a.i for a in n.attribute if a.name == "accuracy_level")
              for n in graph.node if n.op_type == "MatMulNBits"}
    head = [k for k in levels if k.startswith("/lm_head/")]
    assert len(head) == 1 and levels[head[0]] == 4 and set(levels.values()) == {4}
    gather = next(n for n in graph.node if n.name == "/model/embed_tokens/Gather")
    assert gather.op_type == "Gather"  # the embedding stays fp32, never re-quantized
    session = cpu_onnx.load(out)
    ids = _chat_ids(checkpoints["sym"])[0]
    logits = cpu_onnx.score(session, ids)
    assert logits.shape == (len(ids), session.vocab_size)
    np.testing.assert_allclose(logits[-1], _last_logits_of_served_model(session, ids), atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------------
# 4. engine.json, compatibility checks, unsupported schemes
# ---------------------------------------------------------------------------------------------


def test_engine_json_records_build(checkpoints, engines) -> None:
    import onnxruntime
    import onnxruntime_genai as og

    meta = json.loads((engines["asym"] / "engine.json").read_text())
    assert meta["backend"] == "cpu"
    assert meta["onnxruntime_genai"] == og.__version__ and meta["onnxruntime"] == onnxruntime.__version__
    assert meta["precision"] == "int4"
    assert meta["quantization"] == {"bits": 4, "group_size": 64, "symmetric": False, "format": "pack-quantized"}
    assert meta["checkpoint_sha256"] == sha256_tree(checkpoints["asym"])
    assert meta["builder_options"]["accuracy_level"] == str(cpu_onnx.DEFAULT_PROFILE["accuracy_level"])
    assert meta["profile"] == cpu_onnx.DEFAULT_PROFILE
    dev = meta["device"]
    assert dev["arch"] and dev["os"] and "cpu_model" in dev and isinstance(dev["isa"], list)
    for name in ("model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (engines["asym"] / name).exists(), name
    assert get_backend("cpu") is cpu_onnx


def _copy_engine(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_check_compatible_names_both_versions(engines, tmp_path: Path) -> None:
    import onnxruntime_genai as og

    cpu_onnx.check_compatible(engines["asym"])  # the real one is fine
    eng = _copy_engine(engines["asym"], tmp_path / "old")
    meta = json.loads((eng / "engine.json").read_text())
    meta["onnxruntime_genai"] = "0.1.0"
    (eng / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(EngineIncompatibleError) as err:
        cpu_onnx.check_compatible(eng)
    assert "0.1.0" in str(err.value) and og.__version__ in str(err.value)
    with pytest.raises(EngineIncompatibleError):
        cpu_onnx.load(eng)

    meta["onnxruntime_genai"] = og.__version__
    meta["backend"] = "tensorrt_llm"
    (eng / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(EngineIncompatibleError, match="tensorrt_llm.*'cpu'"):
        cpu_onnx.check_compatible(eng)

    (eng / "engine.json").unlink()
    with pytest.raises(EngineIncompatibleError, match="no engine.json"):
        cpu_onnx.check_compatible(eng)


def _edit_group(ckpt: Path, dst: Path, **weights) -> Path:
    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"actorder": "group"}, "actorder='group'"),
        ({"num_bits": 8}, "num_bits=8"),
        ({"group_size": 48}, "group_size=48"),
        ({"strategy": "channel"}, "strategy='channel'"),
    ],
)
def test_inexact_scheme_raises_before_building_when_asked_to(edit, message, checkpoints, tmp_path: Path) -> None:
    bad = _edit_group(checkpoints["asym"], tmp_path / "bad", **edit)
    out = tmp_path / "engine"
    with pytest.raises(cpu_onnx.NotInt4Exact, match=message):
        cpu_onnx.build(bad, out, {"inexact_weights": "error"})
    assert not out.exists(), "build must fail before writing anything"


def test_activation_quantization_is_refused_even_when_dequantizing(checkpoints, tmp_path: Path) -> None:
    bad = tmp_path / "w4a8"
    shutil.copytree(checkpoints["asym"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation quantization"):
        cpu_onnx.build(bad, tmp_path / "engine", {})


@pytest.mark.parametrize("recipe", ["gptq-w8a16-sym", "mixed-w8attn-w4mlp"])
def test_w8_and_mixed_checkpoints_build_dequantized_and_match_their_fake_quant_model(recipe, checkpoints, tmp_path) -> None:
    """Shipped W8A16 / mixed recipes: fp32 engine from the dequantized weights, same logits as the HF model."""
    from edgeflow.paths import REPO_ROOT
    from edgeflow.quantize.run import quantize
    from edgeflow.quantize.recipe import load_recipe

    ids = _chat_ids(checkpoints["dense"])
    ckpt = tmp_path / "ckpt"
    quantize(checkpoints["dense"], load_recipe(REPO_ROOT / "deployments" / "recipes" / f"{recipe}.yaml"), ids, ckpt)
    meta = cpu_onnx.build(ckpt, tmp_path / "engine", {})
    assert meta["precision"] == "fp32" and "num_bits=8" in meta["dequantized"]["reason"]
    assert meta["dequantized"]["checkpoint_quantization"]["quant_method"] == "compressed-tensors"
    session = cpu_onnx.load(tmp_path / "engine")
    hf = _hf_model(ckpt)
    for x in ids:
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([x])).logits[0].numpy()
        got = cpu_onnx.score(session, x)
        assert np.abs(got - want).max() < 1e-3
    dense = _hf_model(checkpoints["dense"])
    with torch.no_grad():
        assert not torch.equal(dense.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.q_proj.weight)


def test_act_order_g_idx_tensor_raises(checkpoints, tmp_path: Path) -> None:
    """A permuted weight_g_idx (act-order) in the tensors is rejected even if the config looks plain."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["sym"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    n_in = tensors["model.layers.0.self_attn.q_proj.weight_packed"].shape[1] * 8
    perm = torch.randperm(n_in, generator=torch.Generator().manual_seed(0))
    tensors["model.layers.0.self_attn.q_proj.weight_g_idx"] = (perm // 64).to(torch.int32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order"):
        cpu_onnx.build(bad, tmp_path / "engine", {})


def test_other_quant_methods_are_not_built_dense(checkpoints, tmp_path: Path) -> None:
    bad = tmp_path / "gptq"
    shutil.copytree(checkpoints["dense"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        cpu_onnx.build(bad, tmp_path / "engine", {})
    with pytest.raises(ValueError, match="unknown cpu engine profile keys"):
        cpu_onnx.build(checkpoints["asym"], tmp_path / "engine", {"acuracy_level": 4})


# ---------------------------------------------------------------------------------------------
# 5. two concurrent streams on one loaded model
# ---------------------------------------------------------------------------------------------


def test_two_threads_generate_like_sequential(checkpoints, sessions) -> None:
    session = sessions["asym"]
    a, b = _chat_ids(checkpoints["asym"])[:2]
    sequential = [list(cpu_onnx.generate(session, ids, 24, [])) for ids in (a, b)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(i: int, ids: list[int]) -> None:
        try:
            barrier.wait()
            results[i] = list(cpu_onnx.generate(session, ids, 24, []))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, ids)) for i, ids in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[0], results[1]] == sequential
    assert sequential[0] != sequential[1]  # the two streams really are different


def test_thread_count_env(engines, sessions, monkeypatch) -> None:
    preset = os.environ.get(cpu_onnx.THREADS_ENV)
    assert sessions["asym"].threads == (int(preset) if preset else len(os.sched_getaffinity(0)))  # default: all CPUs
    monkeypatch.setenv(cpu_onnx.THREADS_ENV, "1")
    session = cpu_onnx.load(engines["asym"])
    assert session.threads == 1
    assert len(list(cpu_onnx.generate(session, [1, 9690, 198], 3, []))) == 3
    monkeypatch.setenv(cpu_onnx.THREADS_ENV, "0")
    with pytest.raises(ValueError, match=cpu_onnx.THREADS_ENV):
        cpu_onnx.load(engines["asym"])


def test_build_identity_names_the_runtime_versions() -> None:
    import onnxruntime
    import onnxruntime_genai as og

    ident = get_backend("cpu").build_identity()
    assert og.__version__ in ident and onnxruntime.__version__ in ident


def test_sampling_seeded_and_logprobs_match_score(checkpoints, sessions) -> None:
    """Sampling reads each step's full logits: the same seed gives the same tokens, temperature 0 with
    logprobs gives genai's greedy tokens, and the logprobs are log-softmax of the engine's own logits."""
    from edgeflow.engines.sampling import SamplingParams

    session = sessions["asym"]
    ids = _chat_ids(checkpoints["asym"])[0]
    p = SamplingParams(temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    a = list(cpu_onnx.generate(session, ids, 10, [], p))
    assert [int(t) for t in a] == [int(t) for t in cpu_onnx.generate(session, ids, 10, [], p)]
    assert [int(t) for t in a] != [int(t) for t in cpu_onnx.generate(session, ids, 10, [], SamplingParams(temperature=1.0, seed=4))]
    greedy = list(cpu_onnx.generate(session, ids, 10, []))
    assert [int(t) for t in cpu_onnx.generate(session, ids, 10, [], SamplingParams(logprobs=True))] == greedy
    logits = cpu_onnx.score(session, ids + [int(t) for t in a]).astype(np.float64)
    for i, tok in enumerate(a):
        row = logits[len(ids) - 1 + i]
        ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert tok.logprob == pytest.approx(ref[int(tok)], abs=1e-3)
        assert [t for t, _ in tok.top_logprobs] == np.argsort(-row)[:2].tolist()
