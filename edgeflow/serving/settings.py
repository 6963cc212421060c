"""The edge server's settings: one pydantic model, every field a CLI flag of `python -m edgeflow.serving.server`.

    python -c "from edgeflow.serving.settings import ServerSettings; print(ServerSettings().model_dump())"

Below every module of the server: the app (edgeflow.serving.app), the endpoints and the runtime read it from here, so no
endpoint imports the app that imports it.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

MiB = 1 << 20

# How long the edge server and the proxy keep an idle client connection open. Clients built on httpx (the OpenAI
# SDK among them) drop an idle connection after 5 s; a server that also closes at 5 s (uvicorn's default) races
# them, and a request sent as the server closes is reset: 1 of 40 requests spaced at the timeout, measured on the
# 2-core Xeon of BENCHMARKS.md#keepalive-race. At 75 s, as in nginx's keepalive_timeout, the client gives up first.
KEEPALIVE_S = 75
# The proxy's own pool drops an idle connection to an edge server well before that server would (same race).
PROXY_POOL_KEEPALIVE_S = 30


def uvicorn_config(app, host: str, port: int, log_level: str = "warning", **options):
    """The uvicorn settings every edgeflow HTTP server runs with (edge server, proxy, and the tests' live servers)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEPALIVE_S, **options)


class ServerSettings(BaseModel):
    """Everything the server can be told; each field is also a CLI flag (--max-queue, …)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(
        default=None,
        min_length=1,
        description="Model id clients must send as `model` and /v1/models lists; defaults to the engine directory's name.",
    )
    backend: str | None = Field(
        default=None, description="Engine backend (edgeflow.engines.BACKENDS key); defaults to the one engine.json names, "
        "and when given must match it (a guard against serving the wrong engine directory).")
    max_prompt_tokens: int = Field(default=2048, ge=1, description="Longest accepted prompt, in tokens after the chat template.")
    max_tokens_limit: int = Field(default=512, ge=1, description="Largest `max_tokens` a request may ask for.")
    max_context: int = Field(default=2560, ge=2, description="Prompt tokens + max_tokens must not exceed this.")
    max_body_bytes: int = Field(default=1 * MiB, ge=1024, description="Largest accepted request body, in bytes (413 beyond).")
    max_concurrency: int = Field(default=2, ge=1, description="Generations running at once (worker threads for requests).")
    max_queue: int = Field(default=8, ge=0, description="Requests allowed to wait for a slot; more get 429 at once.")
    request_timeout_s: float = Field(
        default=60.0, gt=0, description="Deadline per request from arrival (queueing included); 504 or an SSE error past it."
    )
    health_timeout_s: float = Field(default=10.0, gt=0, description="/health fails (503) if the one-token probe takes longer.")
    access_log: Path | None = Field(default=None, description="JSONL access log path (one line per finished request); off if unset.")
    access_log_max_bytes: int = Field(default=64 * MiB, ge=1024, description="Rotate the access log into a segment before it grows past this size.")
    access_log_backups: int = Field(
        default=5, ge=0, description="Retention of segments not yet shipped: at most this many × access_log_max_bytes "
        "bytes of them are kept (the oldest are deleted, with a warning); shipped segments are deleted at once. 0 keeps none.",
    )
    access_log_rotate_s: float = Field(
        default=3600, ge=0, description="Also rotate the access log into a segment once its first line is this old, so "
        "a quiet device still ships its lines (edgeflow/device/logship.py); 0 rotates on size only.",
    )
    engine_version: str | None = Field(
        default=None,
        description="Version string reported in logs, metrics and system_fingerprint; defaults to engine.json's "
        "engine_version, else backend + checkpoint sha256 prefix.",
    )
    history_turns: int = Field(
        default=4, ge=1, description="Chat turns kept verbatim (the request's own user message is the last); older "
        "turns are condensed into one summary line.",
    )
    history_summary_chars: int = Field(default=240, ge=64, le=4096, description="Longest summary line for condensed turns.")
    watchdog_stall_s: float = Field(
        default=30.0, ge=0, description="Exit (for the supervisor to restart) when an engine call makes no progress "
        "for this long; 0 turns the watchdog off.",
    )
    api_key: SecretStr | None = Field(
        default=None, description="Key clients must send (Authorization: Bearer); prefer api_key_file or $EDGEFLOW_API_KEY, "
        "which stay out of the process list. Unset everywhere: no key is asked.",
    )
    api_key_file: Path | None = Field(
        default=None, description="File of accepted keys, one per line (# comments); several lines rotate keys.",
    )
    auth_probes: bool = Field(
        default=False, description="With a key configured, /health, /ready and /metrics need it too "
        "(Prometheus and the blackbox exporter then send it).",
    )
    scrub_access_log: bool = Field(
        default=True, description="Scrub PII and secrets (edgeflow.pii) from each access-log record before it is written; "
        "false keeps raw text, for an operator debugging a device only.",
    )
    fault_stall_after_tokens: int | None = Field(
        default=None, ge=0, description="Chaos testing only: every engine call hangs forever after this many tokens, "
        "as a stuck kernel would (exercises deadlines and the watchdog). Never set in production.",
    )
    fault_stall_after_s: float | None = Field(
        default=None, gt=0, description="Chaos testing only: this many seconds after the engine is ready, every engine "
        "call hangs forever while the process stays up, in the server's first start only (EDGEFLOW_SERVER_RESTARTS=0): "
        "the wedged kernel of a night outage, which the watchdog's restart clears. `make page-test` uses it. Never set "
        "in production.",
    )
    fault_corrupt_every: int | None = Field(
        default=None, ge=1, description="Chaos testing only: every Nth generated token is replaced by the next token id "
        "(answers degrade while requests and probes still succeed, as a bad on-device build would). Never set in production.",
    )

    @model_validator(mode="after")
    def _limits_consistent(self) -> ServerSettings:
        if self.max_prompt_tokens >= self.max_context:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} must be below max_context={self.max_context} "
                "(a full-length prompt must leave room for at least one new token)"
            )
        return self
