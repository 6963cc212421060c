"""CPU tests of the TensorRT Edge-LLM engine backend (edgeflow/engines/edge_llm/), up to the hardware boundary.

Checkpoints are written by hand (config.json, tokenizer files, and for the conversion tests a few tensors
packed by compressed-tensors' own pack_to_int32). The real exporter (tensorrt-edgellm 0.11.0, its own venv) runs in
tests/engines/test_edge_llm_export.py, which holds every exported weight to ours; what needs the Orin (llm_build, the
runtime) is exercised here through its command lines and the pure compatibility decisions, and
`test_device_build_load_generate` does the real thing on a JetPack 7.2 Orin.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeflow.engines import API, EngineIncompatibleError, get_backend, validate_profile
from edgeflow.engines import edge_llm as el
from edgeflow.engines.checkpoint import InexactWeights, layer, load_tensors, WeightScheme
from tests.helpers.require import skip_for_hardware

REPO = Path(__file__).resolve().parents[2]

HIDDEN, INTER = 128, 256  # multiples of Edge-LLM's int4 group size 128
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 1, "vocab_size": 32,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "dtype": "float32", "eos_token_id": 2,
}
W4_SYM_128 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "actorder": None}
W4_ASYM_128 = {**W4_SYM_128, "symmetric": False}
W4_ASYM_64 = {**W4_ASYM_128, "group_size": 64}
W8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None, "actorder": "static"}


def _qc(groups: dict, **extra) -> dict:
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
           "config_groups": {name: {"targets": t, "weights": w, "input_activations": None, "output_activations": None,
                                    "format": "pack-quantized"} for name, (t, w) in groups.items()}}
    cfg.update(extra)
    return cfg


def _ckpt(root: Path, name: str, qc: dict | None = None, **config) -> Path:
    d = root / name
    d.mkdir(parents=True)
    cfg = {**LLAMA, **config}
    if qc is not None:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 2}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return d


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ---------------------------------------------------------------------------------------------
# module surface and profile
# ---------------------------------------------------------------------------------------------


def test_import_needs_no_gpu_runtime():
    code = ("import sys, edgeflow.engines.edge_llm as m; "
            "bad = [n for n in ('tensorrt', 'torch', 'tensorrt_edgellm', 'tokenizers') if n in sys.modules]; "
            "assert not bad, bad; print(m.BACKEND)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "edge_llm"


def test_backend_contract_and_profile_file():
    assert get_backend("edge_llm") is el
    for name in API:
        assert callable(getattr(el, name)) or name == "Profile", name
    assert el.available_build_profiles() == ["orin-jp7"]  # tensorrt_llm's YAML profiles are not offered here
    bp = el.load_build_profile("orin-jp7")
    assert (bp["target"], bp["jetpack"], bp["edge_llm_version"], bp["cuda_version"]) == ("sm87", "7.2", "0.11.0", "13.2")
    assert bp["inexact_weights"] == "error" and bp["l4t_release"] is None


def test_profile_validation_names_the_field():
    validate_profile("edge_llm", {"phase": "export", "max_batch_size": 1})
    with pytest.raises(ValueError, match=r"max_kv_cache_capacity=1024 must exceed max_input_len=2048"):
        validate_profile("edge_llm", {"max_kv_cache_capacity": 1024})
    with pytest.raises(ValueError, match=r"build_profile='orin-agx' is not an Edge-LLM build profile; choose one of \['orin-jp7'\]"):
        validate_profile("edge_llm", {"build_profile": "orin-agx"})
    with pytest.raises(ValueError, match=r"phase='both'"):
        validate_profile("edge_llm", {"phase": "both"})
    with pytest.raises(ValueError, match=r"unknown edge_llm engine profile keys \['max_seq_len'\]"):
        validate_profile("edge_llm", {"max_seq_len": 4096})
    with pytest.raises(ValueError, match=r"dtype"):
        validate_profile("edge_llm", {"dtype": "bfloat16"})


# ---------------------------------------------------------------------------------------------
# plans: phases and command lines
# ---------------------------------------------------------------------------------------------


def _export_dir(root: Path, version: str = "0.11.0", precision: str = "fp16") -> Path:
    """An export directory as the export phase leaves it (engine.json stage export + onnx/llm files)."""
    d = root / "export"
    (d / "onnx" / "llm").mkdir(parents=True)
    for f in ("model.onnx", "config.json", "embedding.safetensors"):
        (d / "onnx" / "llm" / f).write_text("{}")
    meta = {"backend": "edge_llm", "stage": "export", "api_generation": el.API_GENERATION, "precision": precision,
            "edge_llm_exporter": version, "checkpoint_sha256": "ab" * 32, "files": ["onnx/llm/model.onnx"],
            "quantization": {"precision": precision}, "commands": {"export": ["x"]}, "build_profile": {"target": "sm87"}}
    (d / "engine.json").write_text(json.dumps(meta))
    return d


def test_export_phase_command_line(tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path, "dense")
    out = tmp_path / "out"
    monkeypatch.delenv("EDGEFLOW_EDGELLM_PYTHON", raising=False)  # unset: the exporter runs in this interpreter
    plan = el.plan_build(ckpt, {}, out)
    assert plan["phase"] == "export" and plan["commands"]["build"] is None
    staging = str(tmp_path / "out.work" / "staging")
    assert plan["commands"]["export"] == [
        sys.executable, "-m", "tensorrt_edgellm.scripts.export", staging, str(out / "onnx"),
        "--dtype", "float16", "--int4-gemm-plugin-version", "2",
    ]
    assert plan["paths"]["llm_onnx"] == str(out / "onnx" / "llm")
    assert plan["quantization"]["precision"] == "fp16" and plan["quantization"]["exact"] is True
    legacy = el.plan_build(ckpt, {"int4_gemm_plugin_version": 1}, out)
    assert _flag(legacy["commands"]["export"], "--int4-gemm-plugin-version") == "1"
    # the exporter's own venv (`make edgellm-venv`), named by EDGEFLOW_EDGELLM_PYTHON, runs it instead
    monkeypatch.setenv("EDGEFLOW_EDGELLM_PYTHON", "/opt/edgellm-venv/bin/python")
    assert el.plan_build(ckpt, {}, out)["commands"]["export"][:3] == [
        "/opt/edgellm-venv/bin/python", "-m", "tensorrt_edgellm.scripts.export"]


def test_engine_phase_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGEFLOW_EDGELLM_SRC", raising=False)
    export = _export_dir(tmp_path)
    plan = el.plan_build(export, {}, tmp_path / "eng")
    assert plan["phase"] == "engine" and plan["commands"]["export"] is None
    assert plan["commands"]["build"] == [
        "/opt/TensorRT-Edge-LLM/build/examples/llm/llm_build",
        "--onnxDir", str(export / "onnx" / "llm"), "--engineDir", str(tmp_path / "eng"),
        "--maxBatchSize", "2", "--maxInputLen", "2048", "--maxKVCacheCapacity", "2560",
    ]
    monkeypatch.setenv("EDGEFLOW_EDGELLM_SRC", "/srv/edge")
    other = el.plan_build(export, {"edge_llm_src": "/x/edge", "max_batch_size": 1}, tmp_path / "eng")
    assert other["commands"]["build"][0] == "/x/edge/build/examples/llm/llm_build"
    assert _flag(other["commands"]["build"], "--maxBatchSize") == "1"
    assert el.plan_build(export, {}, tmp_path / "eng")["commands"]["build"][0].startswith("/srv/edge/")


def test_phase_decisions(tmp_path):
    ckpt, export = _ckpt(tmp_path, "dense"), _export_dir(tmp_path)
    with pytest.raises(ValueError, match=r"phase='engine' needs an Edge-LLM export directory"):
        el.plan_build(ckpt, {"phase": "engine"}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"phase='export' but .* is already an Edge-LLM export"):
        el.plan_build(export, {"phase": "export"}, tmp_path / "eng")
    old = _export_dir(tmp_path / "old", version="0.9.1")
    with pytest.raises(ValueError, match=r"exported with Edge-LLM 0\.9\.1; .* edge_llm_version=0\.11\.0"):
        el.plan_build(old, {}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"max_kv_cache_capacity=2560 exceeds the model's max_position_embeddings=2048"):
        el.plan_build(_ckpt(tmp_path, "short", max_position_embeddings=2048), {}, tmp_path / "eng")
    with pytest.raises(ValueError, match=r"Gemma 2 family \(model_type 'gemma2'\) cannot run on engine.backend=edge_llm: TensorRT Edge-LLM supports no Gemma 2"):
        el.plan_build(_ckpt(tmp_path, "gemma", model_type="gemma2", architectures=["Gemma2ForCausalLM"]), {}, tmp_path / "e")


@pytest.mark.parametrize("family", [
    {},  # Llama
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},  # Llama 3.2
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},  # q/k/v biases: the family's own
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
])
def test_the_families_edge_llm_supports_plan_an_export(tmp_path, family):
    """Edge-LLM's exporter reads the staged Hugging Face checkpoint and picks the family itself: Llama 3.x, Qwen2/2.5
    and Qwen3 (its supported-models.md) plan the same export command."""
    plan = el.plan_build(_ckpt(tmp_path, "m", _qc({"g": (["Linear"], W4_SYM_128)}), **family), {}, tmp_path / "out")
    assert plan["phase"] == "export" and plan["commands"]["export"][3:5] == [str(tmp_path / "out.work" / "staging"),
                                                                             str(tmp_path / "out" / "onnx")]
    assert plan["quantization"]["staging"] == "gptq_int4"


@pytest.mark.parametrize("family, message", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"TensorRT Edge-LLM supports no Mistral"),
    ({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "query_pre_attn_scalar": 64},
     r"TensorRT Edge-LLM supports no Gemma 3"),
    ({"attention_bias": True}, r"Llama with attention_bias/mlp_bias: engine.backend=edge_llm converts the family's own "
                               r"layers only"),
])
def test_families_edge_llm_lacks_are_refused_naming_the_backends_that_run_them(tmp_path, family, message):
    with pytest.raises(ValueError, match=message + r".*backends that run it: cpu_native"):
        el.plan_build(_ckpt(tmp_path, "m", **family), {}, tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# which schemes have an exact Edge-LLM form
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights,symmetric", [(W4_SYM_128, True), (W4_ASYM_128, False)])
def test_w4a16_group128_is_int4_gptq(tmp_path, weights, symmetric):
    plan = el.plan_build(_ckpt(tmp_path, "q", _qc({"g": (["Linear"], weights)})), {}, tmp_path / "out")
    q = plan["quantization"]
    assert (q["staging"], q["precision"], q["exporter_quant_type"], q["group_size"]) == ("gptq_int4", "int4_gptq", "int4_gptq", 128)
    assert q["scheme"]["symmetric"] is symmetric and "[-8, 7]" in q["why"]


@pytest.mark.parametrize("weights,field", [
    (W4_ASYM_64, r"weights\.group_size=64: .*group size 128 only"),
    (W8_CHANNEL, r"weights: num_bits=8"),
    ({**W4_SYM_128, "actorder": "group"}, r"weights\.actorder='group'"),
])
def test_refuses_inexact_schemes_naming_the_field(tmp_path, weights, field):
    ckpt = _ckpt(tmp_path, "q", _qc({"group_0": (["Linear"], weights)}))
    with pytest.raises(InexactWeights, match=rf"config_groups\.group_0\.{field}.*inexact_weights: dequantize"):
        el.plan_build(ckpt, {}, tmp_path / "out")
    plan = el.plan_build(ckpt, {"inexact_weights": "dequantize"}, tmp_path / "out")
    q = plan["quantization"]
    assert (q["staging"], q["precision"], q["exact"]) == ("dequantized", "fp16", False) and "group_0" in q["dequantized"]


def test_refuses_mixed_w8_w4_and_activation_quantization(tmp_path):
    mixed = _ckpt(tmp_path, "mixed", _qc({"attn": (["re:.*self_attn.*"], W8_CHANNEL), "mlp": (["re:.*mlp.*"], W4_SYM_128)}))
    with pytest.raises(InexactWeights, match=r"config_groups\.attn\.weights: num_bits=8"):
        el.plan_build(mixed, {}, tmp_path / "out")
    act = _qc({"g": (["Linear"], W4_SYM_128)})
    act["config_groups"]["g"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match=r"config_groups\.g: activation quantization is set"):
        el.plan_build(_ckpt(tmp_path, "w4a8", act), {"inexact_weights": "dequantize"}, tmp_path / "out")
    with pytest.raises(ValueError, match=r"kv_cache_scheme"):
        el.plan_build(_ckpt(tmp_path, "kv", _qc({"g": (["Linear"], W4_SYM_128)}, kv_cache_scheme={"num_bits": 8})),
                      {}, tmp_path / "out")
    with pytest.raises(InexactWeights, match=r"hidden_size/intermediate_size \[192\] are not multiples"):
        el.plan_build(_ckpt(tmp_path, "odd", _qc({"g": (["Linear"], W4_SYM_128)}), hidden_size=192), {}, tmp_path / "o")


# ---------------------------------------------------------------------------------------------
# conversion: bit-exact against the exporter's formulas
# ---------------------------------------------------------------------------------------------


def _ct_pack_to_int32():
    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("compressed-tensors is not installed")
    path = Path(spec.submodule_search_locations[0]) / "compressors" / "pack_quantized" / "helpers.py"
    helpers = importlib.util.module_from_spec(importlib.util.spec_from_file_location("_ct_pack_helpers_el", path))
    helpers.__spec__.loader.exec_module(helpers)
    return helpers.pack_to_int32


def _weights_ckpt(root: Path, name: str, weights: dict, seed: int = 0, centred: bool = True, zp_zero: bool = False) -> Path:
    """A 1-layer compressed-tensors checkpoint packed by compressed-tensors itself (signed q, signed zero point)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    pack = _ct_pack_to_int32()
    rng = np.random.default_rng(seed)
    gs = weights["group_size"]
    shapes = {"self_attn.q_proj": (128, HIDDEN), "self_attn.k_proj": (64, HIDDEN), "self_attn.v_proj": (64, HIDDEN),
              "self_attn.o_proj": (HIDDEN, 128), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    tensors = {"model.embed_tokens.weight": torch.tensor(rng.normal(size=(32, HIDDEN)), dtype=torch.float32),
               "model.norm.weight": torch.ones(HIDDEN), "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(HIDDEN)}
    for lin, (n_out, n_in) in shapes.items():
        p = f"model.layers.0.{lin}"
        groups = n_in // gs
        zp = np.zeros((n_out, groups), dtype=np.int64)
        if not weights["symmetric"]:
            zp = rng.integers(-3, 4, size=(n_out, groups))
            if zp_zero:
                zp[0, 0] = -8  # unsigned zero point 0
        # signed q in [-8, 7]; centred: q - zp stays in [-8, 7] as Edge-LLM's kernel needs
        q = rng.integers(-8, 8, size=(n_out, n_in))
        if centred and not weights["symmetric"]:
            q = np.clip(np.repeat(zp, gs, 1) + rng.integers(-8, 8, size=(n_out, n_in)), -8, 7)
        scale = rng.uniform(1e-3, 2e-2, size=(n_out, groups)).astype(np.float32)
        tensors[f"{p}.weight_packed"] = pack(torch.tensor(q, dtype=torch.int8), 4)
        tensors[f"{p}.weight_scale"] = torch.tensor(scale)
        tensors[f"{p}.weight_shape"] = torch.tensor([n_out, n_in])
        if not weights["symmetric"]:
            tensors[f"{p}.weight_zero_point"] = pack(torch.tensor(zp, dtype=torch.int8), 4, packed_dim=0).contiguous()
    d = _ckpt(root, name, _qc({"group_0": (["Linear"], weights)}))
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_asymmetric_groups_the_kernel_would_clamp_are_refused(tmp_path):
    off = _weights_ckpt(tmp_path, "off", W4_ASYM_128, centred=False)
    plan = el.plan_build(off, {}, tmp_path / "out")
    with pytest.raises(InexactWeights, match=r"q - zero outside \[-8, 7\].*clamps q - zero \+ 8 to \[0, 15\]"):
        el.stage_checkpoint(off, tmp_path / "staging", plan["quantization"])
    assert not (tmp_path / "staging" / "model.safetensors").exists()
    zp0 = _weights_ckpt(tmp_path, "zp0", W4_ASYM_128, zp_zero=True)
    with pytest.raises(InexactWeights, match=r"unsigned zero point 0"):
        el.stage_checkpoint(zp0, tmp_path / "staging", el.plan_build(zp0, {}, tmp_path / "out")["quantization"])
    # what the refusal protects against: the exporter's clamp changes such weights
    q = np.array([[15, 0]], dtype=np.uint8)
    got = el.edge_llm_dequantize(q, np.array([[4]], dtype=np.uint8), np.array([[1.0]], dtype=np.float32), 2)
    np.testing.assert_array_equal(got, [[7.0, -4.0]])  # truth: 11, -4


def test_dequantized_staging_is_exact_in_float16(tmp_path):
    ckpt = _weights_ckpt(tmp_path, "g64", W4_ASYM_64)
    plan = el.plan_build(ckpt, {"inexact_weights": "dequantize"}, tmp_path / "out")
    el.stage_checkpoint(ckpt, tmp_path / "staging", plan["quantization"])
    staged, source = load_tensors(tmp_path / "staging"), load_tensors(ckpt)
    scheme = WeightScheme(bits=4, strategy="group", group_size=64, symmetric=False, format="pack-quantized")
    q = layer(source, "model.layers.0.mlp.down_proj", scheme)
    want = ((q.q.astype(np.float32) - np.repeat(q.zero, 64, 1)) * np.repeat(q.scale, 64, 1)).astype(np.float16)
    assert staged["model.layers.0.mlp.down_proj.weight"].dtype == np.float16
    np.testing.assert_array_equal(staged["model.layers.0.mlp.down_proj.weight"], want)
    assert "quantization_config" not in json.loads((tmp_path / "staging" / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# compatibility
# ---------------------------------------------------------------------------------------------

ORIN_72 = {"cuda_available": True, "sm": "sm87", "device_name": "Orin", "tensorrt": "10.16.1.11", "l4t_release": "39.2.0",
           "jetpack": "7.2", "cuda_version": "13.2", "edge_llm": "0.11.0", "reason": None}
X86 = {"cuda_available": False, "sm": None, "tensorrt": None, "l4t_release": None, "jetpack": None,
       "edge_llm": "0.11.0", "reason": "no nvidia-smi answer and no torch to query CUDA"}
ORIN_61 = {**ORIN_72, "l4t_release": "36.4.0", "jetpack": "6.1", "tensorrt": "10.3.0", "cuda_version": "12.6"}


def _engine_meta(**kw) -> dict:
    return {"backend": "edge_llm", "stage": "engine", "api_generation": el.API_GENERATION, "sm": "sm87",
            "tensorrt": "10.16.1.11", "edge_llm": "0.11.0", "l4t_release": "39.2.0", "jetpack": "7.2", **kw}


def test_compare_decisions():
    el.compare(_engine_meta(), ORIN_72)  # the device that built it
    cases = [
        (X86, r"engine built for sm87 on JetPack 7\.2 \(L4T 39\.2\.0\).*this device has no CUDA GPU \(no nvidia-smi"),
        (ORIN_61, r"this device runs JetPack 6\.1 \(L4T 36\.4\.0\).*flash JetPack 7\.2"),
        ({**ORIN_72, "tensorrt": "10.13.3"}, r"TensorRT 10\.16\.1\.11.*has TensorRT 10\.13\.3.*only deserializes"),
        ({**ORIN_72, "sm": "sm110", "device_name": "Thor"}, r"this device is sm110 \(Thor\)"),
        ({**ORIN_72, "edge_llm": "0.10.0"}, r"Edge-LLM 0\.11\.0; this device has Edge-LLM 0\.10\.0.*install Edge-LLM 0\.11\.0"),
        ({**ORIN_72, "edge_llm": None}, r"this device has no Edge-LLM"),
    ]
    for device, message in cases:
        with pytest.raises(EngineIncompatibleError, match=message):
            el.compare(_engine_meta(), device)
    with pytest.raises(EngineIncompatibleError, match=r"an Edge-LLM export .*not an engine.*'phase': 'engine'"):
        el.compare(_engine_meta(stage="export"), ORIN_72)
    with pytest.raises(EngineIncompatibleError, match=r"engine backend is 'tensorrt_llm'"):
        el.compare(_engine_meta(backend="tensorrt_llm"), ORIN_72)
    with pytest.raises(EngineIncompatibleError, match=r"layout generation 0"):
        el.compare(_engine_meta(api_generation=0), ORIN_72)


def test_engine_build_refused_off_target(tmp_path):
    plan = el.plan_build(_export_dir(tmp_path), {"edge_llm_src": str(tmp_path / "src")}, tmp_path / "eng")
    with pytest.raises(EngineIncompatibleError, match=r"targets sm87 on JetPack 7\.2; this host is no CUDA GPU on JetPack \? \(L4T none\)"):
        el.check_build_environment(plan, X86)
    with pytest.raises(EngineIncompatibleError, match=r"targets sm87 on JetPack 7\.2; this host is sm87 on JetPack 6\.1 \(L4T 36\.4\.0\)"):
        el.check_build_environment(plan, ORIN_61)
    with pytest.raises(EngineIncompatibleError, match=r"L4T 39\.2\.0, whose JetPack .*JETPACK_BY_L4T does not know.*set l4t_release: 39\.2\.0"):
        el.check_build_environment(plan, {**ORIN_72, "jetpack": None})
    with pytest.raises(RuntimeError, match=r"llm_build not found|llm_build is a CMake build output"):
        el.check_build_environment(plan, ORIN_72)  # right device, no Edge-LLM build here
    pinned = el.plan_build(_export_dir(tmp_path / "p"), {"l4t_release": "39.2.0", "tensorrt_version": "10.16"}, tmp_path / "e")
    with pytest.raises(EngineIncompatibleError, match=r"needs TensorRT 10\.16; .* has TensorRT 10\.13\.3"):
        el.check_build_environment(pinned, {**ORIN_72, "jetpack": None, "tensorrt": "10.13.3"})
    with pytest.raises(RuntimeError, match=r"builds with Edge-LLM 0\.11\.0; this device has 0\.9\.1"):
        el.check_build_environment(pinned, {**ORIN_72, "edge_llm": "0.9.1"})


def test_export_environment_and_versions(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGEFLOW_EDGELLM_PYTHON", raising=False)
    plan = el.plan_build(_ckpt(tmp_path, "dense"), {}, tmp_path / "out")
    el.check_export_environment(plan, {"edge_llm": "0.11.0"})
    with pytest.raises(RuntimeError, match=r"tensorrt-edgellm is not installed for .*Fix: `make edgellm-venv`.*EDGEFLOW_EDGELLM_PYTHON"):
        el.check_export_environment(plan, {"edge_llm": None})
    with pytest.raises(RuntimeError, match=r"this host has 0\.10\.0"):
        el.check_export_environment(plan, {"edge_llm": "0.10.0"})
    assert el.parse_version_file('"""x"""\n\n__version__ = "0.10.0"\n') == "0.10.0"
    assert el.parse_version_file('__version__: str = "0.6.1"\n') == "0.6.1"
    assert el.edge_llm_version(tmp_path / "nowhere") is None or importlib.util.find_spec("tensorrt_edgellm")
    # an export host: the release its exporter's venv has, asked of that interpreter
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.11.0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("EDGEFLOW_EDGELLM_PYTHON", str(fake))
    assert el.edge_llm_version(tmp_path / "nowhere") == "0.11.0" and el.exporter_version(str(fake)) == "0.11.0"
    assert el.exporter_version(str(tmp_path / "no-such-python")) is None


def test_output_checks():
    bp = el.load_build_profile("orin-jp7")
    el.check_engine_config({"builder_config": {"max_batch_size": 2, "max_input_len": 2048, "max_kv_cache_capacity": 2560}}, bp)
    with pytest.raises(RuntimeError, match=r"max_kv_cache_capacity.*'engine': 4096, 'profile': 2560"):
        el.check_engine_config({"builder_config": {"max_batch_size": 2, "max_input_len": 2048, "max_kv_cache_capacity": 4096}}, bp)
    plan = {"build_profile": bp}
    el.check_export_config({"edgellm_version": "0.11.0", "vocab_size": 32}, plan, {"vocab_size": 32})
    with pytest.raises(RuntimeError, match=r"edgellm_version"):
        el.check_export_config({"edgellm_version": "0.9.1", "vocab_size": 32}, plan, {"vocab_size": 32})


# ---------------------------------------------------------------------------------------------
# runtime up to the hardware boundary
# ---------------------------------------------------------------------------------------------


def test_load_on_this_cpu_machine_refuses_with_the_compatibility_message(tmp_path):
    eng = tmp_path / "eng"
    eng.mkdir()
    for f in el.ENGINE_FILES:
        (eng / f).write_text("{}")
    (eng / "engine.json").write_text(json.dumps({**_engine_meta(), "precision": "int4_gptq",
                                                 "checkpoint_sha256": "ab" * 32, "files": list(el.ENGINE_FILES)}))
    device = el.device_fingerprint()
    if device["cuda_available"]:
        skip_for_hardware("this machine has a CUDA GPU")
    with pytest.raises(EngineIncompatibleError, match=r"engine built for sm87 .*this device has no CUDA GPU"):
        el.load(eng)
    (eng / "llm.engine").unlink()
    with pytest.raises(EngineIncompatibleError, match=r"engine files missing: \['llm.engine'\]"):
        el.load(eng)
    export = _export_dir(tmp_path / "x")
    with pytest.raises(EngineIncompatibleError, match=r"an Edge-LLM export"):
        el.load(export)


def test_score_and_sampling_mapping():
    from edgeflow.engines.sampling import SamplingParams

    with pytest.raises(EngineIncompatibleError, match=r"returns no logits.*top-50.*consistency gate .* generated tokens"):
        el.score(None, [1, 2, 3])
    assert el.sampling_support() == {"temperature", "top_p", "top_k"}
    assert el.sampler_fields(None, 49152) == {"temperature": 0.0, "top_k": 1, "top_p": 1.0}
    assert el.sampler_fields(SamplingParams(seed=3), 49152) == {"temperature": 0.0, "top_k": 1, "top_p": 1.0}
    assert el.sampler_fields(SamplingParams(temperature=0.7), 49152) == {"temperature": 0.7, "top_k": 49152, "top_p": 1.0}
    assert el.sampler_fields(SamplingParams(temperature=0.7, top_p=0.9), 10) == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    assert el.sampler_fields(SamplingParams(temperature=1.0, top_k=40), 10) == {"temperature": 1.0, "top_k": 40, "top_p": 1.0}


def test_prompt_text_round_trip():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert el.prompt_text(tok, [0, 1, 0]) == "hello world hello"
    with pytest.raises(ValueError, match=r"do not survive decode -> encode .* position 1: \[0\] -> \[2, 2, 0\]"):
        el.prompt_text(tok, [2, 0])


def test_special_token_ids(tmp_path):
    d = _ckpt(tmp_path, "tok")
    assert el.special_token_ids(d) == (2, 2)


# ---------------------------------------------------------------------------------------------
# the real thing (a JetPack 7.2 Orin with Edge-LLM built; an export made on the export host)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_build_load_generate(tmp_path):
    """Build, load and generate on the target: $EDGEFLOW_TEST_EDGELLM_EXPORT (an export directory)."""
    export = os.environ.get("EDGEFLOW_TEST_EDGELLM_EXPORT")
    if not export or not Path(export, "engine.json").exists():
        pytest.skip("set $EDGEFLOW_TEST_EDGELLM_EXPORT to an Edge-LLM export directory (made by build() on the export host)")
    device = el.device_fingerprint()
    if device["sm"] != "sm87":
        pytest.skip(f"not a Jetson Orin: {device['sm'] or device['reason']}")
    out = tmp_path / "engine"
    meta = el.build(Path(export), out, {"phase": "engine"})
    assert meta["stage"] == "engine" and meta["sm"] == "sm87"
    el.check_compatible(out)
    session = el.load(out)
    tokens = list(el.generate(session, [1, 9690, 42, 314], 16, [session.end_id]))
    assert 0 < len(tokens) <= 16 and session.end_id not in tokens
