"""edgeflow/model/architecture.py: the one description of a model, the support matrix, and the refusals that name the fix."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgeflow.model import architecture as A
from tests.helpers.families import FAMILY_MODELS

REPO = Path(__file__).resolve().parents[2]


def _saved_config(model_type: str, tmp_path: Path, **extra) -> dict:
    """config.json exactly as transformers writes it for this family (defaults left out, as save_pretrained does)."""
    import transformers

    cfg_cls, _, fam_extra = FAMILY_MODELS[model_type]
    shape = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2)
    cfg = getattr(transformers, cfg_cls)(**(shape | fam_extra | extra))
    cfg.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("model_type", list(FAMILY_MODELS))
def test_every_family_reads_from_the_config_transformers_writes(model_type: str, tmp_path: Path) -> None:
    arch = A.describe(_saved_config(model_type, tmp_path))
    assert arch.model_type == model_type and arch.num_hidden_layers == 3 and len(arch.layer_types) == 3
    gemma = model_type.startswith("gemma")
    assert arch.norm_offset == (1.0 if gemma else 0.0)
    assert arch.sandwich_norms is gemma and arch.activation == ("gelu_tanh" if gemma else "silu")
    assert arch.embed_scale == (pytest.approx(8.0) if gemma else 1.0)  # sqrt(64)
    assert arch.qkv_bias is (model_type == "qwen2") and arch.o_bias is False
    assert arch.qk_norm is (model_type in ("qwen3", "gemma3_text"))
    assert arch.tie_word_embeddings is (model_type in ("llama", "qwen2") or gemma)
    if gemma:
        assert arch.attn_scale == pytest.approx(24 ** -0.5)
        assert arch.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert arch.window(0) == 8 and arch.window(1) is None
    else:
        assert arch.attn_scale == pytest.approx(arch.head_dim ** -0.5)
    assert (arch.attn_softcap, arch.final_softcap) == ((2.0, 5.0) if model_type == "gemma2" else (None, None))
    if model_type == "mistral":
        assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 8
    if model_type == "gemma3_text":
        assert arch.rope["sliding_attention"].theta == 10000.0
        assert (arch.rope["full_attention"].type, arch.rope["full_attention"].factor) == ("linear", 4.0)
    if model_type == "llama":
        assert arch.rope["full_attention"].type == "llama3"


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_are_transformers_own(rope: dict) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope, max_position_embeddings=131072)
    kind = rope["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg, torch.device("cpu"))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    got = A.describe(cfg.to_dict()).rope["full_attention"].inv_freq(64)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-7, atol=0)


def test_transformers_4_spellings_read_as_the_5_ones() -> None:
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    new = A.describe(base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    old = A.describe(base | {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert old == new
    gemma = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
             "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16}
    g4 = A.describe(gemma | {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    g5 = A.describe(gemma | {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert g4 == g5


BASE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100}


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "phi3"}, r"model_type='phi3' is not a supported family \(supported: llama \(Llama\), mistral"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_parameters.rope_type='yarn' is not implemented \(known: default, linear, llama3\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor=0.5: only full-width RoPE"),
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0: the Llama family has no softcapping"),
    ({"sliding_window": 4096}, r"sliding_window=4096 is not part of the Llama family"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not implemented"),
    ({"architectures": ["LlamaForSequenceClassification"]}, r"only \['LlamaForCausalLM'\]"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_a_config_no_backend_understands_is_refused_naming_the_field(edit: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        A.describe(BASE | edit, "m/config.json")


@pytest.mark.parametrize("model_type, backend, message", [
    ("mistral", "tensorrt_llm", r"the Mistral family \(model_type 'mistral'\) cannot run on engine.backend=tensorrt_llm: "
                                r"not converted: .*; backends that run it: cpu_native, llama_cpp, vllm"),
    ("gemma2", "edge_llm", r"TensorRT Edge-LLM supports no Gemma 2 .*backends that run it: cpu_native, llama_cpp, "
                           r"tensorrt_llm, vllm"),
    ("gemma3_text", "cpu", r"KeyError 'rope_type'.*backends that run it: cpu_native, llama_cpp, tensorrt_llm, vllm"),
    ("qwen3", "cpu_native", None),
])
def test_a_family_a_backend_cannot_run_names_the_backends_that_can(model_type, backend, message, tmp_path: Path) -> None:
    config = _saved_config(model_type, tmp_path)
    if message is None:  # runs: no refusal
        A.require(config, backend, "m/config.json")
        return
    with pytest.raises(ValueError, match=message):
        A.require(config, backend, "m/config.json")
    A.require(config, "cpu_native")  # the same config runs where the matrix says it does


def test_gpu_converters_refuse_biases_they_cannot_write(tmp_path: Path) -> None:
    """The GPU plans convert bias-free Llama layers; llama_cpp writes llama3 RoPE and q/k/v biases (what its GGUF
    graphs cannot compute, it refuses at build: tests/engines/test_llama_cpp_families.py)."""
    with pytest.raises(ValueError, match=r"attention_bias/mlp_bias: engine.backend=tensorrt_llm"):
        A.require(BASE | {"attention_bias": True}, "tensorrt_llm")
    assert A.require(_saved_config("llama", tmp_path), "llama_cpp").rope["full_attention"].type == "llama3"
    assert A.require(BASE | {"attention_bias": True}, "llama_cpp").qkv_bias


def _profile_with_teacher(tmp_path: Path, teacher: Path, backend: str) -> Path:
    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["teacher"] = {"source": "local", "path": str(teacher)}
    data["engine"] = {"backend": backend}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_profile_whose_model_the_backend_cannot_run_fails_at_load(tmp_path: Path) -> None:
    from edgeflow.preflight import load_profile

    teacher = tmp_path / "gemma3"
    teacher.mkdir()
    _saved_config("gemma3_text", teacher)
    with pytest.raises(ValueError, match=r"gemma3/config.json: the Gemma 3 family .* cannot run on engine.backend=cpu"
                                         r".*backends that run it: cpu_native, llama_cpp, tensorrt_llm, vllm"):
        load_profile(_profile_with_teacher(tmp_path, teacher, "cpu"))
    assert load_profile(_profile_with_teacher(tmp_path, teacher, "cpu_native")).engine.backend == "cpu_native"
    with pytest.raises(ValueError, match=r"the Gemma 3 family converts from TensorRT-LLM 0\.19\.0 .*build profile "
                                         r"'orin-agx' uses 0\.12\.0"):  # the engine profile's release, at load
        load_profile(_profile_with_teacher(tmp_path, teacher, "tensorrt_llm"))
    cfg = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps(cfg | {"model_type": "phi3"}))
    with pytest.raises(ValueError, match=r"model_type='phi3' is not a supported family"):
        load_profile(_profile_with_teacher(tmp_path, teacher, "cpu_native"))


def test_a_gguf_teachers_family_is_read_from_its_header(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from edgeflow.model.source import gguf_architecture

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("gemma3.block_count", 2)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert gguf_architecture(path) == "gemma3" and A.GGUF_ARCHITECTURES["gemma3"] == "gemma3_text"
    (tmp_path / "x.gguf").write_bytes(b"nope")
    assert gguf_architecture(tmp_path / "x.gguf") is None


def test_readme_support_matrix_is_the_code_s() -> None:
    """README's 'Model families' table: one row per family, one column per backend; a cell says 'runs' (CPU engines),
    'unverified on GPU' (GPU engines that run it) or 'refused' — exactly where BACKEND_FAMILIES says so."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Model families"):]
    rows = [r for r in section.splitlines() if r.startswith("| ")][:1 + len(A.FAMILIES)]  # header + one per family
    header = [c.strip(" `") for c in rows[0].strip("|").split("|")]
    assert header[1:] == list(A.BACKEND_FAMILIES)
    seen = set()
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        mt = re.search(r"`(\w+)`", cells[0]).group(1)
        seen.add(mt)
        for backend, cell in zip(header[1:], cells[1:]):
            runs = A.BACKEND_FAMILIES[backend].get(mt) == A.RUNS
            assert cell.startswith(("runs", "unverified on GPU")) is runs, (mt, backend, cell)
            assert cell.startswith("refused") is (not runs), (mt, backend, cell)
    assert seen == set(A.FAMILIES)


@pytest.mark.parametrize("model_type", list(FAMILY_MODELS))
def test_the_parameter_count_is_the_models_own_for_every_family_and_every_cut(model_type: str, tmp_path: Path) -> None:
    import transformers

    config = _saved_config(model_type, tmp_path)
    arch = A.describe(config)
    _, model_cls, _ = FAMILY_MODELS[model_type]
    for layers in (3, 1):
        cut = {"num_hidden_layers": layers} | ({"layer_types": config["layer_types"][:layers]} if config.get("layer_types") else {})
        cfg = transformers.AutoConfig.for_model(**(config | cut))
        model = getattr(transformers, model_cls)(cfg)
        assert arch.params(layers) == sum(p.numel() for p in model.parameters()), (model_type, layers)


def test_a_cut_that_leaves_the_embedding_most_of_the_model_says_so_and_what_saves_more(tmp_path: Path) -> None:
    # Gemma 3 270M's shape: 18 layers of width 640 under a 262,144-token embedding tied with the head
    gemma = A.describe(_saved_config("gemma3_text", tmp_path, vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                     num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                     layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 12))
    assert round(gemma.params() / 1e6, 1) == 268.1 and round(gemma.params(14) / 1e6, 1) == 245.8  # the demo's cut, measured
    advice = A.cut_advice(gemma, 14)
    assert advice.startswith("the student keeps 14 of the teacher's 18 layers: about 245.8 M of its 268.1 M parameters, 8% smaller")
    assert "262,144 x 640 embedding (tied with the head) is 63% of the model" in advice
    assert "fewer layers (every other layer leaves 217.9 M, 19% smaller)" in advice and "distill.student_from" in advice
    assert "fewer layers" not in A.cut_advice(gemma, 9)  # already every other layer: only a narrower student or vocabulary
    assert A.cut_advice(gemma, 4) is None  # 4 of 18 layers: 29 % smaller, enough


@pytest.mark.parametrize("settings, teacher_layers, layers", [
    ({"keep_every_k": 15}, 30, 3), ({"keep_every_k": 2}, 18, 10), ({"drop_block": 4}, 18, 14),
    ({"keep_layers": [0, 5, 17]}, 18, 3), ({"student_from": "some/dir"}, 18, None)])
def test_the_student_s_layers_are_known_from_the_distill_settings_before_any_model_loads(settings, teacher_layers, layers) -> None:
    from edgeflow.profile import DistillConfig

    assert DistillConfig(**settings).student_layers(teacher_layers) == layers
