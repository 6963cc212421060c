"""Health checks of an edge server: /health until it is ready (or its process died), and one smoke chat answer.
"""
from __future__ import annotations

import json
import time

import httpx

from edgeflow.ops.processes import alive


def wait_healthy(base_url: str, timeout: float, pid: int | None = None, headers: dict[str, str] | None = None) -> dict:
    """Poll /health until it answers 200 (a real one-token generation), or fail with the last answer."""
    deadline = time.time() + timeout
    last = "no answer"
    while time.time() < deadline:
        if pid is not None and not alive(pid):
            raise RuntimeError(f"edge server (pid {pid}) exited before becoming healthy; see its log under logs/edge-server-<port>.log")
        try:
            r = httpx.get(f"{base_url}/health", timeout=10, headers=headers)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise TimeoutError(f"{base_url}/health not healthy after {timeout:.0f}s (deploy.health_timeout_s); last: {last}")


def smoke_chat(base_url: str, model: str, prompt: str, max_tokens: int = 48, headers: dict[str, str] | None = None) -> str:
    """Send one streamed chat request; it must end properly ([DONE], a finish_reason) with at least one
    generated token. Returns the answer text.

    What the answer says is the consistency gate's business, not the deploy's: a tiny or early student
    may well answer in whitespace. What a deploy must catch is a stream that breaks, errors, never
    finishes or carries no generated token at all.
    """
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    finish, usage, done = None, None, False
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"smoke chat failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    if not (done and finish):
        raise RuntimeError(f"smoke chat stream ended without {'[DONE]' if not done else 'a finish_reason'}")
    if not usage or usage.get("completion_tokens", 0) < 1:
        raise RuntimeError(f"smoke chat generated no token (usage {usage}, finish_reason {finish})")
    return "".join(parts)
