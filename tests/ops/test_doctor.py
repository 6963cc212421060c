"""edgeflow doctor (edgeflow/ops/doctor, edgeflow/cli/doctor.py), run as a user runs it: the cpu role passes on this
host and writes its report; a GPU role here fails on what is missing (the GPU, the runtime: named with its install
command), skips what needs them, exits 1 and still writes the report; bad input exits 2. The GPU roles' distillation
and engine checks are the same functions, run here on the CPU up to the hardware boundary."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgeflow.ops.doctor import checks
from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile

CPU_CHECKS = ["versions", "device", "dtypes", "backend:cpu_native", "backend:llama_cpp", "model",
              "engine:cpu_native:dense", "engine:cpu_native:int4", "engine:llama_cpp:int4"]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "doctor", *args], cwd=REPO_ROOT,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900)


def test_the_cpu_role_passes_here_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    r = _doctor("--role", "cpu", "--profile", "configs/test-tiny.yaml", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "doctor.json").read_text())
    assert report["role"] == "cpu" and [c["name"] for c in report["checks"]] == CPU_CHECKS
    assert [c["status"] for c in report["checks"]] == ["pass"] * len(CPU_CHECKS), report["checks"]
    numbers = {c["name"]: c["numbers"] for c in report["checks"]}
    assert numbers["versions"]["torch"].startswith("2.13.0") and numbers["versions"]["llama_cpp_python"] == "0.3.36"
    assert numbers["device"]["cpu.cores"] == os.cpu_count() and numbers["device"]["memory_bandwidth_gb_s"] > 0
    assert numbers["dtypes"]["fp32.works"] and numbers["dtypes"]["fp32.max_rel_error"] < 1e-5
    for name in CPU_CHECKS[-3:]:
        e = numbers[name]
        assert e["top1_agreement"] >= checks.MIN_TOP1 and e["logit_correlation_min"] >= checks.MIN_CORRELATION, (name, e)
        assert e["generated_tokens"] == [checks.NEW_TOKENS] * len(checks.PROMPT_LENGTHS), (name, e)
        assert e["decode_tok_s"] > 0 and 0 < e["bandwidth_fraction"], (name, e)
    # int4 weights are ~6x smaller than fp32: what one decoded token reads
    assert numbers["engine:cpu_native:int4"]["engine_mb"] * 4 < numbers["engine:cpu_native:dense"]["engine_mb"]
    md = (out / "doctor.md").read_text()
    assert "9 passed, 0 failed, 0 skipped" in md and "| engine:llama_cpp:int4 | pass |" in md
    assert "9 of 9 checks did not fail" in r.stdout


def test_a_gpu_role_on_a_host_without_a_gpu_fails_naming_what_is_missing_and_still_reports(tmp_path):
    out = tmp_path / "out"
    r = _doctor("--role", "a100", "--profile", "configs/production-a100-orin.yaml", "--out", str(out))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "doctor.json").read_text())
    by = {c["name"]: c for c in report["checks"]}
    assert list(by) == ["versions", "device", "cuda", "dtypes", "backend:tensorrt_llm", "model", "distill", "gptq",
                        "gate-reference", "engine:tensorrt_llm:int4"]
    assert by["versions"]["status"] == by["device"]["status"] == "pass"
    assert by["cuda"]["status"] == "fail"
    assert "role a100 needs a CUDA GPU (sm80 or newer" in by["cuda"]["reason"] and "--role cpu" in by["cuda"]["reason"]
    # the runtime the profile's backend needs: the package and how to install it
    tl = by["backend:tensorrt_llm"]
    assert tl["status"] == "fail" and "tensorrt-llm==1.2.1" in tl["reason"] and "Fix: install TensorRT-LLM" in tl["reason"]
    for name in ("dtypes", "model", "distill", "gptq", "gate-reference", "engine:tensorrt_llm:int4"):
        assert by[name]["status"] == "skip" and "needs the cuda check, which fail" in by[name]["reason"], by[name]
    assert "FAILED cuda: role a100 needs a CUDA GPU" in r.stderr and "FAILED backend:tensorrt_llm" in r.stderr
    assert "| cuda | fail |" in (out / "doctor.md").read_text()


@pytest.mark.parametrize("args, said", [
    (["--role", "tpu"], "argument --role: invalid choice: 'tpu'"),
    (["--profile", "configs/no-such.yaml"], "no-such.yaml"),
    (["--out", "README.md"], "--out README.md is a file; give a directory"),
])
def test_bad_input_exits_2_naming_the_argument(args, said):
    r = _doctor(*args)
    assert r.returncode == 2 and said in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr


@pytest.fixture
def small_host(tmp_path, monkeypatch):
    """A Host with the tiny model at a width that trains in seconds (the same 8 layers, so the same cut)."""
    monkeypatch.setattr(checks, "TINY", checks.TINY | {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16})
    host = checks.Host(role="a100", profile=load_profile(REPO_ROOT / "configs" / "test-tiny.yaml"), work=tmp_path)
    checks.model(host)
    host.results.update(model="pass", **{"backend:cpu_native": "pass"})
    return host


def test_the_gpu_roles_distillation_check_trains_on_this_cpu(small_host):
    """The a100 role's distillation check is the release's run_distill_distributed on whatever device there is: here
    the CPU, where its 20 steps must lower the loss as they would on the GPU."""
    got = checks.distill(small_host)
    assert got["steps"] == checks.DISTILL_STEPS and got["processes"] == 1 and got["device"] == "cpu"
    assert got["last_loss"] < got["first_loss"]


def test_an_engine_that_computes_another_model_fails_naming_its_agreement(small_host, monkeypatch):
    """The engine check compares the engine with transformers on the same weights; logits of another model (seed 1)
    in their place fail it, naming the top-1 agreement and the correlation against their bars."""
    from edgeflow.model.tiny import build_tiny

    other = build_tiny("llama", small_host.work / "other", seed=1, **checks.TINY)
    real = checks._reference_logits
    monkeypatch.setattr(checks, "_reference_logits", lambda checkpoint, seqs: real(other, seqs))
    with pytest.raises(checks.Failed) as e:
        checks.engine(small_host, "cpu_native", "dense")
    msg = str(e.value)
    assert msg.startswith("cpu_native (dense) does not compute the model it was built from") and "needs 95%" in msg, msg
    assert f"needs {checks.MIN_CORRELATION}" in msg and "attach this report" in msg
    monkeypatch.setattr(checks, "_reference_logits", real)
    assert checks.engine(small_host, "cpu_native", "dense")["top1_agreement"] == 1.0  # its own model: agrees


def test_the_gpu_roles_gptq_check_runs_here_and_compares_two_quantizations_code_by_code(small_host):
    """The a100 role's GPTQ check is the quantize stage's quantize() on a device it is given: here the CPU (one run;
    on a GPU host it runs again on the CPU). Its comparison holds two checkpoints code by code: two CPU runs of one
    recipe agree on every code; a checkpoint with codes changed does not, by the share changed."""
    import numpy as np
    from safetensors.numpy import load_file, save_file


    small_host.device = "cpu"
    got = checks.gptq(small_host)
    assert got["compared"].startswith("the role's device is the CPU") and got["cpu.weight_error_mean"] > 0
    again = small_host.work / "gptq-again"
    import shutil

    shutil.copytree(small_host.work / "gptq-cpu", again)
    assert checks.gptq_agreement(small_host.work / "gptq-cpu", again) == (1.0, 0.0)
    f = next(again.glob("*.safetensors"))
    t = load_file(str(f))
    key = next(k for k in t if k.endswith("mlp.down_proj.weight_packed"))
    t[key] = np.bitwise_xor(t[key], np.int32(0x11111111))  # every code of one linear changed
    save_file(t, str(f), metadata={"format": "pt"})
    agreement, _ = checks.gptq_agreement(small_host.work / "gptq-cpu", again)
    # one layer's down_proj (64 x 128 codes) of 8 layers of 36,864 codes each, every one of its codes changed
    assert agreement == pytest.approx(1 - 64 * 128 / (8 * 36_864)), agreement

    # the gate's torch half on the GPTQ checkpoint just made: one run here; two runs of it compared agree everywhere
    small_host.results["gptq"] = "pass"
    ref = checks.gate_reference(small_host)
    assert ref["compared"].startswith("the role's device is the CPU") and ref["sequences"] > 0 and ref["cpu.seconds"] > 0
    from edgeflow.evaluation.reference import compute_reference

    dense = small_host.model["dense"]
    seqs = [[9, 10, 11, 12, 13, 14], [20, 21, 22, 23]]
    one, two = (compute_reference(dense, {"q": small_host.work / "gptq-cpu"}, seqs, seqs[:1], 4, 8, seqs[0], [1])
                for _ in range(2))
    same = checks.compare_references(one, two)
    assert same["argmax_agreement"] == 1.0 and same["greedy_equal"] and same["fakeq_argmax_agreement"] == {"q": 1.0}
    other = compute_reference(again, {"q": again}, seqs, seqs[:1], 4, 8, seqs[0], [1])  # int4 weights as the FP model
    assert checks.compare_references(one, other)["max_abs_target_logp"] > 0

