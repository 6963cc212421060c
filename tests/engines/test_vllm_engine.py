"""CPU tests of the vllm engine backend (edgeflow/engines/vllm_engine/), up to the hardware boundary.

Checkpoints are real llm-compressor outputs: a tiny Llama quantized by `oneshot` with the config groups of the
shipped recipes (deployments/recipes/*.yaml; round-to-nearest instead of GPTQ/AWQ, which writes the same
format). Build, refusals, compatibility decisions, the sampling mapping and the prompt-logprob -> dense
conversion run here; what needs a GPU and vLLM (AsyncLLM) runs in `test_gpu_build_load_generate_score`.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import API, EngineIncompatibleError, get_backend, validate_profile
from edgeflow.engines import engine_dir as edir
from edgeflow.engines import vllm_engine as vl
from edgeflow.engines.sampling import PARAMETERS, SamplingParams, Token
from edgeflow.evaluation.metrics import log_softmax
from tests.helpers.require import skip_for_hardware

REPO = Path(__file__).resolve().parents[2]
VOCAB = 256
RECIPES = {"w4a16_asym": "rtn-w4a16-asym", "w4a16_sym": "gptq-w4a16-sym", "w8a16": "gptq-w8a16-sym",
           "mixed": "mixed-w8attn-w4mlp", "actorder_weight": "gptq-w4a16-sym-actorder"}


@pytest.fixture(scope="session", autouse=True)
def _export_teacher() -> None:
    """These tests need no teacher: override the engines-wide autouse fixture of tests/conftest.py."""


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """dense: a 1-layer Llama (hidden 128, vocab 256) with tokenizer files; the others: llm-compressor quantized it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("llmcompressor")
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("vllm_ckpt")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(root / "dense")
    (root / "dense" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (root / "dense" / "chat_template.jinja").write_text("{{ messages }}")

    class _Lazy(dict):
        def __missing__(self, name: str) -> Path:
            from llmcompressor import oneshot
            from llmcompressor.modifiers.quantization import QuantizationModifier

            modifiers = yaml.safe_load((REPO / f"deployments/recipes/{RECIPES[name]}.yaml").read_text())["quant_stage"]["quant_modifiers"]
            groups = next(m["config_groups"] for m in modifiers.values() if m and "config_groups" in m)
            model = LlamaForCausalLM.from_pretrained(root / "dense", dtype=torch.float32)
            oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]),
                    output_dir=str(root / name), save_compressed=True)
            for f in ("tokenizer_config.json", "chat_template.jinja"):
                shutil.copy2(root / "dense" / f, root / name / f)
            self[name] = root / name
            return self[name]

    return _Lazy(dense=root / "dense")


def _edit(ckpt: Path, dst: Path, group: str | None = "group_0", weights: dict | None = None, **config) -> Path:
    """A copy of `ckpt` with config.json edited: a config group's weights, its format, or top-level keys."""
    shutil.copytree(ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if weights is not None:
        g = cfg["quantization_config"]["config_groups"][group]
        fmt = weights.pop("format", None)
        g["weights"].update(weights)
        if fmt:
            g["format"] = fmt
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---------------------------------------------------------------------------------------------
# module surface and profile
# ---------------------------------------------------------------------------------------------


def test_import_and_build_need_no_gpu_runtime():
    code = ("import sys, edgeflow.engines.vllm_engine as m; "
            "bad = [n for n in ('vllm', 'torch') if n in sys.modules]; assert not bad, bad; print(m.BACKEND)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "vllm"
    assert get_backend("vllm") is vl and all(callable(getattr(vl, n)) for n in API)


def test_profile_defaults():
    p = validate_profile("vllm", {}).model_dump()
    assert p == {"vllm_version": vl.VLLM_VERSION, "dtype": "float16", "max_model_len": None, "gpu_memory_utilization": 0.14,
                 "max_num_seqs": 64, "enforce_eager": False, "tensor_parallel_size": 1, "min_sm": "sm80",
                 "max_logprobs": -1, "require_marlin": True}
    assert validate_profile("vllm", {"dtype": "bfloat16", "min_sm": "sm90"}).dtype == "bfloat16"


@pytest.mark.parametrize("profile,pattern", [
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1\.5: must be in \(0, 1\].*e\.g\. 0\.14"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization=0: must be in \(0, 1\]"),
    ({"min_sm": "sm70"}, r"min_sm='sm70': is below sm75, the oldest GPU vLLM 0\.34\.0 runs .*set 'sm80'"),
    ({"min_sm": "ampere"}, r"min_sm='ampere': is not an architecture like 'sm80'"),
    ({"dtype": "bfloat16", "min_sm": "sm75"}, r"dtype='bfloat16' needs sm80 or newer but min_sm='sm75'; set min_sm='sm80'"),
    ({"dtype": "float32"}, r"dtype='float32': Input should be 'float16' or 'bfloat16'"),
    ({"max_logprobs": 5}, r"max_logprobs=5: must be -1 \(no cap, what `score` needs\) or at least 20.*set -1"),
    ({"max_num_seqs": 0}, r"max_num_seqs=0: must be at least 1"),
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0: must be at least 1"),
    ({"max_model_len": 8}, r"max_model_len=8: is below 16 tokens"),
    ({"vllm_version": "latest"}, r"vllm_version='latest': is not a vLLM release .*'0\.34\.0'"),
    ({"max_num_seq": 4}, r"unknown vllm engine profile keys \['max_num_seq'\]"),
])
def test_bad_profiles_name_field_value_limit_and_fix(profile, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_profile("vllm", profile)


# ---------------------------------------------------------------------------------------------
# build: the engine directory and engine.json
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,precision,groups", [
    ("w4a16_asym", "int4", {"group_0": (4, 64, False, "uint4")}),
    ("w4a16_sym", "int4", {"group_0": (4, 64, True, "uint4b8")}),
    ("w8a16", "int8", {"group_0": (8, None, True, "uint8b128")}),
    ("mixed", "int8+int4", {"group_0": (8, None, True, "uint8b128"), "group_1": (4, 64, True, "uint4b8")}),
    ("actorder_weight", "int4", {"group_0": (4, 64, True, "uint4b8")}),
    ("dense", "float16", None),
])
def test_build_writes_the_engine_dir(checkpoints, tmp_path, monkeypatch, name, precision, groups):
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(CPU))
    ckpt, out = checkpoints[name], tmp_path / "eng"
    meta = vl.build(ckpt, out, {})
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json", "chat_template.jinja",
         "engine.json"])
    for f in ("config.json", "model.safetensors"):  # the checkpoint's own bytes, hard-linked on one filesystem
        assert os.path.samefile(out / f, ckpt / f)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    back = edir.check_meta(out, "vllm")  # every listed file present
    assert back.model_dump(mode="json") == meta
    assert (meta["backend"], meta["precision"], meta["files"]) == ("vllm", precision, ["config.json", "model.safetensors"])
    assert meta["format"] == "vllm engine dir v1 (checkpoint as stored; vLLM 0.34.0)"
    assert meta["checkpoint_sha256"] == sha256_tree(ckpt)
    assert sorted(meta["tokenizer_files"]) == ["chat_template.jinja", "generation_config.json", "tokenizer_config.json"]
    assert (meta["vllm_version"], meta["min_sm"], meta["vocab_size"]) == ("0.34.0", "sm80", VOCAB)
    assert meta["build_identity"] == "vllm engine dir v1, vLLM not installed, no CUDA GPU"
    assert meta["profile"] == validate_profile("vllm", {}).model_dump() | {"max_model_len": 512}
    assert meta["engine_args"] == {
        "dtype": "float16", "max_model_len": 512, "gpu_memory_utilization": 0.14, "max_num_seqs": 64, "enforce_eager": False,
        "tensor_parallel_size": 1, "max_logprobs": -1, "logprobs_mode": "raw_logprobs",
        "quantization": None if groups is None else "compressed-tensors", "load_format": "safetensors",
        "skip_tokenizer_init": True, "generation_config": "vllm", "trust_remote_code": False, "disable_log_stats": True}
    assert meta["file_transfer"] == {"config.json": "link", "model.safetensors": "link"}
    assert meta["sampling"]["parameters"] == sorted(PARAMETERS)
    if groups is None:
        assert meta["quantization"] is None
        return
    got = {g: (v["bits"], v["group_size"], v["symmetric"], v["vllm_weight_type"]) for g, v in meta["quantization"]["groups"].items()}
    assert got == groups
    assert {v["kernel"] for v in meta["quantization"]["groups"].values()} == {"Marlin"}
    assert all(v["format"] == "pack-quantized" for v in meta["quantization"]["groups"].values())


def test_rebuild_replaces_stale_weights_and_profile_is_recorded(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(A100))
    out = tmp_path / "eng"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"old shard")  # vLLM would read it: must go
    meta = vl.build(checkpoints["w4a16_sym"], out, {"max_model_len": 256, "dtype": "bfloat16", "max_num_seqs": 8,
                                                    "gpu_memory_utilization": 0.5, "enforce_eager": True})
    assert not (out / "model-00002-of-00002.safetensors").exists()
    args = meta["engine_args"]
    assert (args["max_model_len"], args["dtype"], args["max_num_seqs"], args["gpu_memory_utilization"], args["enforce_eager"]) == (
        256, "bfloat16", 8, 0.5, True)
    assert meta["build_identity"] == "vllm engine dir v1, vLLM not installed, sm80"


def _group(ckpt_name: str) -> str:
    return "group_1" if ckpt_name == "mixed" else "group_0"


@pytest.mark.parametrize("name,weights,profile,pattern", [
    ("w4a16_sym", {"actorder": "group"}, {},
     r"config_groups\.group_0\.weights\.actorder='group': vLLM 0\.34\.0 no longer loads group/dynamic activation ordering"),
    ("w4a16_sym", {"actorder": "dynamic"}, {}, r"config_groups\.group_0\.weights\.actorder='dynamic'"),
    ("w8a16", {"symmetric": False}, {},
     r"config_groups\.group_0\.weights\.symmetric=false with num_bits=8: Marlin runs zero points only for 4-bit weights.*"
     r"require_marlin=false"),
    ("w4a16_sym", {"group_size": 256}, {},
     r"config_groups\.group_0\.weights\.group_size=256: Marlin's group sizes are \[32, 64, 128\]"),
    ("mixed", {"num_bits": 3}, {}, r"config_groups\.group_1\.weights\.num_bits=3: Marlin runs 4- and 8-bit weights only"),
    ("w4a16_sym", {"num_bits": 16}, {"require_marlin": False},
     r"config_groups\.group_0\.weights\.num_bits=16: vLLM's weight-only layers take 2 to 8 bits"),
    ("w4a16_sym", {"format": "int-quantized"}, {},
     r"config_groups\.group_0\.format='int-quantized': vLLM loads integer weight-only layers only from 'pack-quantized'"),
    ("w4a16_sym", {"strategy": "tensor"}, {}, r"config_groups\.group_0\.weights\.strategy='tensor'"),
    ("w4a16_sym", {"type": "float"}, {}, r"config_groups\.group_0\.weights\.type='float'"),
    ("w4a16_sym", {"group_size": None}, {}, r"config_groups\.group_0\.weights\.group_size=None with strategy 'group'"),
])
def test_unsupported_schemes_are_refused_before_any_work(checkpoints, tmp_path, name, weights, profile, pattern):
    bad = _edit(checkpoints[name], tmp_path / "bad", _group(name), weights)
    with pytest.raises(ValueError, match=pattern):
        vl.build(bad, tmp_path / "eng", profile)
    assert not (tmp_path / "eng").exists()


def test_require_marlin_false_accepts_the_fallback_kernels(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(CPU))
    bad = _edit(checkpoints["w8a16"], tmp_path / "asym8", weights={"symmetric": False})
    meta = vl.build(bad, tmp_path / "eng", {"require_marlin": False})
    g = meta["quantization"]["groups"]["group_0"]
    assert g["vllm_weight_type"] == "uint8" and g["kernel"].startswith("not Marlin (weights.symmetric=false with num_bits=8")


@pytest.mark.parametrize("edit,profile,pattern", [
    ({}, {"max_model_len": 1024}, r"max_model_len=1024 exceeds .*max_position_embeddings=512 \(vLLM refuses it\); set max_model_len <= 512"),
    ({}, {"max_logprobs": 100}, r"max_logprobs=100 is below the vocabulary \(256 tokens\).*set max_logprobs=-1"),
    ({}, {"tensor_parallel_size": 4}, r"tensor_parallel_size=4 does not divide .*num_attention_heads=2"),
    ({"architectures": []}, {}, r"architectures is missing"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, {}, r"quant_method='gptq'"),
])
def test_checkpoint_and_profile_mismatches_are_refused(checkpoints, tmp_path, edit, profile, pattern):
    bad = _edit(checkpoints["w4a16_sym"], tmp_path / "bad", weights=None, **edit)
    with pytest.raises(ValueError, match=pattern):
        vl.build(bad, tmp_path / "eng", profile)
    assert not (tmp_path / "eng").exists()


def test_group_straddling_tensor_parallel_ranks_is_refused(checkpoints, tmp_path):
    # down_proj has 256 inputs in groups of 64: 2 ranks hold 128 each (fine); 8 ranks would split a group
    cfg = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}
    ok = _edit(checkpoints["w4a16_sym"], tmp_path / "tp", weights=None, **cfg)
    vl.plan_build(ok, {"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8: model\.layers\.0\.mlp\.down_proj has 256 inputs, 32 per rank, "
                                         r"not a multiple of its group size 64"):
        vl.plan_build(ok, {"tensor_parallel_size": 8})


def test_quantized_config_without_packed_weights_and_missing_weights(checkpoints, tmp_path):
    fake = tmp_path / "fake"
    shutil.copytree(checkpoints["dense"], fake)
    qc = json.loads((checkpoints["w4a16_sym"] / "config.json").read_text())["quantization_config"]
    cfg = json.loads((fake / "config.json").read_text()) | {"quantization_config": qc}
    (fake / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config is set but no \*\.weight_packed tensor is stored"):
        vl.build(fake, tmp_path / "eng", {})
    (fake / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        vl.build(fake, tmp_path / "eng", {})


def test_build_refuses_a_profile_for_another_installed_vllm(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(A100))
    monkeypatch.setattr(vl.device, "dist_version", lambda *names: "0.33.2")
    with pytest.raises(ValueError, match=r"engine\.profile\.vllm_version='0\.34\.0' but this host has vLLM 0\.33\.2.*"
                                         r"set engine\.profile\.vllm_version='0\.33\.2'"):
        vl.build(checkpoints["w4a16_sym"], tmp_path / "eng", {})
    assert not (tmp_path / "eng").exists()
    meta = vl.build(checkpoints["w4a16_sym"], tmp_path / "eng", {"vllm_version": "0.33.2"})
    assert meta["vllm_version"] == "0.33.2" and meta["build_identity"] == "vllm engine dir v1, vLLM 0.33.2, sm80"


# ---------------------------------------------------------------------------------------------
# device compatibility
# ---------------------------------------------------------------------------------------------

A100 = {"cuda_available": True, "sm": "sm80", "device_name": "NVIDIA A100-SXM4-80GB", "driver_version": "580.65.06",
        "cuda_version": "13.0.1", "tensorrt": None, "l4t_release": None, "jetpack": None, "reason": None}
H100 = {**A100, "sm": "sm90", "device_name": "NVIDIA H100 80GB HBM3"}
T4 = {**A100, "sm": "sm75", "device_name": "Tesla T4"}
CPU = {"cuda_available": False, "sm": None, "device_name": None, "driver_version": None, "cuda_version": None,
       "tensorrt": None, "l4t_release": None, "jetpack": None, "reason": "no nvidia-smi answer and no torch to query CUDA"}
META = {"backend": "vllm", "min_sm": "sm80", "vllm_version": "0.34.0", "precision": "int4", "checkpoint_sha256": "0" * 64,
        "files": ["config.json"]}


@pytest.mark.parametrize("device,pattern", [
    ({**CPU, "vllm": None}, r"engine needs a CUDA GPU of sm80 or newer with vLLM 0\.34\.0; this device has no CUDA GPU "
                            r"\(no nvidia-smi answer .*\)\. Fix: load it on an A100 \(sm80\) host with vllm==0\.34\.0"),
    ({**T4, "vllm": "0.34.0"}, r"engine needs a CUDA GPU of sm80 or newer with vLLM 0\.34\.0; this device is sm75 \(Tesla T4\), "
                               r"older than the engine's minimum"),
    ({**A100, "vllm": "0.33.1"}, r"this device \(sm80\) has vLLM 0\.33\.1: major\.minor differ.*Fix: pip install vllm==0\.34\.0"),
    ({**A100, "vllm": "1.34.0"}, r"has vLLM 1\.34\.0: major\.minor differ"),
    ({**A100, "vllm": None}, r"this device \(sm80\) has no vLLM installed .*pip install vllm==0\.34\.0"),
])
def test_compare_refuses_naming_both_sides_and_the_fix(device, pattern):
    with pytest.raises(EngineIncompatibleError, match=pattern):
        vl.compare(META, device)


def test_compare_accepts_sm80_and_sm90_with_the_same_minor_release():
    for device in ({**A100, "vllm": "0.34.0"}, {**H100, "vllm": "0.34.2"}, {**A100, "vllm": "0.34.0+cu130"}):
        vl.compare(META, device)
    vl.compare({**META, "min_sm": "sm75"}, {**T4, "vllm": "0.34.0"})
    with pytest.raises(EngineIncompatibleError, match=r"engine backend is 'cpu'; this backend runs 'vllm' engines"):
        vl.compare({**META, "backend": "cpu"}, {**A100, "vllm": "0.34.0"})


def test_check_compatible_reads_the_engine_and_the_fingerprint(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(CPU))
    eng = tmp_path / "eng"
    vl.build(checkpoints["w4a16_sym"], eng, {})
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(A100))
    monkeypatch.setattr(vl.device, "dist_version", lambda *names: "0.34.1")
    vl.check_compatible(eng)
    assert vl.build_identity() == "vllm engine dir v1, vLLM 0.34.1, sm80"
    monkeypatch.setattr(vl.device, "gpu_fingerprint", lambda: dict(T4))
    with pytest.raises(EngineIncompatibleError, match=r"this device is sm75"):
        vl.check_compatible(eng)
    (eng / "model.safetensors").unlink()
    with pytest.raises(EngineIncompatibleError, match=r"engine files missing: \['model\.safetensors'\]"):
        vl.check_compatible(eng)


def test_load_on_this_cpu_machine_refuses_before_importing_vllm(checkpoints, tmp_path):
    """No monkeypatching: this machine's own fingerprint (no CUDA), and vLLM is not installed here."""
    eng = tmp_path / "eng"
    vl.build(checkpoints["w4a16_sym"], eng, {})
    code = ("import sys; from pathlib import Path; from edgeflow.engines import vllm_engine as v\n"
            "try:\n    v.load(Path(sys.argv[1]))\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(eng)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    fp = vl.device_fingerprint()
    if fp["cuda_available"] and fp["vllm"]:
        skip_for_hardware("this machine has CUDA and vLLM")
    assert lines[0].startswith("EngineIncompatibleError engine needs a CUDA GPU of sm80 or newer with vLLM 0.34.0; "), lines
    assert lines[-1] == "False"


def test_device_hooks_report_nothing_without_a_gpu():
    if vl.device_fingerprint()["cuda_available"]:
        skip_for_hardware("this machine has a GPU")
    assert vl.device_memory_used(object()) is None and vl.device_utilization(object()) is None


# ---------------------------------------------------------------------------------------------
# sampling: edgeflow's parameters -> vllm.SamplingParams
# ---------------------------------------------------------------------------------------------


def test_greedy_mapping():
    base = {"n": 1, "max_tokens": 16, "stop_token_ids": [2, 7], "ignore_eos": True, "detokenize": False,
            "skip_special_tokens": False, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert vl.sampling_kwargs(None, 16, [2, 7]) == base
    assert vl.sampling_kwargs(SamplingParams(), 16, (2, 7)) == base
    # greedy ignores truncation (vLLM drops it too) but keeps penalties, like edgeflow.engines.sampling
    assert vl.sampling_kwargs(SamplingParams(top_p=0.5, top_k=3, repetition_penalty=1.2, seed=5), 16, [2, 7]) == base | {
        "repetition_penalty": 1.2, "seed": 5}


def test_sampled_mapping_with_logprobs():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=(1 << 64) + 3, frequency_penalty=0.5,
                       presence_penalty=-0.25, repetition_penalty=1.1, logprobs=True, top_logprobs=5)
    kw = vl.sampling_kwargs(p, 8, [])
    assert kw == {"n": 1, "max_tokens": 8, "stop_token_ids": [], "ignore_eos": True, "detokenize": False,
                  "skip_special_tokens": False, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1,
                  "presence_penalty": -0.25, "frequency_penalty": 0.5, "seed": 3, "logprobs": 5}
    assert vl.sampling_kwargs(SamplingParams(temperature=1.0, top_k=-1), 8, [])["top_k"] == 0
    assert vl.sampling_kwargs(SamplingParams(logprobs=True), 8, [])["logprobs"] == 0  # the chosen token's only
    assert vl.sampling_kwargs(SamplingParams(seed=(1 << 63) + 9), 8, [])["seed"] == 9  # vLLM holds seeds as int64
    assert vl.sampling_support() == frozenset(PARAMETERS)


# ---------------------------------------------------------------------------------------------
# vLLM's logprob structures (vllm/logprobs.py) -> Tokens and the dense [n, vocab] array
# ---------------------------------------------------------------------------------------------


@dataclass
class Logprob:
    """vllm.logprobs.Logprob's fields."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:
    """vllm.logprobs.FlatLogprobs's fields, filled as its append() does."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: dict[int, Logprob] | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(lp.logprob)
            self.ranks.append(lp.rank)
            self.decoded_tokens.append(lp.decoded_token)
        self.end_indices.append(len(self.logprobs))


def _position(logp: np.ndarray, chosen: int) -> dict[int, Logprob]:
    """One position as vLLM's append_logprobs_for_next_position builds it with num_logprobs=-1: the chosen
    (or prompt) token with its rank first, then every token by rank."""
    order = np.argsort(-logp, kind="stable")
    rank = {int(t): r + 1 for r, t in enumerate(order)}
    entries = {chosen: Logprob(float(logp[chosen]), rank[chosen])}
    entries.update({int(t): Logprob(float(logp[t]), rank[int(t)]) for t in order})
    return entries


def _vllm_score_output(logits: np.ndarray, ids: list[int], flat: bool):
    """(prompt_logprobs, sample logprobs) for a score request, from fp32 logits [n, vocab]: row i predicts ids[i+1]."""
    logp = log_softmax(logits)
    positions = [None] + [_position(logp[i - 1], ids[i]) for i in range(1, len(ids))]
    sample = [_position(logp[-1], int(np.argmax(logp[-1])))]
    if not flat:
        return positions, sample
    prompt, out = FlatLogprobs(), FlatLogprobs()
    for p in positions:
        prompt.append(p)
    out.append(sample[0])
    return prompt, out


@pytest.mark.parametrize("flat", [True, False])
def test_prompt_logprobs_become_the_dense_array(flat):
    rng = np.random.default_rng(0)
    n, vocab = 7, 50
    logits = (rng.normal(size=(n, vocab)) * 3).astype(np.float32)
    ids = [int(t) for t in rng.integers(0, vocab, n)]
    prompt, sample = _vllm_score_output(logits, ids, flat)
    dense = vl.dense_logprobs(prompt, sample, vocab, n)
    assert dense.shape == (n, vocab) and dense.dtype == np.float32
    np.testing.assert_allclose(dense, log_softmax(logits), atol=1e-6)  # logits shifted by a per-row constant
    assert np.array_equal(dense.argmax(-1), logits.argmax(-1))
    np.testing.assert_allclose(log_softmax(dense), log_softmax(logits), atol=1e-6)  # what the gate computes
    shift = logits - dense
    np.testing.assert_allclose(shift, shift[:, :1].repeat(vocab, 1), atol=1e-5)


def test_dense_conversion_refuses_incomplete_or_misaligned_output():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 10)).astype(np.float32)
    prompt, sample = _vllm_score_output(logits, [1, 2, 3, 4], flat=False)
    with pytest.raises(ValueError, match=r"prompt logprobs for 4 positions; the prompt has 5 tokens"):
        vl.dense_logprobs(prompt, sample, 10, 5)
    top5 = [None] + [dict(list(p.items())[:6]) for p in prompt[1:]]  # prompt_logprobs=5: the token + 5 best
    with pytest.raises(ValueError, match=r"row 0: vLLM returned log-probabilities for [56] of 10 tokens.*max_logprobs=-1"):
        vl.dense_logprobs(top5, sample, 10, 4)
    with pytest.raises(ValueError, match=r"entry at position 0"):
        vl.dense_logprobs([prompt[1]] + prompt[1:], sample, 10, 4)
    with pytest.raises(ValueError, match=r"no logprobs for the token after the prompt"):
        vl.dense_logprobs(prompt, [], 10, 4)
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        vl.dense_logprobs(prompt, sample, 8, 4)
    one = vl.dense_logprobs([None], sample, 10, 1)  # a one-token prompt: only the row after it
    np.testing.assert_allclose(one[0], log_softmax(logits)[-1], atol=1e-6)


def test_generated_token_logprobs_become_tokens():
    logp = log_softmax(np.array([0.0, 2.0, 1.0, 2.0, -1.0]))
    pos = _position(logp, 4)  # a sampled token that is not among the best
    tok = vl.to_token(4, dict(list(pos.items())[:4]), 3)  # logprobs=3: the sampled token and the 3 best
    assert isinstance(tok, Token) and tok == 4
    assert tok.logprob == pytest.approx(logp[4])
    assert [t for t, _ in tok.top_logprobs] == [1, 3, 2]  # descending, ties by ascending id
    assert tok.top_logprobs[0][1] == pytest.approx(logp[1])
    assert vl.to_token(1, {1: Logprob(float(logp[1]), 1)}, 0).top_logprobs == ()
    with pytest.raises(ValueError, match=r"no logprobs for token 3"):
        vl.to_token(3, None, 2)


# ---------------------------------------------------------------------------------------------
# generate/score's request handling, against a stand-in with AsyncLLM.generate's contract (an async generator
# of RequestOutputs on the engine's loop; cancelling its task aborts the request)
# ---------------------------------------------------------------------------------------------


class _Engine:
    def __init__(self, steps: list[tuple[list[int], list | None]], final: SimpleNamespace | None = None, hang: bool = True,
                 error: Exception | None = None):
        self.steps, self.final, self.hang, self.error = steps, final, hang, error
        self.requests: list[tuple] = []
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        self.requests.append((prompt, params, request_id))
        try:
            for tokens, logprobs in self.steps:
                await asyncio.sleep(0)
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)], prompt_logprobs=None)
            if self.error:
                raise self.error
            if self.final is not None:
                yield self.final
            elif self.hang:  # the engine would go on decoding until max_tokens (bounded: a broken stop check fails)
                await asyncio.sleep(3)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)


def _session(engine: _Engine, loop, vocab: int = 10) -> vl.VllmSession:
    api = SimpleNamespace(SamplingParams=lambda **kw: kw, TokensPrompt=lambda **kw: kw,
                          RequestOutputKind=SimpleNamespace(DELTA="DELTA", FINAL_ONLY="FINAL_ONLY"))
    return vl.VllmSession(engine_dir=Path("."), meta={}, engine=engine, api=api, loop=loop, vocab_size=vocab, max_model_len=24)


def _eventually(check) -> bool:
    deadline = time.monotonic() + 5
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def test_generate_streams_deltas_and_aborts_at_a_stop_id(loop):
    engine = _Engine([([5], None), ([6, 9], None), ([7], None)])
    assert list(vl.generate(_session(engine, loop), [1, 4], 10, [9])) == [5, 6]
    prompt, params, request_id = engine.requests[0]
    assert prompt == {"prompt_token_ids": [1, 4]}
    assert params == vl.sampling_kwargs(None, 10, [9]) | {"output_kind": "DELTA"}
    assert _eventually(lambda: engine.aborted == [request_id])
    finished = _Engine([([5], None), ([6], None)], hang=False)
    assert list(vl.generate(_session(finished, loop), [1], 2, [])) == [5, 6] and finished.aborted == []
    gone = _Engine([([5], None), ([6], None)])
    stream = vl.generate(_session(gone, loop), [1], 8, [2])
    assert next(stream) == 5
    stream.close()  # the client went away
    assert _eventually(lambda: len(gone.aborted) == 1)


def test_generate_returns_tokens_with_logprobs_and_surfaces_engine_errors(loop):
    logp = log_softmax(np.arange(10, dtype=np.float64))
    engine = _Engine([([9], [_position(logp, 9)]), ([3], [_position(logp, 3)])], hang=False)
    p = SamplingParams(temperature=0.5, seed=2, logprobs=True, top_logprobs=2)
    tokens = list(vl.generate(_session(engine, loop), [1], 2, [], p))
    assert tokens == [9, 3] and [t.logprob for t in tokens] == pytest.approx([logp[9], logp[3]])
    assert [t for t, _ in tokens[1].top_logprobs] == [9, 8]
    assert engine.requests[0][1]["logprobs"] == 2 and engine.requests[0][1]["seed"] == 2
    broken = _Engine([([5], None)], error=RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match=r"vLLM request edgeflow-[0-9a-f]+ failed: RuntimeError: CUDA error"):
        list(vl.generate(_session(broken, loop), [1], 4, []))
    s = _session(_Engine([]), loop)
    assert list(vl.generate(s, [1], 0, [2])) == []
    with pytest.raises(ValueError, match="input_ids is empty"):
        list(vl.generate(s, [], 4, [2]))
    with pytest.raises(ValueError, match=r"20 input \+ 5 new tokens exceed the engine's max_model_len=24"):
        list(vl.generate(s, [1] * 20, 5, [2]))


def test_score_asks_for_full_vocabulary_logprobs_and_densifies_them(loop):
    logits = np.random.default_rng(3).normal(size=(5, 10)).astype(np.float32)
    ids = [1, 7, 2, 2, 5]
    prompt, sample = _vllm_score_output(logits, ids, flat=True)
    final = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[int(logits[-1].argmax())], logprobs=sample)],
                            prompt_logprobs=prompt)
    engine = _Engine([], final=final)
    out = vl.score(_session(engine, loop), ids)
    np.testing.assert_allclose(out, log_softmax(logits), atol=1e-6)
    params = engine.requests[0][1]
    assert params == vl.score_kwargs() | {"output_kind": "FINAL_ONLY"}
    assert (params["prompt_logprobs"], params["logprobs"], params["max_tokens"], params["flat_logprobs"]) == (-1, -1, 1, True)


# ---------------------------------------------------------------------------------------------
# the real thing (needs CUDA + vLLM)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_build_load_generate_score(checkpoints, tmp_path):
    """Build, load, generate and score with vLLM on the GPU: $EDGEFLOW_TEST_VLLM_CHECKPOINT, else the tiny W4A16 one."""
    fp = vl.device_fingerprint()
    if not fp["cuda_available"] or not fp["vllm"]:
        pytest.skip(f"needs a CUDA GPU with vLLM (cuda: {fp['cuda_available']}, vllm: {fp['vllm']})")
    ckpt = Path(os.environ.get("EDGEFLOW_TEST_VLLM_CHECKPOINT") or checkpoints["w4a16_asym"])
    out = tmp_path / "engine"
    vl.build(ckpt, out, {"vllm_version": fp["vllm"], "enforce_eager": True, "max_model_len": 256})
    session = vl.load(out)
    prompt = [1, 9, 42, 31]
    tokens = list(vl.generate(session, prompt, 12, []))
    assert len(tokens) == 12
    logp = vl.score(session, prompt + tokens)
    assert logp.shape == (len(prompt) + len(tokens), session.vocab_size) and np.isfinite(logp).all()
    np.testing.assert_allclose(np.exp(logp.astype(np.float64)).sum(-1), 1.0, atol=1e-3)
    agree = np.mean(logp[len(prompt) - 1:-1].argmax(-1) == np.array(tokens))  # greedy = argmax of its own scores
    assert agree >= 0.9, agree
    sampled = list(vl.generate(session, prompt, 6, [], SamplingParams(temperature=0.8, seed=1, logprobs=True, top_logprobs=3)))
    assert len(sampled) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in sampled)
    assert [int(t) for t in sampled] == [int(t) for t in vl.generate(session, prompt, 6, [], SamplingParams(temperature=0.8, seed=1))]
    used = vl.device_memory_used(session)
    assert used is not None and used > 0
