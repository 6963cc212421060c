"""Soak test of an edge server: minutes of mixed traffic at twice its generation slots, watching memory.

    python benchmarks/soak.py --engine .edgeflow/device/engines/<key> --minutes 10
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --model edgeflow-student --minutes 10

With --engine it starts `python -m edgeflow.serving.server` on a free loopback port itself (max_concurrency
--slots, an access log in a temporary directory, scrubbing on: the device's defaults) and stops it at
the end; with --url it drives a running server and samples --pid's memory.

Traffic: 2 x slots clients, each sending back to back one of
  * a streamed chat with sampling (temperature 0.7, top_p 0.9, a seed, a stop string)   40 %
  * a non-streamed chat or completion                                                   30 %
  * a streamed chat the client hangs up on after its first token                        15 %
  * a hostile request (malformed JSON, wrong types, over-limit, unknown model, lone
    surrogates, wrong content type, a body that stops midway)                           15 %
Designed answers: 200 or 429 for valid requests, 4xx for hostile ones. Anything else (5xx, an error
event in a stream, a transport error on a request the client did not abandon, a 200 without a
token) is an error. RSS of the server process is sampled every 5 s; the goal is that it stays within
5 % of its value after warm-up (the first --warmup-s seconds). Reports TTFT p50/p99 of the streams.
Prints a markdown summary and the raw numbers as JSON; exits 1 when a goal is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "My phone is +49 151 23456789, call me back about the order.",
    "How do I boil an egg?",
    "Summarise the plot of a detective story in three sentences.",
)


def _cpu() -> str:
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni") if f in flags]
    return f"{model} ({os.cpu_count()} CPUs, {', '.join(isa) or 'no AVX2'}), {platform.system()}/{platform.machine()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hostile(model: str) -> tuple[bytes, dict[str, str]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (b'{"model": ', {}),
        (json.dumps({**chat, "max_tokens": "four"}).encode(), {}),
        (json.dumps({**chat, "max_tokens": 10**6}).encode(), {}),
        (json.dumps({**chat, "model": "nope"}).encode(), {}),
        (json.dumps({**chat, "temperature": 9}).encode(), {}),
        (json.dumps(chat).replace('"hi"', '"\\ud800"').encode(), {}),
        (b"[" * 5000 + b"]" * 5000, {}),
        (json.dumps(chat).encode(), {"content-type": "text/plain"}),
        (json.dumps({**chat, "messages": [{"role": "user", "content": 5}]}).encode(), {}),
    ]
    body, headers = random.choice(cases)
    return body, {"content-type": "application/json", **headers}


class Soak:
    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.results: list[dict] = []

    def _chat(self, stream: bool, seed: int) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
                "max_tokens": self.max_tokens, "stream": stream, "temperature": 0.7, "top_p": 0.9, "seed": seed,
                "stop": ["\n\n\n"], **({"stream_options": {"include_usage": True}} if stream else {})}

    async def stream(self, client: httpx.AsyncClient, hang_up: bool) -> dict:
        t0 = time.perf_counter()
        kind = "hang-up" if hang_up else "stream"
        first, tokens = None, 0
        async with client.stream("POST", f"{self.url}/v1/chat/completions", json=self._chat(True, random.randrange(1 << 30))) as r:
            if r.status_code != 200:
                return {"kind": kind, "status": r.status_code, "ok": r.status_code == 429}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    return {"kind": kind, "status": 200, "ok": False, "error": msg["error"]["message"][:120]}
                if msg.get("choices") and msg["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter() - t0
                    tokens += 1
                    if hang_up:
                        return {"kind": kind, "status": 200, "ok": True, "ttft": first}
        ok = first is not None or tokens > 0
        return {"kind": kind, "status": 200, "ok": ok, "ttft": first, **({} if ok else {"error": "200 without a token"})}

    async def complete(self, client: httpx.AsyncClient) -> dict:
        if random.random() < 0.5:
            r = await client.post(f"{self.url}/v1/chat/completions", json=self._chat(False, random.randrange(1 << 30)))
            good = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        else:
            r = await client.post(f"{self.url}/v1/completions", json={"model": self.model, "prompt": random.choice(PROMPTS),
                                                                       "max_tokens": self.max_tokens, "temperature": 0.5})
            good = r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        return {"kind": "complete", "status": r.status_code, "ok": good or r.status_code == 429}

    async def hostile(self, client: httpx.AsyncClient) -> dict:
        if random.random() < 0.1:  # a body that stops midway: the client hangs up before sending the rest
            host, port = self.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n{\"model\": ")
            await writer.drain()
            writer.close()
            return {"kind": "hostile-cut", "status": None, "ok": True}
        body, headers = _hostile(self.model)
        r = await client.post(f"{self.url}/v1/chat/completions", content=body, headers=headers)
        return {"kind": "hostile", "status": r.status_code, "ok": 400 <= r.status_code < 500}

    async def client(self, until: float) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < until:
                x = random.random()
                t0 = time.perf_counter()
                try:
                    if x < 0.40:
                        res = await self.stream(client, hang_up=False)
                    elif x < 0.70:
                        res = await self.complete(client)
                    elif x < 0.85:
                        res = await self.stream(client, hang_up=True)
                    else:
                        res = await self.hostile(client)
                except (httpx.HTTPError, OSError) as e:
                    res = {"kind": "transport", "status": None, "ok": False, "error": repr(e)[:120]}
                res["t"] = time.monotonic()
                res["seconds"] = time.perf_counter() - t0
                self.results.append(res)


async def _sample_rss(pid: int, until: float, out: list[tuple[float, float]]) -> None:
    proc = psutil.Process(pid)
    t0 = time.monotonic()
    while time.monotonic() < until:
        rss = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
        out.append((time.monotonic() - t0, rss / 2**20))
        await asyncio.sleep(5)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


async def run(url: str, pid: int, model: str, clients: int, seconds: float, max_tokens: int, warmup_s: float) -> dict:
    soak = Soak(url, model, max_tokens)
    rss: list[tuple[float, float]] = []
    until = time.monotonic() + seconds
    await asyncio.gather(_sample_rss(pid, until, rss), *(soak.client(until) for _ in range(clients)))
    res = soak.results
    errors = [r for r in res if not r["ok"]]
    ttft = [r["ttft"] for r in res if r.get("ttft") is not None and r["kind"] == "stream"]
    after = [m for t, m in rss if t >= warmup_s]
    base = after[0] if after else None
    drift = max(abs(m - base) / base for m in after) if base else None
    kinds: dict[str, int] = {}
    for r in res:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    statuses: dict[str, int] = {}
    for r in res:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "cpu": _cpu(), "seconds": seconds, "clients": clients, "requests": len(res), "by_kind": kinds,
        "statuses": statuses, "errors": len(errors), "error_examples": errors[:5],
        "ttft_p50_ms": ttft and round(1000 * _pct(ttft, 0.5), 1), "ttft_p99_ms": ttft and round(1000 * _pct(ttft, 0.99), 1),
        "rss_mb": {"start": rss and round(rss[0][1], 1), "after_warmup": base and round(base, 1),
                   "max": rss and round(max(m for _, m in rss), 1), "end": rss and round(rss[-1][1], 1)},
        "rss_drift_after_warmup": drift and round(drift, 4),
        "goals_met": not errors and drift is not None and drift <= 0.05,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="Engine directory: start a server on it (else --url/--pid).")
    ap.add_argument("--url", help="A running server (with --pid).")
    ap.add_argument("--pid", type=int, help="The running server's pid (its RSS is sampled).")
    ap.add_argument("--model", default="soak-edge", help="Model name the server serves (default soak-edge with --engine).")
    ap.add_argument("--slots", type=int, default=2, help="The server's max_concurrency; clients = 2 x slots (default 2).")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=60.0, help="RSS after this many seconds is the baseline (default 60).")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="Seed of the traffic mix (random.seed).")
    a = ap.parse_args()
    random.seed(a.seed)
    proc = None
    if a.engine:
        port = free_port()
        log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgeflow.serving.server", "--engine", str(a.engine), "--host", "127.0.0.1", "--port", str(port),
             "--model-name", a.model, "--max-concurrency", str(a.slots), "--access-log", str(log_dir / "access.jsonl")],
            stdout=(log_dir / "server.log").open("w"), stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            proc.kill()
            print((log_dir / "server.log").read_text()[-3000:], file=sys.stderr)
            return 2
    elif a.url and a.pid:
        url, pid = a.url.rstrip("/"), a.pid
    else:
        ap.error("give --engine, or --url and --pid")
    try:
        out = asyncio.run(run(url, pid, a.model, 2 * a.slots, a.minutes * 60, a.max_tokens, a.warmup_s))
        health = httpx.get(f"{url}/health", timeout=30)
        out["healthy_after"] = health.status_code == 200
        out["goals_met"] = out["goals_met"] and out["healthy_after"]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    r = out["rss_mb"]
    print(f"| minutes | clients | requests | errors | TTFT p50 / p99 ms | RSS start → after warm-up → max → end MB | drift | healthy |\n"
          f"|---|---|---|---|---|---|---|---|\n"
          f"| {a.minutes:g} | {out['clients']} | {out['requests']} | {out['errors']} | {out['ttft_p50_ms']} / {out['ttft_p99_ms']} "
          f"| {r['start']} → {r['after_warmup']} → {r['max']} → {r['end']} | {out['rss_drift_after_warmup']:.1%} | {out['healthy_after']} |")
    print(f"CPU: {out['cpu']}")
    print(json.dumps(out, indent=1))
    return 0 if out["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
