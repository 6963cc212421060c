"""`edgeflow estimate`: the estimate of a model on a device from the command line, its objectives, and what bad input
gets (exit 2, naming the argument)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.model_configs import GEMMA2_9B, SMOLLM2_135M


def estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli.main", "estimate", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def models(tmp_path):
    out = {}
    for name, config in (("smollm2", SMOLLM2_135M), ("gemma2-9b", GEMMA2_9B)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        out[name] = tmp_path / name
    return out


def test_an_objective_no_engine_can_meet_is_named_with_its_figure_and_exit_1(models):
    r = estimate("--model", str(models["gemma2-9b"]), "--bits", "4", "--device", "orin-nano-8gb", "--runtime", "tensorrt_llm",
                 "--prompt", "512", "--decode-tok-s", "20")
    assert r.returncode == 1, r.stderr
    assert "Gemma 2, 9,241.7 M parameters, 4-bit weights in groups of 128" in r.stdout
    assert "cannot meet: decode 10." in r.stdout and "< 20 tok/s per stream at concurrency 1 (bound by memory" in r.stdout
    ok = estimate("--model", str(models["gemma2-9b"]), "--bits", "4", "--device", "agx-orin-64gb", "--runtime",
                  "tensorrt_llm", "--prompt", "512", "--decode-tok-s", "20")
    assert ok.returncode == 0 and "cannot meet" not in ok.stdout


def test_json_carries_the_counts_the_limits_and_the_fitted_runtime(models):
    r = estimate("--model", str(models["smollm2"] / "config.json"), "--bits", "4", "--group", "64", "--device",
                 "agx-orin-64gb", "--runtime", "edge_llm", "--concurrency", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["per_token"]["layer_bytes"] == 56_472_192  # tests/estimate/test_counts.py's hand count
    assert out["limits"]["bandwidth_gb_s"] == 204.8 and out["runtime"]["bandwidth"] == 0.73
    est = out["estimate"]
    assert est["decode_tok_s"] == pytest.approx(0.73 * est["decode_roofline_tok_s"], rel=1e-6)
    assert out["misses"] == []


def test_an_x86_host_is_probed_not_looked_up(models):
    r = estimate("--model", str(models["smollm2"]), "--bits", "4", "--group", "64", "--device", "x86-cpu", "--runtime",
                 "cpu_native", "--json")
    assert r.returncode == 0, r.stderr
    limits = json.loads(r.stdout)["limits"]
    assert limits["source"].startswith("probed on this host: ") and limits["bandwidth_gb_s"] > 0
    assert limits["memory_gb"] is None


@pytest.mark.parametrize("args, says", [
    (["--device", "orin-nano-4gb"], "--device: unknown device 'orin-nano-4gb'; known devices: agx-orin-64gb"),
    (["--runtime", "tgi"], "unknown runtime 'tgi'; known runtimes: tensorrt_llm"),
    (["--bits", "5"], "--bits: Input should be 4, 8, 16 or 32"),
    (["--max-memory-mb", "9000"], "max_memory_mb: 9000 MB is above the 8 GB orin-nano-8gb has"),
    (["--prompt", "8000"], "--prompt 8000 + --new-tokens 256 is over the model's context of 8192 tokens"),
])
def test_bad_input_is_exit_2_naming_the_argument(models, args, says):
    base = {"--model": str(models["gemma2-9b"]), "--bits": "4", "--device": "orin-nano-8gb", "--runtime": "tensorrt_llm"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    r = estimate(*[x for kv in base.items() for x in kv])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr


def test_a_model_the_description_cannot_count_is_refused(models, tmp_path):
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text(json.dumps(SMOLLM2_135M | {"model_type": "mamba"}))
    r = estimate("--model", str(tmp_path / "mamba"), "--bits", "4", "--device", "a100-80gb", "--runtime", "vllm")
    assert r.returncode == 2 and "mamba" in r.stderr
    r = estimate("--model", str(tmp_path / "nowhere"), "--bits", "4", "--device", "a100-80gb", "--runtime", "vllm")
    assert r.returncode == 2 and "no config.json there" in r.stderr
