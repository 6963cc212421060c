"""Benchmark the CPU engine backend against HF eager on one student.

    python benchmarks/engine_cpu.py --checkpoint DENSE_DIR --quantized INT4_DIR --tokens 128

Rows: HF eager fp32 (dense checkpoint), engine fp32 (dense checkpoint), engine int4 with the default
profile and with the "fast" profile (accuracy_level 4, int8 lm_head) built from the compressed-tensors
checkpoint, and the native backend (cpu_native: exact int4 weights times int16 activations in C, exact-argmax lm_head). For each: decode tok/s (median of --repeats greedy runs of --tokens new tokens, prefill
included, EOS ignored), TTFT, engine size, and for the int4 rows parity vs the fake-quantized HF model
(greedy token agreement over 5 chat prompts x --parity-tokens and teacher-forced score() top-1
agreement). Then aggregate tok/s of 2 concurrent streams (two threads calling generate, as the server
does) vs 1 on the default int4 engine and on the native engine (whose scheduler batches them).
Prints a markdown table, then the raw numbers as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from edgeflow.engines import cpu_native, cpu_onnx  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I boil an egg?",
)
# onnxruntime-genai always ends at EOS; this prompt runs the demo student past 128 tokens without one,
# so every row times the same number of tokens (the table's "tokens" column shows it).
SPEED_PROMPT = "Explain how a computer works, step by step, in detail."
EOS = 2
FAST_PROFILE = {"accuracy_level": 4, "lm_head": "int8"}


def _hf(path: Path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs = {}
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)  # fake-quant reference
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _chat(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def _hf_generate(model, ids: list[int], n: int, ignore_eos: bool) -> list[int]:
    x = torch.tensor([ids])
    kw = {"min_new_tokens": n} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             eos_token_id=EOS, pad_token_id=EOS, **kw)
    new = out[0, len(ids):].tolist()
    return new[:-1] if (not ignore_eos and new and new[-1] == EOS) else new


def _median_rate(fn, n: int, repeats: int) -> tuple[float, list[float], int]:
    """(median tok/s, every run's tok/s, tokens of the last run)."""
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = fn()
        rates.append(len(got) / (time.perf_counter() - t))
        if len(got) != n:  # the onnxruntime engine ends at the model's EOS even with no stop ids
            print(f"note: {len(got)} of {n} tokens generated", file=sys.stderr)
    return statistics.median(rates), rates, len(got)


def _engine_ttft(backend, session, ids: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        next(iter(backend.generate(session, ids, 1, [])))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _parity(backend, session, ref_model, prompts_ids: list[list[int]], n: int) -> dict:
    agree = total = 0
    top1 = []
    for ids in prompts_ids:
        ref = _hf_generate(ref_model, ids, n, ignore_eos=False)
        got = list(backend.generate(session, ids, n, [EOS]))
        agree += sum(a == b for a, b in zip(ref, got))
        total += max(len(ref), len(got))
        seq = ids + ref
        with torch.no_grad():
            hf = ref_model(torch.tensor([seq])).logits[0].numpy()
        top1.append(float((backend.score(session, seq).argmax(-1) == hf.argmax(-1)).mean()))
    return {"token_agreement": agree / total, "score_top1": float(np.mean(top1))}


NATIVE_ROW = "cpu_native int4 (exact int4 weights, int16 activations, exact-argmax head)"


def _streams(backend, session, ids: list[int], n: int, k: int) -> float:
    """Aggregate tok/s of k concurrent generate() calls (one Python thread each)."""
    counts = [0] * k

    def run(i: int) -> None:
        counts[i] = sum(1 for _ in backend.generate(session, ids, n, []))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(counts) / (time.perf_counter() - t)


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="dense student checkpoint (HF safetensors)")
    ap.add_argument("--quantized", type=Path, required=True, help="llm-compressor int4 checkpoint of the same student")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per speed run")
    ap.add_argument("--parity-tokens", type=int, default=32, help="greedy tokens per parity prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="where engines are built (default: a temp dir, removed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    work = args.workdir or Path(tempfile.mkdtemp(prefix="edgeflow-bench-cpu-"))
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    speed_ids = _chat(tok, SPEED_PROMPT)
    parity_ids = [_chat(tok, p) for p in PROMPTS]
    n = args.tokens
    results: dict = {
        "command": "python benchmarks/engine_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": cpu_onnx.device_fingerprint(),
        "threads_env": os.environ.get(cpu_onnx.THREADS_ENV),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
        "tokens": n,
        "prompt_tokens": len(speed_ids),
        "rows": [],
    }

    # HF eager fp32 on the dense checkpoint.
    dense_model = _hf(args.checkpoint)
    _hf_generate(dense_model, speed_ids, 4, ignore_eos=True)  # warm-up
    rate, rates, count = _median_rate(lambda: _hf_generate(dense_model, speed_ids, n, True), n, args.repeats)
    t = time.perf_counter()
    _hf_generate(dense_model, speed_ids, 1, True)
    results["rows"].append({"name": "HF eager fp32 (dense)", "tok_s": rate, "runs": rates, "tokens": count,
                            "ttft_s": time.perf_counter() - t})
    del dense_model

    builds = [
        ("engine fp32 (dense)", args.checkpoint, {}, cpu_onnx),
        ("engine int4 default profile", args.quantized, {}, cpu_onnx),
        ("engine int4 fast profile (acc4, int8 lm_head)", args.quantized, FAST_PROFILE, cpu_onnx),
        (NATIVE_ROW, args.quantized, {}, cpu_native),
    ]
    ref_model = _hf(args.quantized)
    sessions = {}
    for i, (name, ckpt, profile, backend) in enumerate(builds):
        out = work / f"engine{i}"
        t = time.perf_counter()
        meta = backend.build(ckpt, out, profile)
        build_s = time.perf_counter() - t
        session = backend.load(out)
        sessions[name] = session
        list(backend.generate(session, speed_ids, 4, []))  # warm-up (ORT first-run allocations)
        rate, rates, count = _median_rate(lambda: list(backend.generate(session, speed_ids, n, [])), n, args.repeats)
        row = {"name": name, "tok_s": rate, "runs": rates, "tokens": count, "ttft_s": _engine_ttft(backend, session, speed_ids, args.repeats),
               "build_s": build_s, "size_mb": _size_mb(out), "profile": meta["profile"] if ckpt == args.quantized else None,
               "builder_options": meta.get("builder_options")}
        if ckpt == args.quantized:
            row.update(_parity(backend, session, ref_model, parity_ids, args.parity_tokens))
        results["rows"].append(row)

    default = sessions["engine int4 default profile"]
    one = statistics.median(_streams(cpu_onnx, default, speed_ids, n, 1) for _ in range(args.repeats))
    two = statistics.median(_streams(cpu_onnx, default, speed_ids, n, 2) for _ in range(args.repeats))
    results["streams"] = {"one_stream_tok_s": one, "two_streams_aggregate_tok_s": two, "ratio": two / one}
    native = sessions[NATIVE_ROW]

    def native_streams(k: int) -> tuple[float, float]:
        """(aggregate tok/s, aggregate tok/s over the time left after the prefills, from the engine's stats)."""
        for key in native.stats:
            native.stats[key] = 0
        t = time.perf_counter()
        rate = _streams(cpu_native, native, speed_ids, n, k)
        wall = time.perf_counter() - t
        return rate, rate * wall / (wall - native.stats["prefill_ns"] / 1e9)

    runs: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for _ in range(args.repeats):  # alternating, so a change in the machine's load hits both alike
        for k in (1, 2):
            runs[k].append(native_streams(k))
    one, two = (statistics.median(r for r, _ in runs[k]) for k in (1, 2))
    one_d, two_d = (statistics.median(d for _, d in runs[k]) for k in (1, 2))
    results["native_streams"] = {"one_stream_tok_s": one, "two_streams_aggregate_tok_s": two, "ratio": two / one,
                                 "one_stream_decode_tok_s": one_d, "two_streams_decode_tok_s": two_d, "decode_ratio": two_d / one_d,
                                 "runs": runs, "stats": dict(native.stats)}
    results["loadavg_end"] = os.getloadavg()
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)

    print(render(results))
    print("\n```json\n" + json.dumps(results, indent=1) + "\n```")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def render(r: dict) -> str:
    d = r["device"]
    lines = [
        f"CPU: {d['cpu_model']} ({d['cores']} cores, {', '.join(d['isa'])}), {d['os']}/{d['arch']}, "
        f"python {platform.python_version()}; {r['tokens']} new tokens after a {r['prompt_tokens']}-token chat prompt, "
        f"greedy, median of runs; load average {r['loadavg_start'][0]:.1f} at start, {r['loadavg_end'][0]:.1f} at end.",
        "",
        "| backend | tokens | tok/s | TTFT ms | token agreement vs fake-quant HF | score() top-1 | engine MB | build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        agree = f"{row['token_agreement']:.1%}" if "token_agreement" in row else "–"
        top1 = f"{row['score_top1']:.1%}" if "score_top1" in row else "–"
        size = f"{row['size_mb']:.0f}" if "size_mb" in row else "–"
        build = f"{row['build_s']:.0f}" if "build_s" in row else "–"
        lines.append(f"| {row['name']} | {row['tokens']} | {row['tok_s']:.1f} | {row['ttft_s'] * 1000:.0f} | {agree} | {top1} | {size} | {build} |")
    s = r["streams"]
    lines += [
        "",
        f"Concurrency (int4 default engine): 1 stream {s['one_stream_tok_s']:.1f} tok/s, "
        f"2 concurrent streams {s['two_streams_aggregate_tok_s']:.1f} tok/s aggregate ({s['ratio']:.2f}x).",
    ]
    s = r["native_streams"]
    lines.append(
        f"Concurrency (cpu_native): 1 stream {s['one_stream_tok_s']:.1f} tok/s, 2 concurrent streams "
        f"{s['two_streams_aggregate_tok_s']:.1f} tok/s aggregate ({s['ratio']:.2f}x); decoding only (the prompts' "
        f"prefill time taken out): 1 stream {s['one_stream_decode_tok_s']:.1f}, 2 streams {s['two_streams_decode_tok_s']:.1f} "
        f"tok/s ({s['decode_ratio']:.2f}x)."
    )
    hf = r["rows"][0]["tok_s"]
    lines.append("Speed-up over HF eager: " + ", ".join(f"{row['name']} {row['tok_s'] / hf:.1f}x" for row in r["rows"][1:]) + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
