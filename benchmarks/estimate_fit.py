"""The estimate against published figures: each runtime's bandwidth and compute factors fitted to the decode and
prefill speeds in benchmarks/data/published_speeds.json, and each figure predicted with the factor fitted to the
others (leave-one-out).

    python benchmarks/estimate_fit.py [--markdown]

A figure is used when the estimate can count it: its model is one of MODELS (config.json fields of the published
checkpoints; a family edgeflow/model/architecture.py does not describe, or a mixture of experts, is left out and
listed), its device is in the device table, its weights are integers of a known width, and it is not marked
low-confidence. The decode factor of a runtime is the geometric mean, over its figures, of measured tok/s / the
roofline's tok/s (prompt of the figure or 128 tokens, 128 new tokens, one stream); the prefill factor likewise with
prefill tok/s. The result is what edgeflow/estimate/runtimes.py carries (BENCHMARKS.md#estimate).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeflow.estimate import limits_for  # noqa: E402
from edgeflow.estimate.counts import Scheme, token_cost  # noqa: E402
from edgeflow.estimate.roofline import estimate  # noqa: E402
from edgeflow.estimate.runtimes import ROOFLINE  # noqa: E402
from edgeflow.model.architecture import describe  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "published_speeds.json"


def _llama(h, layers, heads, kv, inter, vocab, tied, head_dim=None, model_type="llama", **extra):
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
    name = next(k for k, v in arch.items() if v == model_type)
    c = {"model_type": model_type, "architectures": [name], "hidden_size": h, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
         "tie_word_embeddings": tied, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "hidden_act": "silu"}
    if head_dim:
        c["head_dim"] = head_dim
    return c | extra


def _gemma2(h, layers, heads, kv, inter):
    return {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": h, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 256, "intermediate_size": inter,
            "vocab_size": 256000, "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
            "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


# The published checkpoints' config.json sizes (Hugging Face model cards' config.json), by the names the figures use.
MODELS = {
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, False),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, False),
    "llama-3-8b": _llama(4096, 32, 32, 8, 14336, 128256, False),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, 128256, True, head_dim=64),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, 128256, True, head_dim=128),
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, False, model_type="qwen2"),
    "qwen3-0.6b": _llama(1024, 28, 16, 8, 3072, 151936, True, head_dim=128, model_type="qwen3"),
    "qwen3-1.7b": _llama(2048, 28, 16, 8, 6144, 151936, True, head_dim=128, model_type="qwen3"),
    "qwen3-4b": _llama(2560, 36, 32, 8, 9728, 151936, True, head_dim=128, model_type="qwen3"),
    "qwen3-14b": _llama(5120, 40, 40, 8, 17408, 151936, False, head_dim=128, model_type="qwen3"),
    "gemma-2-2b": _gemma2(2304, 26, 8, 4, 9216),
    "gemma-2-9b": _gemma2(3584, 42, 16, 8, 14336),
}
ALIASES = {"llama 3.1 8b": "llama-3-8b", "llama-3.1-8b-instruct": "llama-3-8b", "llama-3-8b": "llama-3-8b",
           "llama 3.2 3b": "llama-3.2-3b", "llama-3.2-3b": "llama-3.2-3b", "llama-3.2-1b": "llama-3.2-1b",
           "qwen2.5 7b": "qwen2.5-7b", "gemma 2 2b": "gemma-2-2b", "gemma 2 9b": "gemma-2-9b",
           "llama-2-7b": "llama-2-7b", "llama2 7b": "llama-2-7b", "llama-7b (ggml-model-q4.bin)": "llama-2-7b",
           "llama 7b": "llama-2-7b", "llama2 13b": "llama-2-13b", "qwen3-0.6b": "qwen3-0.6b", "qwen3-1.7b": "qwen3-1.7b",
           "qwen3-4b-instruct-2507": "qwen3-4b", "qwen/qwen3-14b-awq": "qwen3-14b"}
# Device strings of the figures -> the device table (an AGX Orin of either memory size has 204.8 GB/s; the TinyChat
# README's "Orin" is its 64 GB AGX Orin; the IGX Orin's iGPU, by its author, benchmarks as the AGX).
DEVICE_PREFIXES = (("agx-orin", "agx-orin-64gb"), ("jetson-orin", "agx-orin-64gb"), ("igx-orin", "agx-orin-64gb"),
                   ("orin-nano-super-8gb", "orin-nano-super-8gb"), ("orin-nano-8gb", "orin-nano-8gb"),
                   ("agx-thor", "agx-thor"), ("a100-80gb", "a100-80gb"), ("h100-sxm", "h100-sxm"),
                   ("h100-pcie", "h100-pcie"))


def scheme_of(f: dict) -> Scheme | None:
    """The storage a figure's quantization names, as the estimate counts it; None when it is not an integer scheme."""
    q = (f.get("quant") or "").lower()
    bits = f.get("weight_bits")
    if bits not in (4, 8, 16) or "fp4" in q or "fp8" in q:
        return None
    if bits == 16:
        return Scheme(bits=16)
    if f["runtime"] == "llama_cpp":  # Q4_0/Q4_K: blocks of 32 with an fp16 scale (and a minimum); the head at ~6 bits
        return Scheme(bits=4, group_size=32, zero_point="q4_0" not in q, head_bits=8)
    if f["runtime"] == "mlc":  # q4f16_1: groups of 32, the head quantized too
        return Scheme(bits=4, group_size=32, head_bits=4)
    return Scheme(bits=bits, group_size=128 if bits == 4 else None)


def usable(f: dict) -> tuple[str, str, Scheme] | str:
    """(model key, device, scheme) of a figure the estimate can count, or why it cannot."""
    if f.get("low_confidence"):
        return "marked low-confidence"
    model = ALIASES.get((f.get("model") or "").lower())
    if model is None:
        return f"model {f.get('model')!r}: no config here (a family the model description has no entry for, a mixture of experts, or an unstated size)"
    device = next((d for p, d in DEVICE_PREFIXES if f["device"].startswith(p)), None)
    if device is None:
        return f"device {f['device']!r} is not in the device table"
    scheme = scheme_of(f)
    if scheme is None:
        return f"weights {f.get('quant')!r}: not an integer scheme the counts know"
    return model, device, scheme


def ratios() -> tuple[list[dict], list[tuple[dict, str]]]:
    rows, left = [], []
    for f in json.loads(DATA.read_text())["figures"]:
        u = usable(f)
        if isinstance(u, str):
            left.append((f, u))
            continue
        model, device, scheme = u
        cost = token_cost(describe(MODELS[model]), scheme)
        prompt = int(f.get("prompt_tokens") or 128)
        est = estimate(cost, limits_for(device), ROOFLINE, prompt, 1, int(f.get("output_tokens") or 128))
        runtime = f["runtime"].split(" ")[0]
        if f.get("decode_tok_s"):
            rows.append({"runtime": runtime, "what": "decode", "model": model, "device": device, "bits": scheme.bits,
                         "measured": f["decode_tok_s"], "roofline": est.decode_roofline_tok_s, "source": f["source_url"]})
        if f.get("prefill_tok_s") and f.get("prompt_tokens"):
            flops_s = limits_for(device).peak_tflops * 1e12
            roof_tok_s = prompt / max(cost.prefill_flops(prompt) / flops_s, cost.step_weight_bytes / (limits_for(device).bandwidth_gb_s * 1e9))
            rows.append({"runtime": runtime, "what": "prefill", "model": model, "device": device, "bits": scheme.bits,
                         "measured": f["prefill_tok_s"], "roofline": roof_tok_s, "source": f["source_url"]})
    for r in rows:
        r["ratio"] = r["measured"] / r["roofline"]
    return rows, left


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def fit(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(runtime, decode|prefill) -> factor, figures, leave-one-out errors."""
    out = {}
    for key in sorted({(r["runtime"], r["what"]) for r in rows}):
        group = [r for r in rows if (r["runtime"], r["what"]) == key]
        factor = geomean([r["ratio"] for r in group])
        errors = []
        for i, r in enumerate(group):
            others = [g["ratio"] for j, g in enumerate(group) if j != i]
            if others:
                predicted = r["roofline"] * geomean(others)
                r["loo_error"] = predicted / r["measured"] - 1
                errors.append(abs(r["loo_error"]))
        out[key] = {"factor": factor, "n": len(group),
                    "loo_median": sorted(errors)[len(errors) // 2] if errors else None, "loo_max": max(errors, default=None)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the tables for BENCHMARKS.md")
    ap.parse_args()
    rows, left = ratios()
    fits = fit(rows)
    print("| runtime | figure | model | device | bits | published tok/s | roofline tok/s | ratio | leave-one-out error |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["runtime"], r["what"], r["device"], r["model"])):
        loo = f"{r['loo_error']:+.0%}" if "loo_error" in r else "(alone)"
        print(f"| {r['runtime']} | {r['what']} | {r['model']} | {r['device']} | {r['bits']} | {r['measured']:,.1f} | "
              f"{r['roofline']:,.1f} | {r['ratio']:.2f} | {loo} |")
    print("\n| runtime | figure | factor (geometric mean) | figures | leave-one-out median / max error |")
    print("|---|---|---:|---:|---|")
    for (rt, what), v in fits.items():
        loo = f"{v['loo_median']:.0%} / {v['loo_max']:.0%}" if v["loo_median"] is not None else "-"
        print(f"| {rt} | {what} | {v['factor']:.3f} | {v['n']} | {loo} |")
    print(f"\n{len(left)} figures left out:")
    for f, why in left:
        print(f"- {f['device'][:30]} / {f['runtime']} / {f.get('model')}: {why}")


if __name__ == "__main__":
    main()
