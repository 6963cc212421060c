"""API keys for the edge server: who may generate, and who may read the probes.

    keys = load_keys(api_key=None, api_key_file=Path("/etc/edgeflow/api-keys"))   # or $EDGEFLOW_API_KEY
    app = ApiKeyAuth(app, keys, protect_probes=False)

* A key comes from `--api-key`, `--api-key-file` (one key per line, `#` comments; several lines let an
  operator rotate keys without downtime) or the EDGEFLOW_API_KEY environment variable; all that are
  given are accepted. A key file that is missing or holds no key is a startup error, not an open server.
* Clients send `Authorization: Bearer <key>` (what the OpenAI clients send) or `X-Api-Key: <key>`.
* With keys configured, /v1/* and /feedback answer 401 in the OpenAI error shape without a valid key;
  /health, /ready and /metrics too when `protect_probes` is set (Prometheus and the blackbox exporter
  then send the key: infra/prometheus). The chat page itself (GET /) is static and asks for the key.
* Keys are compared in constant time and never logged.
"""
from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

KEY_ENV = "EDGEFLOW_API_KEY"
PROBES = ("/health", "/ready", "/metrics")
MIN_KEY_CHARS = 16


def load_keys(api_key: str | None, api_key_file: Path | None, environ: dict[str, str] | None = None) -> frozenset[str]:
    """Every configured key (empty: the server is open). Raises ValueError naming the setting at fault."""
    env = os.environ if environ is None else environ
    keys: list[tuple[str, str]] = []
    if api_key:
        keys.append(("--api-key", api_key.strip()))
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {api_key_file}: cannot read it ({e.strerror}); create it with one key per line") from None
        found = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {api_key_file}: holds no key; write one key per line")
        keys += [("--api-key-file", k) for k in found]
    if env.get(KEY_ENV, "").strip():
        keys.append((KEY_ENV, env[KEY_ENV].strip()))
    for where, key in keys:
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ValueError(
                f"{where}: a key must be at least {MIN_KEY_CHARS} characters without spaces (got {len(key)}); "
                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
    return frozenset(k for _, k in keys)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


def valid(key: str | None, keys: frozenset[str]) -> bool:
    if key is None:
        return False
    ok = False
    for k in keys:  # every key compared, in constant time, so timing tells nothing about which one is near
        ok |= hmac.compare_digest(key.encode("utf-8", "replace"), k.encode("utf-8"))
    return ok


class ApiKeyAuth:
    """ASGI middleware: 401 (OpenAI error shape) for protected paths without a valid key."""

    def __init__(self, app: Any, keys: frozenset[str], protect_probes: bool,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.app, self.keys, self.protect_probes, self.on_reject = app, keys, protect_probes, on_reject

    def protects(self, path: str) -> bool:
        if not self.keys:
            return False
        return path.startswith("/v1/") or path == "/v1" or path == "/feedback" or (self.protect_probes and path in PROBES)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not self.protects(scope.get("path", "")):
            return await self.app(scope, receive, send)
        key = presented_key(scope.get("headers", []))
        if valid(key, self.keys):
            return await self.app(scope, receive, send)
        if self.on_reject is not None:
            self.on_reject(scope.get("path", ""))
        why = "no API key was sent" if key is None else "the API key is not valid"
        body = json.dumps({"error": {
            "message": f"{why}; send Authorization: Bearer <key> (the server's --api-key / --api-key-file / {KEY_ENV})",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="edgeflow"')]})
        await send({"type": "http.response.body", "body": body})
