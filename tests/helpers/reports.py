"""A gate report as the consistency stage writes it, built from rows, for the report and gate-report tests."""
from __future__ import annotations


def ref(kind: str, name: str) -> dict:
    return {"kind": kind, "uri": f"mlflow-artifacts:/1/abc/artifacts/{name}", "sha256": name * 8, "mlflow_run_id": "abc",
            "meta": {"variant": name, "size_mb": 1.25}}


def row(name: str, top1: float, passed: bool, quantized: bool = True) -> dict:
    """A row as edgeflow/pipeline/consistency.py:gate_variants writes it (edgeflow/evaluation/gate.py:run_gate, then its additions)."""
    return {
        "name": name, "size_mb": 1.2, "decode_tok_s": 51.3, "ttft_ms": 20.5, "top1_agreement": top1, "kl": 0.01234,
        "kl_p99": 0.05, "top1_last": 0.9, "greedy_exact": None if not quantized else 0.75, "ppl": 11.125, "passed": passed,
        "quantized": quantized, "reasons": [] if passed else [f"top-1 agreement {top1:.2%} < 97.00%"],
        "metrics": {"engine_parity": 0.99871, "positions": 420, "greedy_exact_match": None, "kl": 0.0123401},
        "checkpoint": ref("quantized" if quantized else "student", name), "engine": ref("engine", name),
        "engine_precision": "int4" if quantized else "fp32", "layer_error": [0.01, 0.02] if quantized else None,
    }


REPORT = {
    "thresholds": {"min_top1_agreement": 0.97, "max_mean_kl": 0.1, "max_ppl_increase": 0.1, "min_engine_parity": 0.99, "num_prompts": 16},
    "eval_prompts": 16, "eval_positions": 900,
    "reference": {"sha256": "f" * 64, "uri": "mlflow-artifacts:/1/r/artifacts/reference", "top_k": 64, "tail_mass_mean": 0.0125},
    "backend": "cpu_native", "attempt": 1, "calibration": {"sha256": "c" * 64, "total": 64},
    "rows": [row("fp32", 1.0, True, quantized=False), row("gptq-w4a16", 0.98, True), row("rtn-w4a16", 0.91, False)],
    "plots": {"layer_error": ref("plot", "layer_error.png")},
}
