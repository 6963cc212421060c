from edgeflow.pipeline.register import choose_staging


def _row(name, size, agree, passed, quantized=True):
    return {"name": name, "size_mb": size, "top1_agreement": agree, "passed": passed, "quantized": quantized}


def test_staging_is_the_smallest_passing_quantized_variant():
    rows = [_row("fp32", 500, 1.0, True, quantized=False), _row("w8", 200, 0.99, True), _row("w4", 120, 0.97, True), _row("w4x", 110, 0.5, False)]
    assert choose_staging(rows)["name"] == "w4"


def test_ties_go_to_higher_agreement_and_nothing_passing_gives_none():
    assert choose_staging([_row("a", 100, 0.9, True), _row("b", 100, 0.95, True)])["name"] == "b"
    assert choose_staging([_row("fp32", 500, 1.0, True, quantized=False), _row("a", 100, 0.2, False)]) is None


def test_a_registered_version_carries_what_it_met_on_each_target_and_where_it_was_not_measured():
    from edgeflow.pipeline.register import slo_tags

    objectives = {"prompt_tokens": 128, "concurrency": 2}
    measured = {"ttft_p99_ms": 812.5, "decode_tok_s": 61.2, "peak_memory_mb": 388.0}
    tags = slo_tags({"slo": [
        {"device": "x86-cpu", "pool": None, "objectives": objectives, "measured": measured, "misses": []},
        {"device": "agx-orin-64gb", "pool": "orin", "not_measured": "the gate ran on the release host, not on pool orin"}]})
    assert tags == {
        "edgeflow.slo.x86-cpu": "met: TTFT p99 812.5 ms, decode 61.2 tok/s per stream, peak 388 MB at 128 prompt tokens, concurrency 2",
        "edgeflow.slo.agx-orin-64gb": "not measured: the gate ran on the release host, not on pool orin",
    }
    assert slo_tags({"slo": None}) == {}
