from edgeflow.pipeline.register import choose_staging


def _row(name, size, agree, passed, quantized=True):
    return {"name": name, "size_mb": size, "top1_agreement": agree, "passed": passed, "quantized": quantized}


def test_staging_is_the_smallest_passing_quantized_variant():
    rows = [_row("fp32", 500, 1.0, True, quantized=False), _row("w8", 200, 0.99, True), _row("w4", 120, 0.97, True), _row("w4x", 110, 0.5, False)]
    assert choose_staging(rows)["name"] == "w4"


def test_ties_go_to_higher_agreement_and_nothing_passing_gives_none():
    assert choose_staging([_row("a", 100, 0.9, True), _row("b", 100, 0.95, True)])["name"] == "b"
    assert choose_staging([_row("fp32", 500, 1.0, True, quantized=False), _row("a", 100, 0.2, False)]) is None
