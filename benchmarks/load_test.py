"""Load test of an edge server: N concurrent streaming chats for a set time, and the server's overhead.

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --concurrency 4 --seconds 60
    python benchmarks/load_test.py --overhead --engine .edgeflow/device/engines/<key> --url http://127.0.0.1:8000

Load: every client sends streamed chat completions back to back (one prompt from a fixed list each
time) and records time to first token, streamed tokens, and any error (non-200, an error event, or a
200 without a single token). Reports P50/P99 time to first token, aggregate and per-stream tokens/s,
requests and errors, as a markdown row plus JSON.

Overhead (--overhead): on one prompt, decode tokens/s of the engine's own generation loop
(`backend.generate` in this process) vs tokens/s streamed through HTTP from the server, measured
alternately --repeats times each; the ratio is the server's overhead. Run it with nothing else on the box.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers and say why they are prime.",
    "How do I boil an egg?",
    "Summarise the plot of a detective story in three sentences.",
)


async def one_chat(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat; returns ttft, tokens, duration and error (None if fine)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}", "duration": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"].get("message", "error event"), "duration": time.perf_counter() - t0}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])) and first is None:
                    first = time.perf_counter()
    except httpx.HTTPError as e:
        return {"error": repr(e), "duration": time.perf_counter() - t0}
    end = time.perf_counter()
    if first is None:
        return {"error": "200 without a single token", "duration": end - t0}
    return {"ttft": first - t0, "tokens": tokens, "duration": end - t0, "decode": (end - first), "error": None}


async def load(url: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    """Run `concurrency` clients back to back for `seconds`; aggregate their results."""
    results: list[dict] = []
    deadline = time.perf_counter() + seconds

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            k = i
            while time.perf_counter() < deadline:
                results.append(await one_chat(client, url, model, PROMPTS[k % len(PROMPTS)], max_tokens))
                k += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    ttft = sorted(r["ttft"] for r in ok)
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else float("nan")  # noqa: E731
    return {
        "concurrency": concurrency, "seconds": round(wall, 1), "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if r["error"]][:5],
        "ttft_p50_ms": round(1000 * q(0.50), 1), "ttft_p99_ms": round(1000 * q(0.99), 1),
        "tokens": sum(r["tokens"] for r in ok),
        "aggregate_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "per_stream_decode_tok_s": round(statistics.median((r["tokens"] - 1) / r["decode"] for r in ok if r["tokens"] > 1 and r["decode"] > 0), 1) if ok else None,
    }


def overhead(url: str, model: str, engine_dir: Path, tokens: int, repeats: int) -> dict:
    """Engine loop vs HTTP stream tok/s on the same chat prompt, alternating, `repeats` times each."""
    from edgeflow.serving.tokenizer import LightTokenizer
    from edgeflow.engines import get_backend

    meta = json.loads((engine_dir / "engine.json").read_text())
    backend = get_backend(meta["backend"])
    session = backend.load(engine_dir)
    tok = LightTokenizer(engine_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[2]}])
    ids = tok(prompt)["input_ids"]
    engine_rates, http_rates = [], []
    for _ in range(repeats):
        r = asyncio.run(_http_once(url, model, tokens))
        http_rates.append((r["tokens"] - 1) / r["decode"])
        # the same number of tokens from the engine loop (the server stopped at EOS, if it met one)
        first = None
        n = 0
        for _tok in backend.generate(session, ids, r["tokens"], []):
            n += 1
            first = first or time.perf_counter()
        engine_rates.append((n - 1) / (time.perf_counter() - first))
    e, h = statistics.median(engine_rates), statistics.median(http_rates)
    return {"engine_tok_s": round(e, 1), "http_tok_s": round(h, 1), "ratio": round(h / e, 3),
            "engine_runs": [round(x, 1) for x in engine_rates], "http_runs": [round(x, 1) for x in http_rates], "tokens": tokens}


async def _http_once(url: str, model: str, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        r = await one_chat(client, url, model, PROMPTS[2], tokens)
    if r["error"]:
        raise RuntimeError(r["error"])
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name (default: the server's /v1/models)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--engine", type=Path, help="engine dir for --overhead (the one the server runs)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    model = a.model or httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"][0]["id"]
    if a.overhead:
        print(json.dumps(overhead(a.url, model, a.engine, a.max_tokens, a.repeats)))
        return
    rows = [asyncio.run(load(a.url, model, c, a.seconds, a.max_tokens)) for c in a.concurrency]
    print("| streams | requests | errors | TTFT p50 ms | TTFT p99 ms | aggregate tok/s | per-stream decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
              f"{r['aggregate_tok_s']} | {r['per_stream_decode_tok_s']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
