"""edgeflow estimate: how fast and how big a model can be on a device, before anything is built (edgeflow/estimate/).

    edgeflow estimate --model /models/gemma-2-9b-it --bits 4 --group 128 --device orin-nano-8gb --runtime tensorrt_llm \\
        --prompt 512 --decode-tok-s 20
    edgeflow estimate --model .edgeflow/device/versions/v2/engine/config.json --bits 4 --device x86-cpu --runtime cpu_native --json

Prints the per-token costs (bytes read by layer, head and embedding; KV cache per token; prefill FLOPs), the device's
limits, and the estimate: decode tok/s per stream, TTFT p99 and memory, with the limit each one meets first. With
objectives (--ttft-p99-ms, --decode-tok-s, --max-memory-mb) it says which the model cannot meet and by how much.
Exit 0: estimated (and every objective given can be met); 1: an objective cannot be met; 2: bad input. An x86-cpu
device is probed on this host (about a second); every other comes from the device table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_OK, EXIT_MISSED, EXIT_USAGE = 0, 1, 2


def _config(model: Path) -> dict:
    path = model / "config.json" if model.is_dir() else model
    if not path.is_file():
        raise ValueError(f"--model {model}: no config.json there; give a model directory or its config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path}: not JSON ({e})") from None


def main(argv: list[str] | None = None) -> int:
    from edgeflow.profile.devices import DEVICES
    from edgeflow.estimate.runtimes import RUNTIMES

    p = argparse.ArgumentParser(prog="edgeflow estimate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a model directory or its config.json")
    p.add_argument("--bits", type=int, required=True, help="bits per linear weight: 4, 8, 16 or 32")
    p.add_argument("--group", type=int, default=128, help="weights per scale (default 128; 0: one scale per row)")
    p.add_argument("--zero-point", action="store_true", help="asymmetric weights (a zero point per group)")
    p.add_argument("--head-bits", type=int, default=16, help="bits per weight of the output head (default 16)")
    p.add_argument("--kv-bytes", type=float, default=2, help="bytes per cached K/V value (default 2: fp16)")
    p.add_argument("--device", required=True, help=f"device class: {', '.join(DEVICES)}")
    p.add_argument("--runtime", required=True, help=f"runtime: {', '.join(RUNTIMES)}")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--concurrency", type=int, default=1, help="streams decoding at once (default 1)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per session (default 256)")
    p.add_argument("--ttft-p99-ms", type=float, default=None, help="objective: TTFT p99, ms")
    p.add_argument("--decode-tok-s", type=float, default=None, help="objective: decode tok/s per stream")
    p.add_argument("--max-memory-mb", type=float, default=None, help="objective: resident memory, MB")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    a = p.parse_args(argv)
    try:
        report = run(a)
    except ValueError as e:
        print(f"edgeflow estimate: {e}", file=sys.stderr)
        return EXIT_USAGE
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        print(render(report))
    return EXIT_MISSED if report["misses"] else EXIT_OK


def run(a: argparse.Namespace) -> dict:
    """The estimate of the command line `a`, as JSON-safe data; ValueError naming the argument on bad input."""
    from pydantic import ValidationError

    from edgeflow.estimate import limits_for
    from edgeflow.estimate.counts import Scheme, token_cost
    from edgeflow.estimate.roofline import estimate
    from edgeflow.estimate.runtimes import runtime_efficiency
    from edgeflow.model.architecture import describe
    from edgeflow.profile.devices import device_class
    from edgeflow.profile.slo import SLOTarget

    device_class(a.device, "--device")
    runtime = runtime_efficiency(a.runtime)
    arch = describe(_config(a.model), str(a.model))
    try:
        scheme = Scheme(bits=a.bits, group_size=a.group or None, zero_point=a.zero_point, head_bits=a.head_bits,
                        kv_bytes=a.kv_bytes)
        target = SLOTarget(device=a.device, prompt_tokens=a.prompt, concurrency=a.concurrency,
                           max_new_tokens=a.new_tokens, ttft_p99_ms=a.ttft_p99_ms, decode_tok_s=a.decode_tok_s,
                           max_memory_mb=a.max_memory_mb) if (a.ttft_p99_ms or a.decode_tok_s or a.max_memory_mb) else None
    except ValidationError as e:
        raise ValueError("; ".join(f"--{'-'.join(str(x) for x in err['loc']) or 'arguments'}: {err['msg']}"
                                   for err in e.errors())) from None
    for name, value in (("--prompt", a.prompt), ("--concurrency", a.concurrency), ("--new-tokens", a.new_tokens)):
        if value < 1:
            raise ValueError(f"{name}: {value} must be at least 1")
    if a.prompt + a.new_tokens > arch.context_length:
        raise ValueError(f"--prompt {a.prompt} + --new-tokens {a.new_tokens} is over the model's context of "
                         f"{arch.context_length} tokens; give a shorter prompt")
    cost = token_cost(arch, scheme)
    limits = limits_for(a.device)
    est = estimate(cost, limits, runtime, a.prompt, a.concurrency, a.new_tokens)
    return {
        "model": str(a.model), "family": arch.family, "params": arch.params(), "scheme": scheme.model_dump(),
        "per_token": {"layer_bytes": cost.layer_bytes, "head_bytes": cost.head_bytes,
                      "embedding_row_bytes": cost.embedding_row_bytes, "kv_bytes_per_token": cost.kv_bytes_per_token,
                      "step_bytes": est.step_bytes, "prefill_flops": est.prefill_flops},
        "limits": limits.model_dump(), "runtime": runtime.model_dump(),
        "factors": dict(zip(("bandwidth", "compute"), runtime.factors(scheme.bits))),  # what estimate() used
        "workload": {"prompt_tokens": a.prompt, "concurrency": a.concurrency, "new_tokens": a.new_tokens},
        "estimate": est.model_dump(), "misses": est.misses(target) if target else [],
    }


def render(r: dict) -> str:
    t, e, lim, rt = r["per_token"], r["estimate"], r["limits"], r["runtime"]
    bandwidth, compute = r["factors"]["bandwidth"], r["factors"]["compute"]
    by_width = r["scheme"]["bits"] in rt["by_weight_bits"]
    mb = 1e6
    lines = [
        f"{r['model']}: {r['family']}, {r['params'] / 1e6:,.1f} M parameters, {r['scheme']['bits']}-bit weights"
        + (f" in groups of {r['scheme']['group_size']}" if r["scheme"]["bits"] < 16 and r["scheme"]["group_size"] else ""),
        f"  per decode step: layers {t['layer_bytes'] / mb:,.1f} MB, head {t['head_bytes'] / mb:,.1f} MB, KV cache "
        f"{t['kv_bytes_per_token'] / 1e3:,.1f} KB per token; {t['step_bytes'] / mb:,.1f} MB read per step in all",
        f"  prefill of {r['workload']['prompt_tokens']} tokens: {t['prefill_flops'] / 1e12:,.2f} TFLOP",
        f"  {lim['device']}: {lim['bandwidth_gb_s']:,.1f} GB/s, {lim['peak_tflops']:,.2f} TFLOP/s"
        + (f", {lim['memory_gb']:g} GB" if lim["memory_gb"] else "") + f" ({lim['source']})",
        f"  runtime {rt['name']}: {bandwidth:.0%} of the bandwidth"
        + ("" if rt["fitted"] else " (not fitted: decode is the roofline, a bound no engine beats)")
        + f", {compute:.0%} of the peak" + ("" if rt["compute_fitted"] else " (not fitted: the roofline)")
        + (f" ({r['scheme']['bits']}-bit layers' factors)" if by_width else ""),
        f"  decode: {e['decode_tok_s']:,.1f} tok/s per stream at concurrency {r['workload']['concurrency']} "
        f"(bound by {e['decode_bound']}; the roofline {e['decode_roofline_tok_s']:,.1f})",
        f"  TTFT p99: {e['ttft_p99_ms']:,.0f} ms (bound by {e['ttft_bound']})",
        f"  memory: {e['memory_mb']:,.0f} MB",
    ]
    lines += [f"  cannot meet: {m}" for m in r["misses"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
