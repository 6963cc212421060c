"""Service objectives measured on a built engine (edgeflow/evaluation/service.py) and acted on by the gate: which targets
this host measures, the figures, each missed objective with its figure, limit and margin, and a variant failed for it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeflow.profile.slo import SLOTarget


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama, tmp_path_factory) -> Path:
    from edgeflow.engines import get_backend

    out = tmp_path_factory.mktemp("slo-engine") / "engine"
    get_backend("cpu_native").build(tiny_llama, out, {})
    return out


def _seqs() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, size=n).tolist() for n in (40, 25, 31)]


def test_prompts_are_of_the_stated_length_and_none_is_another_ones_prefix() -> None:
    from edgeflow.evaluation.service import prompts_of

    prompts = prompts_of(_seqs(), 64, 20)  # longer than the 96 tokens laid end to end allow 20 offsets of: repeated
    assert len(prompts) == 20 and {len(p) for p in prompts} == {64}
    assert len({tuple(p[:8]) for p in prompts}) == 20
    with pytest.raises(ValueError, match="no held-out tokens"):
        prompts_of([], 8, 2)


def test_a_target_is_measured_on_the_engine_and_each_miss_names_the_figure_the_limit_and_the_margin(tiny_engine) -> None:
    from edgeflow.evaluation.service import check_targets

    strict = SLOTarget(device="x86-cpu", prompt_tokens=24, concurrency=2, max_new_tokens=16, ttft_p99_ms=0.001,
                       decode_tok_s=1e9, max_memory_mb=0.001)
    easy = strict.model_copy(update={"ttft_p99_ms": 60_000.0, "decode_tok_s": 0.01, "max_memory_mb": 20_000.0})
    [missed, met] = check_targets("cpu_native", tiny_engine, [strict, easy], _seqs())
    m = missed["measured"]
    assert m["requests"] == 20  # 10 rounds of 2 prompts arriving together
    assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] and m["decode_tok_s"] > 0 and m["decode_tok_s_solo"] > 0
    assert m["peak_memory_mb"] > 0 and m["memory_source"] == "process peak RSS rise"
    ttft, decode, memory = missed["misses"]
    assert ttft.startswith(f"TTFT p99 {m['ttft_p99_ms']:,.0f} ms > 0.001 ms (") and "20 requests, 24 prompt tokens, concurrency 2" in ttft
    assert decode.startswith(f"decode {m['decode_tok_s']:,.1f} tok/s per stream (p50) < 1e+09 tok/s (100% short")
    assert memory.startswith(f"peak memory {m['peak_memory_mb']:,.0f} MB > 0.001 MB (")
    assert met["misses"] == [] and met["objectives"]["prompt_tokens"] == 24


def test_a_prompt_longer_than_the_engine_takes_is_a_miss_with_the_engines_reason(tiny_engine) -> None:
    from edgeflow.evaluation.service import check_targets

    # tiny_llama's max_position_embeddings is 256
    [row] = check_targets("cpu_native", tiny_engine,
                          [SLOTarget(device="x86-cpu", prompt_tokens=4096, concurrency=1, ttft_p99_ms=1000)], _seqs())
    assert row["measured"] is None
    [miss] = row["misses"]
    assert miss.startswith("the engine cannot serve the workload: ") and "4096" in miss


def test_a_cpu_engine_measures_cpu_targets_of_its_pool_and_says_why_not_the_others() -> None:
    from edgeflow.evaluation.service import targets_here

    cpu = SLOTarget(device="x86-cpu", prompt_tokens=64, concurrency=1, decode_tok_s=5)
    orin = SLOTarget(device="agx-orin-64gb", pool="orin", prompt_tokens=512, concurrency=2, decode_tok_s=20)
    served_by_trt = orin.model_copy(update={"runtime": "tensorrt_llm"})
    other_pool = cpu.model_copy(update={"pool": "cpu-big"})
    by_llama_cpp = cpu.model_copy(update={"runtime": "llama_cpp"})
    here, elsewhere = targets_here([cpu, orin, served_by_trt, other_pool, by_llama_cpp], "cpu_native", "inline")
    assert here == [cpu]
    assert elsewhere == [
        {"device": "agx-orin-64gb", "pool": "orin",
         "not_measured": "the engine runs on a CPU and agx-orin-64gb is a GPU: the estimate stands until it runs on one"},
        {"device": "agx-orin-64gb", "pool": "orin", "not_measured": "agx-orin-64gb is served by tensorrt_llm and the gate "
         "measured cpu_native engines: the estimate stands until it runs there"},
        {"device": "x86-cpu", "pool": "cpu-big", "not_measured": "the gate ran on the release host, not on pool cpu-big"},
        {"device": "x86-cpu", "pool": None, "not_measured": "x86-cpu is served by llama_cpp and the gate measured "
         "cpu_native engines: the estimate stands until it runs there"},
    ]
    assert targets_here([other_pool], "cpu_native", "cpu-big") == ([other_pool], [])
    assert targets_here([cpu.model_copy(update={"runtime": "cpu_native"})], "cpu_native", "inline")[1] == []


def test_the_gate_fails_a_variant_that_misses_an_objective_and_keeps_its_figures(tiny_llama, tiny_engine, tmp_path) -> None:
    """A variant that meets every quality threshold but not the memory objective fails with an `slo` reason; the FP
    student (the yardstick) is not measured."""
    from edgeflow.evaluation.gate import run_gate
    from edgeflow.evaluation.reference import compute_reference, load_reference, save_reference
    from edgeflow.profile import GateConfig

    seqs = _seqs()
    prompts = [s[:4] for s in seqs]
    # the "quantized" variant is the same dense model, so it meets every quality threshold exactly
    ref = load_reference(save_reference(compute_reference(tiny_llama, {"same": tiny_llama}, seqs, prompts, 4, 64,
                                                          prompts[0], [2]), tmp_path / "ref"))
    gate = GateConfig(greedy_tokens=4, min_top1_agreement=0.9, max_mean_kl=0.01, max_ppl_increase=0.01, min_engine_parity=0.9,
                      min_answers_ok=None)  # a random model loops: its answers are not what this test is about
    variants = [{"name": "fp32", "engine_dir": str(tiny_engine), "size_mb": 1.0, "quantized": False},
                {"name": "same", "engine_dir": str(tiny_engine), "size_mb": 1.0, "quantized": True}]
    target = SLOTarget(device="x86-cpu", prompt_tokens=16, concurrency=1, max_new_tokens=8, max_memory_mb=0.001,
                       decode_tok_s=0.01)
    rows, _ = run_gate(ref, variants, gate, "cpu_native", [target], "inline")
    fp, same = rows
    assert fp["passed"], fp["reasons"]
    assert fp["slo"] is None
    assert same["quality_passed"] and not same["passed"]
    [reason] = same["reasons"]
    assert reason.startswith("slo x86-cpu: peak memory ") and "> 0.001 MB" in reason
    [measured] = same["slo"]
    assert measured["device"] == "x86-cpu" and measured["measured"]["decode_tok_s"] > 0.01
