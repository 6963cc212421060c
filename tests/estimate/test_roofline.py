"""edgeflow/estimate/roofline.py, the device table and the `slo:` section: what a device allows a model, which
objective an estimate misses and by how much, and what bad SLO input gets."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from edgeflow.estimate import limits_for
from edgeflow.estimate.counts import Scheme, token_cost
from edgeflow.estimate.roofline import estimate
from edgeflow.estimate.runtimes import ROOFLINE, runtime_efficiency
from edgeflow.model.architecture import describe
from edgeflow.profile import DEVICES
from edgeflow.profile.slo import SLOConfig, SLOTarget
from tests.helpers.model_configs import GEMMA2_9B

def test_gemma2_9b_int4_cannot_stream_20_tok_s_on_an_orin_nano_whatever_the_engine():
    cost = token_cost(describe(GEMMA2_9B), Scheme(bits=4, group_size=128))
    target = SLOTarget(device="orin-nano-8gb", prompt_tokens=512, concurrency=1, decode_tok_s=20)
    est = estimate(cost, limits_for("orin-nano-8gb"), ROOFLINE, 512, 1, 256)
    # every step reads ~4.7 GB of int4 layers and the 1.8 GB fp16 tied head at 68 GB/s: about 10 tok/s at most
    assert est.decode_bound == "memory"
    assert 9 < est.decode_roofline_tok_s < 11
    assert est.decode_tok_s == est.decode_roofline_tok_s  # the roofline runtime: efficiency 1
    [miss] = est.misses(target)
    assert miss.startswith(f"decode {est.decode_tok_s:.1f} tok/s < 20 tok/s per stream at concurrency 1 (bound by memory")
    # the same model on an AGX Orin (204.8 GB/s) can: three times the bandwidth
    fast = estimate(cost, limits_for("agx-orin-64gb"), ROOFLINE, 512, 1, 256)
    assert fast.decode_roofline_tok_s == pytest.approx(3 * est.decode_roofline_tok_s, rel=0.02)
    assert fast.misses(target.model_copy(update={"device": "agx-orin-64gb"})) == []


def test_concurrency_shares_the_weights_read_but_not_the_kv_caches():
    cost = token_cost(describe(GEMMA2_9B), Scheme(bits=4, group_size=128))
    one = estimate(cost, limits_for("a100-80gb"), ROOFLINE, 512, 1, 256)
    eight = estimate(cost, limits_for("a100-80gb"), ROOFLINE, 512, 8, 256)
    assert eight.step_bytes - one.step_bytes == pytest.approx(7 * cost.kv_read_bytes(512 + 128))
    assert eight.decode_tok_s < one.decode_tok_s  # each stream slower, the step longer
    assert 8 * eight.decode_tok_s > 6 * one.decode_tok_s  # but at 640 tokens of context the weights dominate the step
    assert eight.memory_mb - one.memory_mb == pytest.approx(7 * cost.kv_resident_bytes(512 + 256) / 1e6)
    assert eight.ttft_p99_ms == pytest.approx(8 * one.ttft_p99_ms)  # the last of eight prompts waits for the seven
    # at 4,096 tokens each stream's KV cache (42 layers x 2 x 8 heads x 256 x 2 B = 344 KB a token) outweighs the
    # int4 weights: eight streams read more KV cache than weights, and concurrency buys less
    long8 = estimate(cost, limits_for("a100-80gb"), ROOFLINE, 4096, 8, 256)
    assert 8 * cost.kv_read_bytes(4096 + 128) > cost.step_weight_bytes
    assert long8.decode_tok_s * 8 < eight.decode_tok_s * 8 / 2


def test_a_runtime_below_the_roofline_is_slower_by_its_factors():
    cost = token_cost(describe(GEMMA2_9B), Scheme(bits=4, group_size=128))
    half = ROOFLINE.model_copy(update={"name": "half", "bandwidth": 0.5, "compute": 0.25, "overhead_mb": 300})
    full = estimate(cost, limits_for("agx-orin-64gb"), ROOFLINE, 512, 1, 256)
    slow = estimate(cost, limits_for("agx-orin-64gb"), half, 512, 1, 256)
    assert slow.decode_tok_s == pytest.approx(full.decode_tok_s / 2)
    assert slow.decode_roofline_tok_s == full.decode_roofline_tok_s
    assert slow.memory_mb == pytest.approx(full.memory_mb + 300)


def test_an_slo_naming_an_unknown_device_lists_the_known_ones():
    with pytest.raises(ValidationError) as e:
        SLOConfig.model_validate({"targets": [{"device": "orin-nano-4gb", "prompt_tokens": 512, "concurrency": 1,
                                               "decode_tok_s": 20}]})
    assert "slo.targets[].device: unknown device 'orin-nano-4gb'; known devices: " in str(e.value)
    for name in DEVICES:
        assert name in str(e.value)


def test_an_slo_memory_cap_above_the_device_and_one_without_a_prompt_length_or_concurrency_are_refused():
    with pytest.raises(ValidationError, match=r"max_memory_mb: 9000 MB is above the 8 GB orin-nano-8gb has; give at most 8000"):
        SLOTarget(device="orin-nano-8gb", prompt_tokens=512, concurrency=1, max_memory_mb=9000)
    for missing in ("prompt_tokens", "concurrency"):
        fields = {"device": "agx-orin-64gb", "prompt_tokens": 512, "concurrency": 2, "ttft_p99_ms": 500}
        del fields[missing]
        with pytest.raises(ValidationError) as e:
            SLOTarget.model_validate(fields)
        assert e.value.errors()[0]["loc"] == (missing,) and e.value.errors()[0]["type"] == "missing"
    with pytest.raises(ValidationError, match="no objective"):
        SLOTarget(device="agx-orin-64gb", prompt_tokens=512, concurrency=2)


def test_an_unknown_runtime_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown runtime 'tgi'; known runtimes: tensorrt_llm, edge_llm"):
        runtime_efficiency("tgi")


def test_a_target_is_estimated_with_the_runtime_that_serves_it_and_one_that_cannot_run_there_is_refused(tmp_path):
    """slo.targets[].runtime names what serves on the device class; unset, the engine backend does, and only where it
    runs: the preflight refuses a CPU engine's factors for an Orin, naming the field and the runtimes that serve there."""
    from edgeflow.estimate.runtimes import RUNTIMES, target_runtime
    from edgeflow.preflight import load_profile, preflight

    orin = SLOTarget(device="agx-orin-64gb", prompt_tokens=512, concurrency=2, decode_tok_s=20)
    with pytest.raises(ValueError) as e:
        target_runtime("cpu_native", orin, "slo.targets[0]")
    assert str(e.value) == (
        "slo.targets[0].runtime (unset: engine.backend='cpu_native'): cpu_native serves on cpu devices and agx-orin-64gb "
        "is a jetson device; name the runtime that serves on agx-orin-64gb in slo.targets[0].runtime "
        "(tensorrt_llm, edge_llm, vllm, llama_cpp)")
    assert target_runtime("cpu_native", orin.model_copy(update={"runtime": "edge_llm"})) is RUNTIMES["edge_llm"]
    assert target_runtime("tensorrt_llm", orin) is RUNTIMES["tensorrt_llm"]
    with pytest.raises(ValueError, match=r"runtime='mlc' is not an engine backend edgeflow estimates; the ones that serve "
                       r"on agx-orin-64gb: tensorrt_llm, edge_llm, vllm, llama_cpp"):
        target_runtime("cpu_native", orin.model_copy(update={"runtime": "mlc"}))
    cpu = SLOTarget(device="x86-cpu", runtime="edge_llm", prompt_tokens=64, concurrency=1, decode_tok_s=5)
    with pytest.raises(ValueError, match=r"runtime='edge_llm': edge_llm serves on jetson devices and x86-cpu is a cpu device"):
        target_runtime("cpu_native", cpu)

    base = load_profile("configs/demo-cpu.yaml")  # cpu_native, one x86-cpu target: loads
    for target, expect in (({"runtime": None}, r"slo.targets\[1\].runtime \(unset: engine.backend='cpu_native'\)"),
                           ({"runtime": "trt"}, r"slo.targets\[1\].runtime='trt' is unknown; choose one of")):
        bad = base.settings()
        bad["slo"]["targets"].append(orin.model_dump() | target)
        with pytest.raises(ValidationError, match=expect):
            preflight(base.model_validate(bad))
    good = base.settings()
    good["slo"]["targets"].append(orin.model_dump() | {"runtime": "tensorrt_llm"})
    preflight(base.model_validate(good))


def test_a_runtime_whose_kernels_differ_by_weight_width_takes_the_widths_own_factors():
    """cpu_native runs fp32 layers on fp32 FMAs and 4/8-bit ones on int16 multiply-adds: its factors are per width, and
    a width it lists none for takes the runtime's general ones."""
    rt = ROOFLINE.model_copy(update={"name": "by-width", "bandwidth": 0.5, "compute": 0.5, "by_weight_bits": {32: (0.8, 0.25)}})
    arch = describe(GEMMA2_9B)
    for bits, (bandwidth, compute) in ((4, (0.5, 0.5)), (8, (0.5, 0.5)), (32, (0.8, 0.25))):
        cost = token_cost(arch, Scheme(bits=bits, group_size=128))
        best = estimate(cost, limits_for("agx-orin-64gb"), ROOFLINE, 512, 1, 256)
        got = estimate(cost, limits_for("agx-orin-64gb"), rt, 512, 1, 256)
        assert got.decode_bound == "memory" and got.ttft_bound == "compute"  # batch 1; 8.6 TFLOP of prefill
        assert got.decode_tok_s == pytest.approx(best.decode_tok_s * bandwidth), bits
        assert got.ttft_p99_ms == pytest.approx(best.ttft_p99_ms / compute), bits
    assert runtime_efficiency("cpu_native").factors(32) != runtime_efficiency("cpu_native").factors(4)
