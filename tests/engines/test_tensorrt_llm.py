"""CPU tests of the TensorRT-LLM engine backend (edgeflow/engines/tensorrt_llm/), up to the hardware boundary.

Checkpoints are written by hand (config.json, tokenizer files, and for the staging tests a few tensors
packed by compressed-tensors itself); no model and no tensorrt_llm are needed. What runs only on a GPU
(convert, trtllm-build, the runtime) is exercised through its command lines, pure checks and a fake
executor with the API shape of tensorrt_llm.bindings.executor; `test_gpu_build_load_generate` does the
real thing where CUDA and TensorRT-LLM exist.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import API, EngineIncompatibleError, get_backend
from edgeflow.engines import engine_dir as edir
from edgeflow.engines import tensorrt_llm as trt
from edgeflow.engines.checkpoint import load_tensors, unpack_int32_le

REPO = Path(__file__).resolve().parents[2]

HIDDEN, INTER = 128, 256  # tiny Llama: multiples of 64 like SmolLM2's 576 / 1536
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 1, "vocab_size": 32,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "dtype": "float32", "eos_token_id": 2,
    "bos_token_id": 1, "pad_token_id": 2,
}
W4_ASYM = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64, "actorder": None}
W4_SYM = {**W4_ASYM, "symmetric": True}
W8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None, "actorder": "static"}
RECIPES = {
    "awq": "quant_stage:\n  quant_modifiers:\n    AWQModifier: {duo_scaling: true}\n    QuantizationModifier: {}\n",
    "gptq": "quant_stage:\n  quant_modifiers:\n    GPTQModifier: {block_size: 128}\n",
    "rtn": "quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {ignore: [lm_head]}\n",
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _qc(groups: dict, **extra) -> dict:
    cfg = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
        "config_groups": {
            name: {"targets": t, "weights": w, "input_activations": None, "output_activations": None, "format": "pack-quantized"}
            for name, (t, w) in groups.items()
        },
    }
    cfg.update(extra)
    return cfg


def _ckpt(root: Path, name: str, qc: dict | None = None, recipe: str | None = None, **config) -> Path:
    """A checkpoint directory with config.json and tokenizer files (no weights: plans read config only)."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {**LLAMA, **config}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 2, "bos_token_id": 1}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}))
    if recipe:
        (d / "recipe.yaml").write_text(RECIPES[recipe])
    return d


@pytest.fixture
def ckpts(tmp_path: Path) -> dict[str, Path]:
    return {
        "dense": _ckpt(tmp_path, "dense"),
        "awq": _ckpt(tmp_path, "awq", _qc({"group_0": (["Linear"], W4_ASYM)}), recipe="awq"),
        "gptq": _ckpt(tmp_path, "gptq", _qc({"group_0": (["Linear"], W4_SYM)}), recipe="gptq"),
        "gptq_actorder": _ckpt(tmp_path, "gptq_actorder", _qc({"group_0": (["Linear"], {**W4_SYM, "actorder": "weight"})})),
        "rtn": _ckpt(tmp_path, "rtn", _qc({"group_0": (["Linear"], W4_ASYM)}), recipe="rtn"),
        "w8": _ckpt(tmp_path, "w8", _qc({"group_0": (["Linear"], W8_CHANNEL)})),
        "unlabelled_awq": _ckpt(tmp_path, "unlabelled_awq", _qc({"group_0": (["Linear"], W4_ASYM)})),
    }


def _flag(cmd: list[str], name: str) -> str | bool:
    """Value following `name` in a command line; True for a bare switch; KeyError if absent."""
    if name not in cmd:
        raise KeyError(name)
    i = cmd.index(name)
    return cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else True


# ---------------------------------------------------------------------------------------------
# module surface
# ---------------------------------------------------------------------------------------------


def test_import_needs_no_gpu_runtime():
    code = (
        "import sys, edgeflow.engines.tensorrt_llm as m; "
        "bad = [n for n in ('tensorrt_llm', 'tensorrt', 'torch') if n in sys.modules]; "
        "assert not bad, bad; print(m.BACKEND)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tensorrt_llm"


def test_backend_contract():
    assert get_backend("tensorrt_llm") is trt
    assert trt.BACKEND == "tensorrt_llm"
    for name in API:
        assert callable(getattr(trt, name)), name
    assert trt.DEFAULT_PROFILE["build_profile"] in trt.available_build_profiles()
    assert set(trt.available_build_profiles()) >= {"orin-agx", "a100"}


# ---------------------------------------------------------------------------------------------
# plans: profiles, flags, converter precision
# ---------------------------------------------------------------------------------------------


def test_orin_agx_plan(ckpts, tmp_path):
    plan = trt.plan_build(ckpts["awq"], {"build_profile": "orin-agx"}, tmp_path / "eng")
    bp, build, score = plan["build_profile"], plan["commands"]["build"], plan["commands"]["build_score"]
    assert (bp["target"], bp["tensorrt_llm_branch"], bp["jetpack"]) == ("sm87", "v0.12.0-jetson", "6.1")
    assert bp["in_flight_batching"] is True
    expected = {
        "--tokens_per_block": "64", "--max_batch_size": "2", "--max_input_len": "2048", "--max_seq_len": "2560",
        "--use_paged_context_fmha": "enable", "--context_fmha": "enable", "--paged_kv_cache": "enable",
        "--remove_input_padding": "enable", "--gemm_plugin": "auto", "--gpt_attention_plugin": "float16",
        "--max_beam_width": "1", "--checkpoint_dir": plan["paths"]["tllm_checkpoint"], "--output_dir": str(tmp_path / "eng"),
    }
    assert {k: _flag(build, k) for k in expected} == expected
    assert build[1:3] == ["-m", "tensorrt_llm.commands.build"]
    # score() gets its own engine with context logits; the serving engine stays last-token only
    assert "--gather_context_logits" not in build
    assert _flag(score, "--gather_context_logits") is True
    assert _flag(score, "--output_dir") == str(tmp_path / "eng" / "score")
    assert [c for c in score if c != "--gather_context_logits"] == [
        str(tmp_path / "eng" / "score") if c == str(tmp_path / "eng") else c for c in build]
    convert = plan["commands"]["convert"]
    assert convert[1].endswith("examples/llama/convert_checkpoint.py")
    assert _flag(convert, "--model_dir") == plan["paths"]["staging"]
    assert _flag(convert, "--dtype") == "float16"


@pytest.mark.parametrize("name,algorithm,source", [
    ("awq", "awq", "recipe.yaml"), ("gptq", "gptq", "recipe.yaml"), ("rtn", "rtn", "recipe.yaml"),
    ("gptq_actorder", None, None),
])
def test_w4a16_precision_is_int4_gptq_for_every_recipe(ckpts, tmp_path, name, algorithm, source):
    plan = trt.plan_build(ckpts[name], {}, tmp_path / "eng")
    convert, quant = plan["commands"]["convert"], plan["quantization"]
    assert _flag(convert, "--use_weight_only") is True
    assert _flag(convert, "--weight_only_precision") == "int4_gptq"
    assert _flag(convert, "--per_group") is True
    assert _flag(convert, "--group_size") == "64"
    assert _flag(convert, "--quant_ckpt_path") == str(Path(plan["paths"]["staging"]) / "model.safetensors")
    assert "int4_awq" not in convert
    assert (quant["algorithm"], quant["algorithm_source"]) == (algorithm, source)
    assert quant["exact"] is True and quant["staging"] == "gptq_int4" and quant["trtllm_quant_algo"] == "W4A16_GPTQ"
    assert "int4_awq" in quant["why"] and "pre_quant_scale" in quant["why"]


def test_algorithm_from_profile_and_mismatch(ckpts, tmp_path):
    plan = trt.plan_build(ckpts["unlabelled_awq"], {"algorithm": "awq"}, tmp_path / "eng")
    assert (plan["quantization"]["algorithm"], plan["quantization"]["algorithm_source"]) == ("awq", "profile")
    assert _flag(plan["commands"]["convert"], "--weight_only_precision") == "int4_gptq"
    with pytest.raises(ValueError, match=r"algorithm='gptq'.*recipe\.yaml.*'awq'"):
        trt.plan_build(ckpts["awq"], {"algorithm": "gptq"}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"algorithm='smoothquant'"):
        trt.plan_build(ckpts["awq"], {"algorithm": "smoothquant"}, tmp_path / "eng")


def test_w8a16_precision_per_profile(ckpts, tmp_path):
    orin = trt.plan_build(ckpts["w8"], {"build_profile": "orin-agx"}, tmp_path / "eng")
    conv = orin["commands"]["convert"]
    assert _flag(conv, "--weight_only_precision") == "int8"
    assert "--per_group" not in conv and "--quant_ckpt_path" not in conv
    assert orin["quantization"]["exact"] is False and orin["quantization"]["staging"] == "dense_dequantized"
    a100 = trt.plan_build(ckpts["w8"], {"build_profile": "a100"}, tmp_path / "eng")
    conv = a100["commands"]["convert"]
    assert _flag(conv, "--weight_only_precision") == "int8_gptq"
    assert _flag(conv, "--group_size") == "64" and _flag(conv, "--per_group") is True
    assert a100["quantization"]["exact"] is True and a100["quantization"]["trtllm_quant_algo"] == "W8A16_GPTQ"
    # the orin profile can opt into the exact path too
    exact = trt.plan_build(ckpts["w8"], {"int8_weight_only_precision": "int8_gptq"}, tmp_path / "eng")
    assert _flag(exact["commands"]["convert"], "--weight_only_precision") == "int8_gptq"


def test_dense_plan_has_no_weight_only_flags(ckpts, tmp_path):
    plan = trt.plan_build(ckpts["dense"], {}, tmp_path / "eng")
    conv = plan["commands"]["convert"]
    assert "--use_weight_only" not in conv and "--weight_only_precision" not in conv
    assert plan["quantization"]["weight_only_precision"] is None and plan["quantization"]["staging"] == "dense"


def test_a100_plan_differs(ckpts, tmp_path):
    orin = trt.plan_build(ckpts["gptq"], {"build_profile": "orin-agx"}, tmp_path / "eng")
    a100 = trt.plan_build(ckpts["gptq"], {"build_profile": "a100"}, tmp_path / "eng")
    b = a100["commands"]["build"]
    assert a100["build_profile"]["target"] == "sm80" and a100["build_profile"]["jetpack"] is None
    assert (_flag(b, "--max_batch_size"), _flag(b, "--max_input_len"), _flag(b, "--max_seq_len"),
            _flag(b, "--tokens_per_block")) == ("64", "4096", "8192", "128")
    assert _flag(b, "--kv_cache_type") == "paged" and "--paged_kv_cache" not in b
    assert a100["commands"]["convert"][1].endswith("examples/models/core/llama/convert_checkpoint.py")
    assert _flag(a100["commands"]["convert"], "--weight_only_precision") == "int4_gptq"
    assert orin["commands"]["build"] != b and orin["build_profile"] != a100["build_profile"]


def test_profile_overrides_apply(ckpts, tmp_path):
    plan = trt.plan_build(ckpts["gptq"], {"max_batch_size": 1, "tokens_per_block": 32, "max_input_len": 1024,
                                          "max_num_tokens": 1024, "gather_context_logits": "serving"}, tmp_path / "e")
    b = plan["commands"]["build"]
    assert (_flag(b, "--max_batch_size"), _flag(b, "--tokens_per_block"), _flag(b, "--max_input_len")) == ("1", "32", "1024")
    assert plan["build_profile_name"] == "orin-agx" and plan["build_profile"]["max_batch_size"] == 1
    assert _flag(b, "--gather_context_logits") is True and plan["commands"]["build_score"] is None
    off = trt.plan_build(ckpts["gptq"], {"gather_context_logits": "off"}, tmp_path / "e")
    assert "--gather_context_logits" not in off["commands"]["build"] and off["commands"]["build_score"] is None
    src = trt.plan_build(ckpts["gptq"], {"tensorrt_llm_src": "/src/trtllm"}, tmp_path / "e")
    assert src["commands"]["convert"][1] == "/src/trtllm/examples/llama/convert_checkpoint.py"


@pytest.mark.parametrize("profile,pattern", [
    ({"max_batch_szie": 4}, r"unknown tensorrt_llm engine profile keys \['max_batch_szie'\]"),
    ({"build_profile": "orin-nano"}, r"build_profile='orin-nano' is unknown; choose one of \['a100', 'orin-agx'\]"),
    ({"tokens_per_block": 48}, r"tokens_per_block=48 must be a power of two"),
    ({"max_seq_len": 1024}, r"max_seq_len=1024 must exceed max_input_len=2048"),
    ({"max_num_tokens": 512}, r"max_num_tokens=512 must be >= max_input_len=2048"),
    ({"gemm_plugin": "bfloat16"}, r"gemm_plugin='bfloat16' with dtype='float16'"),
    ({"target": "ampere"}, r"target: String should match pattern"),
    ({"max_batch_size": 0}, r"max_batch_size: Input should be greater than 0"),
    ({"use_paged_context_fmha": True, "context_fmha": False}, r"use_paged_context_fmha=true needs context_fmha=true"),
    ({"paged_kv_cache": False, "use_paged_context_fmha": False}, r"in_flight_batching=true needs paged_kv_cache=true"),
    ({"max_seq_len": 9000, "max_num_tokens": 9000, "max_input_len": 8192}, r"max_seq_len=9000 exceeds the model's max_position_embeddings=8192"),
])
def test_bad_profiles_raise_naming_the_key(ckpts, tmp_path, profile, pattern):
    with pytest.raises(ValueError, match=pattern):
        trt.plan_build(ckpts["gptq"], profile, tmp_path / "eng")


# ---------------------------------------------------------------------------------------------
# API generation: the TensorRT engine flow exists in TensorRT-LLM >=0.12.0,<1.3.0rc21
# ---------------------------------------------------------------------------------------------


def test_api_generations_bounds():
    """v1.3.0rc20 was the last release with the TensorRT backend; 1.2.1 the last stable one (see plan.API_GENERATIONS)."""
    gen = trt.API_GENERATIONS["tensorrt-engine"]
    assert (gen.since, gen.removed_in, gen.last_release, gen.range()) == ("0.12.0", "1.3.0rc21", "1.2.1", ">=0.12.0,<1.3.0rc21")
    assert trt.API_GENERATIONS["pytorch-llm-api"].since == gen.removed_in and trt.BACKEND_API == "tensorrt-engine"
    for version in ("0.12.0", "0.12.0.dev2024", "0.21.0", "1.2.1", "1.3.0rc15", "1.3.0rc20", "1.3.0rc20.post1"):
        assert trt.api_generation_of(version) == "tensorrt-engine", version
    for version in ("1.3.0rc21", "1.3.0rc22", "1.3.0rc22.post1", "1.3.0", "1.4.0rc1", "2.0.0"):
        assert trt.api_generation_of(version) == "pytorch-llm-api", version
    assert trt.api_generation_of(None) is None and trt.api_generation_of("jetson") is None


def test_version_order_matches_pep440():
    """The pre-release ordering the removal bound depends on (1.3.0rc20 < 1.3.0rc21 < 1.3.0), checked against packaging."""
    version = pytest.importorskip("packaging.version")
    versions = ["0.12.0", "0.13.0", "1.0.0rc4", "1.0.0", "1.2.0rc8", "1.2.0", "1.2.1", "1.3.0a1", "1.3.0b2", "1.3.0rc2",
                "1.3.0rc15", "1.3.0rc20", "1.3.0rc21", "1.3.0", "1.4.0rc1", "10.0.0"]
    assert sorted(versions, key=trt.version_order) == sorted(versions, key=version.Version)
    assert trt.version_order("1.3.0rc20.post1") == trt.version_order("1.3.0rc20")  # .post/.dev count as their release
    assert trt.version_order("nightly") is None


def test_profiles_pin_the_tensorrt_engine_api(ckpts, tmp_path):
    for name in ("orin-agx", "a100"):
        plan = trt.plan_build(ckpts["gptq"], {"build_profile": name}, tmp_path / "eng")
        bp = plan["build_profile"]
        assert bp["api"] == "tensorrt-engine" and trt.api_generation_of(bp["tensorrt_llm_version"]) == "tensorrt-engine"
    # the A100 stays on the last stable release that still builds engines; Orin on the Jetson branch
    assert trt.load_build_profile("a100")["tensorrt_llm_version"] == trt.API_GENERATIONS["tensorrt-engine"].last_release
    assert trt.load_build_profile("a100")["api"] == trt.load_build_profile("orin-agx")["api"] == "tensorrt-engine"
    # the last pre-release with the flow still plans
    rc20 = trt.plan_build(ckpts["gptq"], {"build_profile": "a100", "tensorrt_llm_version": "1.3.0rc20"}, tmp_path / "eng")
    assert rc20["build_profile"]["tensorrt_llm_version"] == "1.3.0rc20"


@pytest.mark.parametrize("version", ["1.3.0rc21", "1.3.0rc22", "1.3.0", "1.4.0rc1", "2.0.0"])
def test_profile_past_the_removal_is_refused(ckpts, tmp_path, version):
    pattern = (rf"build profile 'a100' .*tensorrt_llm_version='{version}' with api 'tensorrt-engine': TensorRT-LLM removed the "
               r"TensorRT engine flow \(convert_checkpoint\.py, trtllm-build, ModelRunnerCpp\) in 1\.3\.0rc21; api 'tensorrt-engine' "
               r"exists in TensorRT-LLM >=0\.12\.0,<1\.3\.0rc21\. Fix: pin an earlier release \(1\.2\.1 is the last stable one with "
               r"it\) or serve the checkpoint with the vllm backend")
    with pytest.raises(ValueError, match=pattern):
        trt.plan_build(ckpts["gptq"], {"build_profile": "a100", "tensorrt_llm_version": version}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"with api 'tensorrt-engine': TensorRT-LLM removed"):  # when the edgeflow profile loads
        trt.Profile(build_profile="a100", tensorrt_llm_version=version)


@pytest.mark.parametrize("override,pattern", [
    ({"tensorrt_llm_version": "0.11.0"}, r"tensorrt_llm_version='0\.11\.0' is older than this backend's api 'tensorrt-engine' "
                                         r"supports \(>=0\.12\.0,<1\.3\.0rc21\).*Fix: pin TensorRT-LLM 0\.12\.0 or later"),
    ({"tensorrt_llm_version": "main"}, r"tensorrt_llm_version='main' is not a TensorRT-LLM version"),
    ({"api": "pytorch-llm-api"}, r"api='pytorch-llm-api': this backend builds and runs 'tensorrt-engine' engines.*Fix: .*serve the "
                                 r"checkpoint with the vllm backend"),
])
def test_profile_api_and_version_are_checked(ckpts, tmp_path, override, pattern):
    with pytest.raises(ValueError, match=pattern):
        trt.plan_build(ckpts["gptq"], override, tmp_path / "eng")


def test_only_tensorrt_llm_profiles_are_offered(tmp_path, monkeypatch):
    """deployments/engine-profiles/ also holds other backends' profiles (e.g. edge_llm's): only files with a
    tensorrt_llm_version are this backend's."""
    (tmp_path / "a100.yaml").write_text((trt.plan.PROFILES_DIR / "a100.yaml").read_text())
    (tmp_path / "orin-jp7.yaml").write_text('description: "another backend"\nedge_llm_version: "0.10.0"\n')
    monkeypatch.setattr(trt.plan, "PROFILES_DIR", tmp_path)
    assert trt.available_build_profiles() == ["a100"]
    with pytest.raises(ValueError, match=r"build_profile='orin-jp7' is unknown; choose one of \['a100'\]"):
        trt.load_build_profile("orin-jp7")


def _group(weights: dict, **extra) -> dict:
    return {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
            "format": "pack-quantized", **extra}


@pytest.mark.parametrize("qc,pattern", [
    (_qc({"g": (["Linear"], W4_SYM)}) | {"config_groups": {"g": _group(W4_SYM, input_activations={"num_bits": 8})}},
     r"config_groups\.g: activation quantization is set"),
    (_qc({"attn": (["re:.*self_attn.*"], W8_CHANNEL), "mlp": (["re:.*mlp.*"], W4_SYM)}),
     r"config_groups use different schemes .*mixed W8/W4"),
    (_qc({"g": (["Linear"], {**W4_SYM, "actorder": "group"})}), r"weights\.actorder='group'"),
    (_qc({"g": (["Linear"], {**W4_SYM, "group_size": 32})}), r"weights\.group_size=32: TensorRT-LLM's group-wise kernels take \[64, 128\]"),
    (_qc({"g": (["Linear"], W4_SYM)}, kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme="),
    (_qc({"g": (["Linear"], W4_SYM)}, ignore=[]), r"quantization_config\.ignore=\[\]: the lm_head is quantized"),
    (_qc({"g": (["Linear"], W4_SYM)}, quant_method="gptq"), r"quant_method='gptq'"),
    (_qc({"g": (["Linear"], W4_SYM)}, sparsity_config={"format": "sparse-24"}), r"sparsity_config is set"),
    (_qc({"g": (["Linear"], {**W4_SYM, "type": "float"})}), r"weights: type='float'"),
    (_qc({"g": (["Linear"], {**W4_SYM, "strategy": "channel"})}), r"strategy='channel' with num_bits=4"),
    (_qc({"g": (["Linear"], {**W8_CHANNEL, "strategy": "group", "group_size": 64})}), r"set profile int8_weight_only_precision=int8_gptq"),
    (_qc({"g": (["Linear"], {**W4_SYM, "dynamic": True})}), r"weights\.dynamic=true"),
])
def test_unsupported_schemes_raise_before_any_work(tmp_path, qc, pattern):
    ckpt = _ckpt(tmp_path, "bad", qc)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=pattern):
        trt.plan_build(ckpt, {}, tmp_path / "eng")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # planning writes nothing


GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "query_pre_attn_scalar": 64,
          "hidden_activation": "gelu_pytorch_tanh"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "query_pre_attn_scalar": 64,
          "hidden_activation": "gelu_pytorch_tanh"}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


@pytest.mark.parametrize("family, profile, script", [
    (QWEN2, "orin-agx", "examples/qwen/convert_checkpoint.py"),  # 0.12.0: "Supported Qwen 2"
    (QWEN2, "a100", "examples/models/core/qwen/convert_checkpoint.py"),
    (QWEN3, "a100", "examples/models/core/qwen/convert_checkpoint.py"),
    (GEMMA2, "a100", "examples/models/core/gemma/convert_checkpoint.py"),
    (GEMMA3, "a100", "examples/models/core/gemma/convert_checkpoint.py"),
])
def test_each_family_converts_with_its_own_example(tmp_path, family, profile, script):
    plan = trt.plan_build(_ckpt(tmp_path, "m", **family), {"build_profile": profile}, tmp_path / "eng")
    convert = plan["commands"]["convert"]
    assert convert[1] == f"/opt/TensorRT-LLM/{script}"
    if family["model_type"].startswith("gemma"):  # the gemma converter's own flag spellings
        assert convert[2:8] == ["--ckpt-type", "hf", "--model-dir", plan["paths"]["staging"], "--output-model-dir",
                                plan["paths"]["tllm_checkpoint"]]
    else:
        assert _flag(convert, "--model_dir") == plan["paths"]["staging"]


@pytest.mark.parametrize("family, message", [
    (GEMMA2, r"the Gemma 2 family converts from TensorRT-LLM 0\.13\.0 \(release notes 0\.13\.0: Gemma 2\); build "
             r"profile 'orin-agx' uses 0\.12\.0 \(v0\.12\.0-jetson\)\. Fix: .*engine.backend one of: cpu_native, "
             r"llama_cpp, vllm"),
    (GEMMA3, r"the Gemma 3 family converts from TensorRT-LLM 0\.19\.0"),
    (QWEN3, r"the Qwen3 family converts from TensorRT-LLM 1\.0\.0 .*engine.backend one of: cpu_native, cpu, llama_cpp, "
            r"edge_llm, vllm"),
])
def test_a_family_the_jetson_branch_lacks_is_refused_naming_the_version(tmp_path, family, message):
    with pytest.raises(ValueError, match=message):
        trt.plan_build(_ckpt(tmp_path, "m", **family), {"build_profile": "orin-agx"}, tmp_path / "e")
    trt.check_model(json.loads((tmp_path / "m" / "config.json").read_text()), {"build_profile": "a100"})


def test_int4_checkpoints_of_families_without_an_exact_converter_path_are_refused(tmp_path):
    ckpt = _ckpt(tmp_path, "q", _qc({"g": (["Linear"], W4_ASYM)}), **QWEN2)
    with pytest.raises(ValueError, match=r"a 4-bit Qwen2 checkpoint: TensorRT-LLM's qwen converter takes no pre-quantized "
                                         r"weights edgeflow stages exactly .*edge_llm"):
        trt.plan_build(ckpt, {"build_profile": "orin-agx"}, tmp_path / "e")


def test_non_llama_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"Mistral family \(model_type .mistral.\) cannot run on engine.backend=tensorrt_llm: "
                                         r"not converted: .*sliding-window"):
        trt.plan_build(_ckpt(tmp_path, "g", architectures=["MistralForCausalLM"], model_type="mistral"), {}, tmp_path / "e")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        trt.plan_build(tmp_path / "empty", {}, tmp_path / "e")


# ---------------------------------------------------------------------------------------------
# device compatibility, engine.json, cache key
# ---------------------------------------------------------------------------------------------

ORIN = {"cuda_available": True, "sm": "sm87", "device_name": "Orin", "driver_version": "540.4.0", "cuda_version": "12.6.68",
        "tensorrt": "10.3.0.30", "tensorrt_llm": "0.12.0", "l4t_release": "36.4.0", "jetpack": "6.1", "reason": None}
A100 = {"cuda_available": True, "sm": "sm80", "device_name": "NVIDIA A100-SXM4-80GB", "driver_version": "580.65.06",
        "cuda_version": "13.0.1", "tensorrt": "10.13.3.9", "tensorrt_llm": "1.2.1", "l4t_release": None, "jetpack": None, "reason": None}
CPU = {"cuda_available": False, "sm": None, "device_name": None, "driver_version": None, "cuda_version": None,
       "tensorrt": None, "tensorrt_llm": None, "l4t_release": None, "jetpack": None, "reason": "no nvidia-smi answer and no torch to query CUDA"}


def _meta(device: dict, **extra) -> dict:
    """engine.json as a build on `device` writes it (with its API generation)."""
    return {"backend": "tensorrt_llm", "sm": device["sm"], "tensorrt_llm": device["tensorrt_llm"], "tensorrt": device["tensorrt"],
            "api": "tensorrt-engine", "precision": "int4", "checkpoint_sha256": "0" * 64, "files": ["config.json"], **extra}


def _legacy_meta(device: dict) -> dict:
    """engine.json of a build from before the `api` field."""
    return {k: v for k, v in _meta(device).items() if k != "api"}


def test_compare_sm80_engine_on_sm87_device():
    with pytest.raises(EngineIncompatibleError) as e:
        trt.compare(_meta(A100), ORIN)
    assert ("engine built for sm80 with TensorRT-LLM 1.2.1 (API tensorrt-engine); "
            "this device is sm87 with 0.12.0 (API tensorrt-engine)") in str(e.value)
    assert "rebuild the engine on this device" in str(e.value)


@pytest.mark.parametrize("meta,device,pattern", [
    (_meta(ORIN), {**ORIN, "tensorrt_llm": "0.13.0"},
     r"engine built for sm87 with TensorRT-LLM 0\.12\.0 \(API tensorrt-engine\); this device is sm87 with 0\.13\.0 "
     r"\(API tensorrt-engine\): TensorRT-LLM versions must match exactly"),
    (_meta(ORIN), {**ORIN, "tensorrt_llm": "0.12.1"},
     r"this device is sm87 with 0\.12\.1 \(API tensorrt-engine\): TensorRT-LLM versions must match exactly"),
    (_meta(ORIN), {**ORIN, "tensorrt": "10.4.0.26"},
     r"engine built for sm87 with TensorRT-LLM 0\.12\.0 \(API tensorrt-engine\) and TensorRT 10\.3\.0\.30; "
     r"this device \(sm87\) has TensorRT 10\.4\.0\.26"),
    (_meta(ORIN), {**ORIN, "tensorrt": None}, r"has no TensorRT Python bindings"),
    (_meta(ORIN), {**ORIN, "tensorrt_llm": None}, r"this device is sm87 with no TensorRT-LLM installed"),
    (_meta(ORIN), CPU,
     r"engine built for sm87 with TensorRT-LLM 0\.12\.0 \(API tensorrt-engine\); this device has no CUDA GPU \(no nvidia-smi answer"),
    ({**_meta(ORIN), "backend": "cpu"}, ORIN, r"engine backend is 'cpu'; this backend runs 'tensorrt_llm' engines"),
])
def test_compare_each_mismatch_has_its_own_message(meta, device, pattern):
    with pytest.raises(EngineIncompatibleError, match=pattern):
        trt.compare(meta, device)


def test_compare_names_the_api_generation_on_both_sides():
    """A host whose TensorRT-LLM is past the removal cannot load any TensorRT engine: both generations are named."""
    rc22 = {**A100, "tensorrt_llm": "1.3.0rc22"}
    with pytest.raises(EngineIncompatibleError, match=(
            r"engine built for sm80 with TensorRT-LLM 1\.2\.1 \(API tensorrt-engine\); this device is sm80 with 1\.3\.0rc22 "
            r"\(API pytorch-llm-api\): TensorRT-LLM removed the 'tensorrt-engine' flow \(TensorRT engines, ModelRunnerCpp\) in "
            r"1\.3\.0rc21, so this TensorRT-LLM cannot load the engine at all\. Fix: install TensorRT-LLM 1\.2\.1 here, or serve "
            r"the checkpoint with the vllm backend")):
        trt.compare(_meta(A100), rc22)
    # the architecture is still checked first
    with pytest.raises(EngineIncompatibleError, match=r"this device is sm87 with 1\.3\.0rc22 \(API pytorch-llm-api\): a TensorRT engine"):
        trt.compare(_meta(A100), {**ORIN, "tensorrt_llm": "1.3.0rc22"})
    # an engine.json with another generation is not this backend's to run
    with pytest.raises(EngineIncompatibleError, match=r"\(API pytorch-llm-api\): this backend runs 'tensorrt-engine' engines"):
        trt.compare(_meta(A100, api="pytorch-llm-api"), A100)


def test_engine_json_without_api_reads_as_the_legacy_flow(tmp_path, monkeypatch):
    edir.write_meta(tmp_path, _legacy_meta(A100))
    (tmp_path / "config.json").write_text("{}")
    assert trt.engine_api(_legacy_meta(A100)) == ("tensorrt-engine", True)
    assert trt.engine_api(_meta(A100)) == ("tensorrt-engine", False)
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(A100))
    trt.check_compatible(tmp_path)  # same device and versions: loads as before
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: {**A100, "tensorrt_llm": "1.4.0rc1"})
    with pytest.raises(EngineIncompatibleError, match=(
            r"engine built for sm80 with TensorRT-LLM 1\.2\.1 \(API tensorrt-engine, implied: engine\.json predates its api "
            r"field\); this device is sm80 with 1\.4\.0rc1 \(API pytorch-llm-api\): TensorRT-LLM removed")):
        trt.check_compatible(tmp_path)


def test_compare_accepts_same_device_and_build_suffixes():
    trt.compare(_meta(ORIN), dict(ORIN))
    trt.compare(_meta(ORIN), {**ORIN, "driver_version": "999", "tensorrt_llm": "0.12.0.post1"})


def test_check_compatible_files(tmp_path):
    with pytest.raises(EngineIncompatibleError, match=r"no engine\.json; not an edgeflow engine directory"):
        trt.check_compatible(tmp_path)
    edir.write_meta(tmp_path, {**_meta(ORIN), "files": ["config.json", "rank0.engine", "score/rank0.engine"]})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineIncompatibleError, match=r"engine files missing: \['rank0\.engine', 'score/rank0\.engine'\]"):
        trt.check_compatible(tmp_path)


def test_build_identity_names_the_gpu_and_runtime(monkeypatch):
    """Part of the build stage's cache key: an Orin and an A100 (or a TensorRT-LLM upgrade) never share a cached engine."""
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(ORIN))
    orin = trt.build_identity()
    assert "sm87" in orin and "0.12.0" in orin
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(A100))
    assert "sm80" in trt.build_identity() and trt.build_identity() != orin
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: {**ORIN, "tensorrt_llm": "0.12.1"})
    assert trt.build_identity() != orin


def test_check_compatible_uses_device_fingerprint(tmp_path, monkeypatch):
    edir.write_meta(tmp_path, {**_meta(A100), "files": ["config.json"]})
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(ORIN))
    with pytest.raises(EngineIncompatibleError, match=r"engine built for sm80 with TensorRT-LLM 1\.2\.1 \(API tensorrt-engine\); "
                       r"this device is sm87 with 0\.12\.0 \(API tensorrt-engine\)"):
        trt.check_compatible(tmp_path)
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(A100))
    trt.check_compatible(tmp_path)


def test_engine_json_round_trip(ckpts, tmp_path):
    out = tmp_path / "eng"
    out.mkdir()
    plan = trt.plan_build(ckpts["awq"], {"build_profile": "orin-agx"}, out)
    engine_config = {"version": "0.12.0", "pretrained_config": {"quantization": {"quant_algo": "W4A16_GPTQ", "group_size": 64}},
                     "build_config": {"max_batch_size": 2, "plugin_config": {"tokens_per_block": 64}}}
    sha = sha256_tree(ckpts["awq"])
    meta = trt.engine_meta(plan, ORIN, ckpts["awq"], sha, engine_config, {"kind": "gptq_int4"},
                           ["config.json", "rank0.engine"], ["tokenizer_config.json"], 2, 2)
    edir.write_meta(out, meta)
    back = edir.read_meta(out)
    assert back == meta and back.precision == "int4" and back.files == ["config.json", "rank0.engine"]
    back = back.model_dump(mode="json")
    trt.compare(back, dict(ORIN))
    assert (back["sm"], back["tensorrt_llm"], back["tensorrt"], back["cuda"], back["device_name"]) == ("sm87", "0.12.0", "10.3.0.30", "12.6.68", "Orin")
    assert (back["l4t_release"], back["jetpack"]) == ("36.4.0", "6.1")
    assert back["quantization"]["weight_only_precision"] == "int4_gptq" and back["quantization"]["algorithm"] == "awq"
    assert back["commands"]["build"] == plan["commands"]["build"] and back["commands"]["convert"] == plan["commands"]["convert"]
    assert back["build_profile"] == plan["build_profile"] and back["build_profile_name"] == "orin-agx"
    assert back["checkpoint_sha256"] == sha and back["cache_key"] == trt.cache_key(sha, plan["build_profile"], ORIN)
    assert back["engine_quantization"] == {"quant_algo": "W4A16_GPTQ", "group_size": 64}
    assert back["score_engine"] == "score" and (back["end_id"], back["pad_id"]) == (2, 2)
    # the API generation that built it, and the TensorRT-LLM versions that have it
    assert (back["api"], back["api_tensorrt_llm_range"]) == ("tensorrt-engine", ">=0.12.0,<1.3.0rc21")
    assert back["build_profile"]["api"] == "tensorrt-engine"


def test_cache_key():
    profile = trt.resolve_profile({})[1].model_dump()
    key = trt.cache_key("a" * 64, profile, ORIN)
    assert key == trt.cache_key("a" * 64, dict(reversed(list(profile.items()))), dict(ORIN))
    assert key == trt.cache_key("a" * 64, profile, {**ORIN, "driver_version": "999.1"})  # engines don't depend on it
    changed = [
        trt.cache_key("b" * 64, profile, ORIN),
        trt.cache_key("a" * 64, {**profile, "tokens_per_block": 128}, ORIN),
        trt.cache_key("a" * 64, {**profile, "max_batch_size": 1}, ORIN),
        trt.cache_key("a" * 64, profile, {**ORIN, "sm": "sm80"}),
        trt.cache_key("a" * 64, profile, {**ORIN, "tensorrt_llm": "0.12.1"}),
        trt.cache_key("a" * 64, profile, {**ORIN, "tensorrt": "10.4.0"}),
        trt.cache_key("a" * 64, profile, {**ORIN, "jetpack": "6.2", "l4t_release": "36.4.3"}),
    ]
    assert len({key, *changed}) == len(changed) + 1


def test_parse_nv_tegra_release():
    text = "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: Fri Sep 13 04:36:44 UTC 2024\n"
    assert trt.parse_nv_tegra_release(text) == "36.4.0"
    assert trt.parse_nv_tegra_release("garbage") is None
    assert trt.device.JETPACK_BY_L4T["36.4.0"] == "6.1"


# ---------------------------------------------------------------------------------------------
# build: environment refusal, pure checks
# ---------------------------------------------------------------------------------------------


def test_build_refuses_on_this_cpu_machine_before_running(ckpts, tmp_path, monkeypatch):
    monkeypatch.setattr(trt.device, "device_fingerprint", lambda: dict(CPU))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    out = tmp_path / "eng"
    with pytest.raises(RuntimeError, match=r"build profile 'orin-agx' needs TensorRT-LLM 0\.12\.0 .*not importable"):
        trt.build(ckpts["awq"], out, {"build_profile": "orin-agx"})
    assert not out.exists() and not out.with_name("eng.work").exists()


@pytest.mark.parametrize("name,device,exc,pattern", [
    ("a100", ORIN, EngineIncompatibleError,
     r"build profile 'a100' targets sm80 with TensorRT-LLM 1\.2\.1; this device is sm87 with 0\.12\.0"),
    ("orin-agx", A100, EngineIncompatibleError, r"build profile 'orin-agx' targets sm87 .*this device is sm80 with 1\.2\.1"),
    ("orin-agx", {**ORIN, "tensorrt_llm": "0.13.0"}, EngineIncompatibleError, r"written for TensorRT-LLM 0\.12\.0 .*this device has 0\.13\.0"),
    ("orin-agx", {**ORIN, "jetpack": "6.2", "l4t_release": "36.4.3"}, EngineIncompatibleError, r"needs JetPack 6\.1; this device runs JetPack 6\.2"),
    ("orin-agx", {**ORIN, "cuda_available": False, "sm": None, "reason": "torch.cuda.is_available() is False"},
     EngineIncompatibleError, r"targets sm87; this host has no CUDA GPU"),
    ("orin-agx", ORIN, RuntimeError, r"convert_checkpoint\.py not found: .*set profile tensorrt_llm_src"),
    ("a100", {**A100, "tensorrt_llm": "1.3.0rc22"}, EngineIncompatibleError,
     r"build profile 'a100' drives API tensorrt-engine \(TensorRT-LLM >=0\.12\.0,<1\.3\.0rc21, pinned 1\.2\.1\); this device has "
     r"TensorRT-LLM 1\.3\.0rc22 \(API pytorch-llm-api\): 1\.3\.0rc21 removed convert_checkpoint\.py, trtllm-build and "
     r"ModelRunnerCpp\. Fix: install TensorRT-LLM 1\.2\.1, or serve the checkpoint with the vllm backend"),
    # same major.minor as the profile, but past the removal: refused for the API, not only the version
    (("a100", {"tensorrt_llm_version": "1.3.0rc20"}), {**A100, "tensorrt_llm": "1.3.0rc21"}, EngineIncompatibleError,
     r"pinned 1\.3\.0rc20\); this device has TensorRT-LLM 1\.3\.0rc21 \(API pytorch-llm-api\)"),
])
def test_build_environment_check(ckpts, tmp_path, name, device, exc, pattern):
    name, overrides = name if isinstance(name, tuple) else (name, {})
    plan = trt.plan_build(ckpts["gptq"], {"build_profile": name, "tensorrt_llm_src": str(tmp_path / "nowhere"), **overrides},
                          tmp_path / "e")
    with pytest.raises(exc, match=pattern):
        trt.check_build_environment(plan, device)


def test_build_environment_accepts_target(ckpts, tmp_path):
    script = tmp_path / "src" / "examples" / "llama" / "convert_checkpoint.py"
    script.parent.mkdir(parents=True)
    script.write_text("")
    plan = trt.plan_build(ckpts["gptq"], {"tensorrt_llm_src": str(tmp_path / "src")}, tmp_path / "e")
    trt.check_build_environment(plan, {**ORIN, "tensorrt_llm": "0.12.0.dev2024"})


def test_check_converted_quantization():
    quant = {"weight_only_precision": "int4_gptq", "group_size": 64}
    trt.check_converted_quantization({"quantization": {"quant_algo": "W4A16_GPTQ", "group_size": 64, "has_zero_point": True,
                                                       "pre_quant_scale": False}}, quant)
    with pytest.raises(RuntimeError, match=r"has_zero_point=False"):  # what an HF gptq quantization_config with sym=false makes
        trt.check_converted_quantization({"quantization": {"quant_algo": "W4A16_GPTQ", "group_size": 64, "has_zero_point": False}}, quant)
    with pytest.raises(RuntimeError, match=r"quant_algo='W4A16_AWQ', expected 'W4A16_GPTQ'"):
        trt.check_converted_quantization({"quantization": {"quant_algo": "W4A16_AWQ"}}, quant)
    with pytest.raises(RuntimeError, match=r"group_size=128, expected 64"):
        trt.check_converted_quantization({"quantization": {"quant_algo": "W4A16_GPTQ", "group_size": 128}}, quant)
    trt.check_converted_quantization({"quantization": {"quant_algo": None}}, {"weight_only_precision": None})


def test_check_engine_config():
    bp = trt.resolve_profile({})[1].model_dump()
    ok = {"build_config": {"max_batch_size": 2, "max_input_len": 2048, "max_seq_len": 2560, "gather_context_logits": False,
                           "plugin_config": {"tokens_per_block": 64, "use_paged_context_fmha": True, "remove_input_padding": True}}}
    trt.check_engine_config(ok, bp, gather_context_logits=False)
    bad = json.loads(json.dumps(ok))
    bad["build_config"]["plugin_config"]["tokens_per_block"] = 32
    with pytest.raises(RuntimeError, match=r"plugin_config\.tokens_per_block.*'engine': 32, 'profile': 64"):
        trt.check_engine_config(bad, bp, gather_context_logits=False)
    with pytest.raises(RuntimeError, match=r"gather_context_logits"):
        trt.check_engine_config(ok, bp, gather_context_logits=True)


def test_legacy_hf_config():
    cfg = trt.legacy_hf_config({**LLAMA, "quantization_config": {"quant_method": "compressed-tensors"}}, "float16")
    assert "quantization_config" not in cfg
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None  # TRT-LLM would default to 10000.0
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is True
    scaled = trt.legacy_hf_config({**LLAMA, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "float16")
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0} and scaled["rope_theta"] == 5e5
    old = trt.legacy_hf_config({"rope_theta": 1e4, "torch_dtype": "bfloat16"}, "float16")
    assert old == {"rope_theta": 1e4, "torch_dtype": "bfloat16", "rope_scaling": None}


def test_special_token_ids(tmp_path):
    d = _ckpt(tmp_path, "t")
    assert trt.special_token_ids(d) == (2, 2)
    (d / "generation_config.json").unlink()
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<|endoftext|>"},
                                                                   {"id": 2, "content": "<|im_end|>"}], "model": {"vocab": {}}}))
    assert trt.special_token_ids(d) == (2, 2)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert trt.special_token_ids(d) == (0, 0)


# ---------------------------------------------------------------------------------------------
# staging: the converter must see exactly the checkpoint's integers (tensors packed by compressed-tensors)
# ---------------------------------------------------------------------------------------------


def _ct_pack_to_int32():
    """compressed-tensors' own pack_to_int32, loaded from its file alone (the package import pulls in transformers)."""
    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compressed-tensors is not installed")
    path = Path(spec.submodule_search_locations[0]) / "compressors" / "pack_quantized" / "helpers.py"
    helpers = importlib.util.module_from_spec(importlib.util.spec_from_file_location("_ct_pack_helpers", path))
    helpers.__spec__.loader.exec_module(helpers)
    return helpers.pack_to_int32


def _weights_ckpt(root: Path, name: str, weights: dict, seed: int = 0, zp_zero: bool = False) -> tuple[Path, dict]:
    """A 1-layer compressed-tensors checkpoint packed with compressed-tensors' own pack_to_int32; returns (dir, truth)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    pack_to_int32 = _ct_pack_to_int32()

    rng = np.random.default_rng(seed)
    bits, gs = weights["num_bits"], weights["group_size"]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    shapes = {"self_attn.q_proj": (128, HIDDEN), "self_attn.k_proj": (64, HIDDEN), "self_attn.v_proj": (64, HIDDEN),
              "self_attn.o_proj": (HIDDEN, 128), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    tensors = {"model.embed_tokens.weight": torch.tensor(rng.normal(size=(32, HIDDEN)), dtype=torch.float32),
               "model.norm.weight": torch.ones(HIDDEN), "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN)}
    truth = {}
    for lin, (n_out, n_in) in shapes.items():
        p = f"model.layers.0.{lin}"
        groups = n_in // gs if weights["strategy"] == "group" else 1
        q = rng.integers(lo, hi + 1, size=(n_out, n_in))
        scale = rng.uniform(1e-3, 2e-2, size=(n_out, groups)).astype(np.float32)
        tensors[f"{p}.weight_packed"] = pack_to_int32(torch.tensor(q, dtype=torch.int8), bits)
        tensors[f"{p}.weight_scale"] = torch.tensor(scale)
        tensors[f"{p}.weight_shape"] = torch.tensor([n_out, n_in])
        zp = np.zeros((n_out, groups), dtype=np.int64)
        if not weights["symmetric"]:
            zp = rng.integers(lo + 1, hi + 1, size=(n_out, groups))
            if zp_zero:
                zp[0, 0] = lo  # unsigned zero point 0
            tensors[f"{p}.weight_zero_point"] = pack_to_int32(torch.tensor(zp, dtype=torch.int8), bits, packed_dim=0).contiguous()
        truth[p] = (q, zp, scale)
    d = _ckpt(root, name, _qc({"group_0": (["Linear"], weights)}))
    save_file(tensors, str(d / "model.safetensors"))
    return d, truth


def _trt_dequant(staged: dict, prefix: str, bits: int, gs: int) -> np.ndarray:
    """Dequantize as TensorRT-LLM's GPTQ loader does (postprocess_weight_only_groupwise / load_weights_from_gptq)."""
    qw, qz, sc = staged[f"{prefix}.qweight"], staged[f"{prefix}.qzeros"], staged[f"{prefix}.scales"].astype(np.float32)
    if bits == 4:
        q = unpack_int32_le(np.ascontiguousarray(qw.T), 4).T.astype(np.int64) - 8  # unpack(qweight.T).T - 8
        z = unpack_int32_le(qz, 4).astype(np.int64)
        zeros = (-z + 8 - 1) * sc
    else:
        q = np.ascontiguousarray(qw.T).view(np.uint8).T.astype(np.int64) - 128  # qweight.T.view(uint8).T - 128
        z = qz.view(np.uint8).astype(np.int64)
        zeros = (-z + 128 - 1) * sc
    return (q * np.repeat(sc, gs, 0) + np.repeat(zeros, gs, 0)).T


@pytest.mark.parametrize("weights,profile", [
    (W4_ASYM, {}),
    (W4_SYM, {}),
    (W8_CHANNEL, {"build_profile": "a100"}),
])
def test_staging_is_exact_for_tensorrt_llm_gptq_loader(tmp_path, weights, profile):
    ckpt, truth = _weights_ckpt(tmp_path, "q", weights)
    plan = trt.plan_build(ckpt, profile, tmp_path / "eng")
    quant = plan["quantization"]
    staging = tmp_path / "staging"
    stats = trt.stage_checkpoint(ckpt, staging, quant, "float16")
    staged = load_tensors(staging)
    for prefix, (q, zp, scale) in truth.items():
        reps = q.shape[1] // scale.shape[1]
        scale16 = scale.astype(np.float16).astype(np.float32)  # the engine dtype's scales
        want = (q - np.repeat(zp, reps, 1)) * np.repeat(scale16, reps, 1)
        got = _trt_dequant(staged, prefix, weights["num_bits"], quant["group_size"])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=prefix)
        assert staged[f"{prefix}.scales"].dtype == np.float16
    assert np.array_equal(staged["lm_head.weight"], staged["model.embed_tokens.weight"])  # tied head written out
    cfg = json.loads((staging / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["rope_theta"] == 100000.0
    assert stats["lm_head_written"] is True and (staging / "tokenizer_config.json").exists()


def test_staging_dequantized_int8_for_requantizing_converter(tmp_path):
    ckpt, truth = _weights_ckpt(tmp_path, "w8", W8_CHANNEL)
    plan = trt.plan_build(ckpt, {"build_profile": "orin-agx"}, tmp_path / "eng")
    trt.stage_checkpoint(ckpt, tmp_path / "staging", plan["quantization"], "float16")
    staged = load_tensors(tmp_path / "staging")
    for prefix, (q, _, scale) in truth.items():
        np.testing.assert_array_equal(staged[f"{prefix}.weight"], (q * scale).astype(np.float32))
        assert f"{prefix}.weight_packed" not in staged


def test_staging_rejects_zero_point_zero(tmp_path):
    ckpt, _ = _weights_ckpt(tmp_path, "z", W4_ASYM, zp_zero=True)
    plan = trt.plan_build(ckpt, {}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"unsigned zero point 0"):
        trt.stage_checkpoint(ckpt, tmp_path / "staging", plan["quantization"], "float16")


# ---------------------------------------------------------------------------------------------
# runtime logic against a fake executor (API shape of tensorrt_llm.bindings.executor)
# ---------------------------------------------------------------------------------------------


class _Result:
    def __init__(self, tokens, final, context_logits=None):
        self.output_token_ids, self.is_final, self.context_logits = [tokens], final, context_logits


class _Response:
    def __init__(self, result):
        self.result, self.error_msg = result, ""

    def has_error(self):
        return False


class _FakeExecutor:
    """Streams `script` (lists of tokens per step) for each request; records requests and cancellations."""

    def __init__(self, script, context_logits=None):
        self.script, self.context_logits, self.requests, self.cancelled = script, context_logits, [], []

    def enqueue_request(self, request):
        self.requests.append(request)
        request.steps = list(self.script) if request.streaming else [sum(self.script, [])]
        return len(self.requests)

    def await_responses(self, request_id):
        req = self.requests[request_id - 1]
        tokens = req.steps.pop(0)
        return [_Response(_Result(tokens, not req.steps, self.context_logits if not req.steps else None))]

    def cancel_request(self, request_id):
        self.cancelled.append(request_id)


@pytest.fixture
def fake_bindings(monkeypatch):
    mod = types.ModuleType("tensorrt_llm.bindings.executor")

    class Request:
        def __init__(self, input_token_ids, max_tokens, *, streaming=False, sampling_config=None, output_config=None,
                     end_id=None, pad_id=None, stop_words=None):
            self.input_token_ids, self.max_tokens, self.streaming = input_token_ids, max_tokens, streaming
            self.sampling_config, self.output_config = sampling_config, output_config
            self.end_id, self.pad_id, self.stop_words = end_id, pad_id, stop_words

    mod.Request = Request
    mod.SamplingConfig = lambda **kw: kw
    mod.OutputConfig = lambda **kw: kw
    pkg, bindings = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.bindings")
    pkg.bindings, bindings.executor = bindings, mod
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", mod)
    return mod


def _session(executor, **kw) -> trt.TrtLlmSession:
    runner = types.SimpleNamespace(executor=executor)
    meta = {"score_engine": ".", "build_profile": {}}
    return trt.TrtLlmSession(engine_dir=Path("."), meta=meta, runner=runner, runtime="cpp", end_id=2, pad_id=2,
                             vocab_size=kw.get("vocab", 32), max_input_len=16, max_seq_len=24)


def test_generate_streams_and_stops_before_stop_token(fake_bindings):
    ex = _FakeExecutor([[5], [6], [7, 9], [2], [8]])
    s = _session(ex)
    assert list(trt.generate(s, [1, 4], 10, [2, 9])) == [5, 6, 7]
    req = ex.requests[0]
    assert (req.streaming, req.max_tokens, req.end_id, req.pad_id, req.stop_words) == (True, 10, 2, 2, [[9]])
    assert req.sampling_config == {"beam_width": 1, "top_k": 1} and req.input_token_ids == [1, 4]
    assert ex.cancelled == [1]  # the rest of the request is cancelled
    ex2 = _FakeExecutor([[5], [6]])
    assert list(trt.generate(_session(ex2), [1], 2, [])) == [5, 6] and ex2.cancelled == []
    assert ex2.requests[0].end_id == 2 and ex2.requests[0].stop_words is None
    ex3 = _FakeExecutor([[5], [6], [7]])
    stream = trt.generate(_session(ex3), [1], 3, [2])
    assert next(stream) == 5
    stream.close()  # client went away
    assert ex3.cancelled == [1]


def test_sampling_goes_to_the_runtime_sampler(fake_bindings):
    from edgeflow.engines.sampling import SamplingParams

    ex = _FakeExecutor([[5], [6]])
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, frequency_penalty=0.5, repetition_penalty=1.1)
    assert list(trt.generate(_session(ex), [1], 2, [], p)) == [5, 6]
    assert ex.requests[0].sampling_config == {"beam_width": 1, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3,
                                              "repetition_penalty": 1.1, "frequency_penalty": 0.5}
    # the v0.12.0-jetson runtime spells the seed random_seed (and, being pybind11, rejects unknown keywords)
    def jetson_config(*, beam_width=1, temperature=None, top_k=None, top_p=None, random_seed=None):
        return {k: v for k, v in dict(beam_width=beam_width, temperature=temperature, top_k=top_k, top_p=top_p,
                                      random_seed=random_seed).items() if v is not None}

    fake_bindings.SamplingConfig = jetson_config
    ex2 = _FakeExecutor([[5]])
    list(trt.generate(_session(ex2), [1], 1, [], SamplingParams(temperature=1.0, seed=9)))
    assert ex2.requests[0].sampling_config == {"beam_width": 1, "temperature": 1.0, "random_seed": 9}
    # greedy stays top_k=1 even with a seed; logprobs are not offered (the server answers 400)
    assert trt.sampling_kwargs(SamplingParams(seed=4)) == {"top_k": 1, "seed": 4}
    assert "logprobs" not in trt.sampling_support() and "temperature" in trt.sampling_support()


def test_generate_checks_lengths(fake_bindings):
    s = _session(_FakeExecutor([[5]]))
    assert list(trt.generate(s, [1], 0, [2])) == []
    with pytest.raises(ValueError, match="input_ids is empty"):
        list(trt.generate(s, [], 4, [2]))
    with pytest.raises(ValueError, match=r"17 input tokens exceed the engine's max_input_len=16"):
        list(trt.generate(s, [1] * 17, 4, [2]))
    with pytest.raises(ValueError, match=r"exceed the engine's max_seq_len=24"):
        list(trt.generate(s, [1] * 16, 9, [2]))


def test_score_returns_context_logits(fake_bindings):
    logits = np.arange(4 * 32, dtype=np.float16).reshape(4, 32)
    ex = _FakeExecutor([[7]], context_logits=logits)
    out = trt.score(_session(ex), [1, 2, 3, 4])
    assert out.dtype == np.float32 and out.shape == (4, 32)
    np.testing.assert_array_equal(out, logits.astype(np.float32))
    assert ex.requests[0].output_config == {"return_context_logits": True} and ex.requests[0].streaming is False
    off = _session(ex)
    off.meta["score_engine"] = None
    with pytest.raises(RuntimeError, match=r"gather_context_logits=off"):
        trt.score(off, [1, 2])


# ---------------------------------------------------------------------------------------------
# the real thing (needs CUDA + TensorRT-LLM + a checkpoint)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_build_load_generate(tmp_path):
    """Build, load, generate and score on the target GPU: $EDGEFLOW_TEST_TRTLLM_CHECKPOINT (dense or llm-compressor)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("tensorrt_llm is not installed (builds run on the target: Jetson AGX Orin or an A100 host)")
    device = trt.device_fingerprint()
    if not device["cuda_available"]:
        pytest.skip(f"no CUDA device: {device['reason']}")
    ckpt = os.environ.get("EDGEFLOW_TEST_TRTLLM_CHECKPOINT") or os.environ.get("EDGEFLOW_TEST_TEACHER")
    if not ckpt or not Path(ckpt, "config.json").exists():
        pytest.skip("set $EDGEFLOW_TEST_TRTLLM_CHECKPOINT to a Llama checkpoint directory")
    by_sm = {"sm87": "orin-agx", "sm80": "a100"}
    if device["sm"] not in by_sm:
        pytest.skip(f"no build profile for {device['sm']}")
    out = tmp_path / "engine"
    meta = trt.build(Path(ckpt), out, {"build_profile": by_sm[device["sm"]]})
    assert meta["sm"] == device["sm"] and (out / "engine.json").exists()
    trt.check_compatible(out)
    session = trt.load(out)
    prompt = [1, 9690, 42, 314]
    tokens = list(trt.generate(session, prompt, 16, [session.end_id]))
    assert 0 < len(tokens) <= 16 and session.end_id not in tokens
    logits = trt.score(session, prompt + tokens)
    assert logits.shape == (len(prompt) + len(tokens), session.vocab_size) and np.isfinite(logits).all()
    # greedy consistency: the engine's own next-token choices are the argmax of its teacher-forced logits
    agree = np.mean(logits[len(prompt) - 1:-1].argmax(-1) == np.array(tokens))
    assert agree >= 0.9, agree
