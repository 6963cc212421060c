"""edgeflow.ops.envcheck: every branch of decide() on made-up fingerprints, and the real CLI on this machine."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from edgeflow.engines import cpu_native
from edgeflow.engines.cpu_host import cpu_flags
from edgeflow.ops.envcheck import TARGET_ENV, decide
from edgeflow.paths import REPO_ROOT
from tests.helpers.require import HARDWARE

AVX2_HOST = {"cpu_model": "AMD EPYC 7B13", "isa": ["avx", "avx2", "f16c", "fma", "sse4_2"], "cores": 2, "os": "linux", "arch": "x86_64"}
NO_GPU = {"cuda_available": False, "sm": None, "device_name": None, "driver_version": None, "cuda_version": None,
          "tensorrt": None, "l4t_release": None, "jetpack": None, "reason": "no nvidia-smi answer and no torch to query CUDA"}
A100 = NO_GPU | {"cuda_available": True, "sm": "sm80", "device_name": "NVIDIA A100-SXM4-80GB", "driver_version": "580.65",
                 "cuda_version": "12.8", "reason": None}
ORIN_JP61 = A100 | {"sm": "sm87", "device_name": "Orin", "cuda_version": "12.6", "tensorrt": "10.3.0",
                    "l4t_release": "36.4.0", "jetpack": "6.1"}
ORIN_JP72 = ORIN_JP61 | {"cuda_version": "13.0", "tensorrt": "10.13.3", "l4t_release": "38.4.0", "jetpack": "7.2"}
VERSIONS = {"python": "3.11.14", "torch": "2.13.0", "torch_cuda": "12.8", "tensorrt_llm": None, "tensorrt": None,
            "edge_llm": None}


def fp(cpu=AVX2_HOST, gpu=NO_GPU, cc="/usr/bin/cc", **versions):
    return {"cpu": copy.deepcopy(cpu), "gpu": copy.deepcopy(gpu), "cc": cc, "versions": VERSIONS | versions}


def fields(verdict) -> list[str]:
    return [p.field for p in verdict.problems]


# ---- cpu -------------------------------------------------------------------------------------------

def test_cpu_passes_on_an_avx2_host_without_a_gpu():
    v = decide("cpu", fp(torch=None, torch_cuda=None))
    assert v.ok and v.problems == []


def test_cpu_refuses_a_cpu_without_the_isa_cpu_native_needs_naming_it_and_the_fix():
    v = decide("cpu", fp(cpu=AVX2_HOST | {"isa": ["avx", "sse4_2"], "cpu_model": "Intel Xeon E5-2670"}))
    assert not v.ok and fields(v) == ["cpu.isa"]
    msg = v.problems[0].message("cpu")
    assert "Intel Xeon E5-2670" in msg and "avx2" in msg and "fma" in msg and "f16c" in msg
    assert cpu_native.FIX in msg  # cpu_native's own advice: the onnxruntime backend


@pytest.mark.parametrize("flag", cpu_native.REQUIRED_ISA)
def test_cpu_isa_check_is_cpu_natives_list(flag):
    isa = [f for f in AVX2_HOST["isa"] if f != flag]
    assert fields(decide("cpu", fp(cpu=AVX2_HOST | {"isa": isa}))) == ["cpu.isa"]


def test_cpu_refuses_without_a_c_compiler():
    v = decide("cpu", fp(cc=None))
    assert fields(v) == ["cc"] and "gcc" in v.problems[0].fix


def test_cpu_refuses_an_arm_host():
    v = decide("cpu", fp(cpu=AVX2_HOST | {"arch": "aarch64", "isa": ["asimd"]}))
    assert fields(v) == ["cpu.arch"] and "jetson" in v.problems[0].fix


# ---- a100 ------------------------------------------------------------------------------------------

def test_a100_passes_on_sm80_and_newer():
    assert decide("a100", fp(gpu=A100)).ok
    assert decide("a100", fp(gpu=A100 | {"sm": "sm90", "device_name": "NVIDIA H200"})).ok


def test_a100_refuses_no_cuda_naming_the_reason():
    v = decide("a100", fp())
    assert fields(v) == ["gpu.cuda_available"]
    assert "no CUDA" in v.problems[0].found and NO_GPU["reason"] in v.problems[0].found


@pytest.mark.parametrize("sm", ["sm75", "sm70", None])
def test_a100_refuses_an_sm_below_80(sm):
    v = decide("a100", fp(gpu=A100 | {"sm": sm, "device_name": "Tesla T4"}))
    assert fields(v) == ["gpu.sm"] and "sm80" in v.problems[0].expected


def test_a100_refuses_a_jetson_even_though_orin_is_sm87():
    v = decide("a100", fp(gpu=ORIN_JP61))
    assert fields(v) == ["gpu.l4t_release"] and "jetson image" in v.problems[0].fix


def test_a100_refuses_a_cpu_only_torch_or_none():
    assert fields(decide("a100", fp(gpu=A100, torch="2.13.0+cpu", torch_cuda=None))) == ["versions.torch_cuda"]
    assert fields(decide("a100", fp(gpu=A100, torch=None, torch_cuda=None))) == ["versions.torch"]


# ---- jetson ----------------------------------------------------------------------------------------

def test_jp6_passes_on_orin_jetpack_61_with_trtllm_012():
    v = decide("jetson-jp6", fp(gpu=ORIN_JP61, tensorrt_llm="0.12.0", tensorrt="10.3.0"))
    assert v.ok and v.notes == []


def test_jp6_accepts_another_r36_release_with_a_note():
    v = decide("jetson-jp6", fp(gpu=ORIN_JP61 | {"l4t_release": "36.4.3", "jetpack": "6.2"}, tensorrt_llm="0.12.0", tensorrt="10.3.0"))
    assert v.ok and "6.2" in v.notes[0]


def test_jp6_refuses_an_l4t_that_is_not_r36():
    v = decide("jetson-jp6", fp(gpu=ORIN_JP72, tensorrt_llm="0.12.0", tensorrt="10.3.0"))
    assert fields(v) == ["gpu.l4t_release"]
    assert "r36" in v.problems[0].expected and "38.4.0" in v.problems[0].found and "jetson-jp7" in v.problems[0].fix


def test_jp6_refuses_a_wrong_trtllm_or_no_tensorrt():
    assert fields(decide("jetson-jp6", fp(gpu=ORIN_JP61, tensorrt_llm="1.2.1", tensorrt="10.3.0"))) == ["versions.tensorrt_llm"]
    assert fields(decide("jetson-jp6", fp(gpu=ORIN_JP61, tensorrt_llm="0.12.0"))) == ["versions.tensorrt"]


def test_jetson_targets_refuse_a_non_jetson():
    for target in ("jetson-jp6", "jetson-jp7"):
        v = decide(target, fp(gpu=A100, tensorrt_llm="0.12.0", tensorrt="10.3.0", edge_llm="0.10.0"))
        assert fields(v) == ["gpu.l4t_release"], target


def test_jetson_refuses_without_the_gpu_or_on_another_sm():
    no_gpu = ORIN_JP61 | {"cuda_available": False, "sm": None, "reason": "torch.cuda.is_available() is False"}
    v = decide("jetson-jp6", fp(gpu=no_gpu, tensorrt_llm="0.12.0", tensorrt="10.3.0"))
    assert fields(v) == ["gpu.cuda_available"] and "--runtime nvidia" in v.problems[0].fix
    thor = ORIN_JP72 | {"sm": "sm110", "device_name": "Thor"}
    assert fields(decide("jetson-jp7", fp(gpu=thor, edge_llm="0.10.0"))) == ["gpu.sm"]


def test_jp7_passes_on_jetpack_72_with_edge_llm():
    assert decide("jetson-jp7", fp(gpu=ORIN_JP72, edge_llm="0.10.0")).ok


@pytest.mark.parametrize("l4t,jetpack", [("36.4.0", "6.1"), ("38.2.0", "7.0"), ("38.9.0", None)])
def test_jp7_refuses_another_jetpack(l4t, jetpack):
    v = decide("jetson-jp7", fp(gpu=ORIN_JP72 | {"l4t_release": l4t, "jetpack": jetpack}, edge_llm="0.10.0"))
    assert fields(v) == ["gpu.jetpack"] and v.problems[0].expected == "7.2"
    assert (jetpack is None) == ("does not map" in v.problems[0].found)


def test_jp7_refuses_without_edge_llm():
    assert fields(decide("jetson-jp7", fp(gpu=ORIN_JP72))) == ["versions.edge_llm"]


def test_unknown_target_names_the_choices():
    with pytest.raises(ValueError, match="jetson-jp6"):
        decide("orin", fp())


# ---- the real CLI on this machine ------------------------------------------------------------------

def _cli(*args, env_target=None):
    env = {k: v for k, v in os.environ.items() if k != TARGET_ENV} | ({TARGET_ENV: env_target} if env_target else {})
    return subprocess.run([sys.executable, "-m", "edgeflow.ops.envcheck", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason=HARDWARE + "this machine lacks AVX2/FMA/F16C")
def test_cli_cpu_target_passes_here_and_a100_refuses_naming_no_cuda():
    cpu = _cli("--json", env_target="cpu")  # the target from the environment, as the images set it
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    out = json.loads(cpu.stdout)
    assert out["ok"] and out["target"] == "cpu" and "avx2" in out["fingerprint"]["cpu"]["isa"]
    assert out["fingerprint"]["versions"]["python"].startswith("3.")

    a100 = _cli("--target", "a100")
    assert a100.returncode == 1
    assert "REFUSED" in a100.stdout and "no CUDA" in a100.stdout and "Fix:" in a100.stdout


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason=HARDWARE + "this machine lacks AVX2/FMA/F16C")
def test_cli_exec_runs_the_command_only_after_a_pass():
    ran = _cli("--target", "cpu", "--exec", "--", sys.executable, "-c", "print('worker started')")
    assert ran.returncode == 0 and ran.stdout.strip() == "worker started"  # the report went to stderr
    refused = _cli("--target", "a100", "--exec", "--", sys.executable, "-c", "print('worker started')")
    assert refused.returncode == 1 and "worker started" not in refused.stdout


def test_cli_without_a_target_is_a_usage_error():
    r = _cli()
    assert r.returncode == 2 and TARGET_ENV in r.stderr
