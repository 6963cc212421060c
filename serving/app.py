"""The edge server's app: its settings, the FastAPI app and routes for one engine, and the CLI.

    python -m serving.server --engine engines/cpu --host 127.0.0.1 --port 8000

Routes only dispatch: each endpoint family has its own module (serving.chat, serving.completions,
serving.models, serving.probes, serving.feedback, serving.page) and the generation path they share is
serving.generation. `create_app` wires one engine runtime (serving.runtime), the shared state
(serving.state) and API keys (serving.auth); `main` is what `python -m serving.server` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import probes
from serving.auth import ApiKeyAuth, load_keys
from serving.chat import CHAT_ENDPOINT, ChatCompletions
from serving.completions import COMPLETIONS_ENDPOINT, Completions
from serving.feedback import record_feedback
from serving.generation import handle_safely
from serving.models import get_model, list_models
from serving.page import chat_page as render_chat_page
from serving.protocol import ApiError, ChatRequest, CompletionRequest, Feedback
from serving.runtime import Runtime
from serving.state import AppState

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


class ServerSettings(BaseModel):
    """Everything the server can be told; each field is also a CLI flag (--max-queue, …)."""

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(
        default=None,
        min_length=1,
        description="Model id clients must send as `model` and /v1/models lists; defaults to the engine directory's name.",
    )
    backend: str | None = Field(
        default=None, description="Engine backend (tasks.engines.BACKENDS key); defaults to the one engine.json names, "
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
        "a quiet device still ships its lines (tasks/fleet/logship.py); 0 rotates on size only.",
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
        default=True, description="Scrub PII and secrets (tasks.pii) from each access-log record before it is written; "
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


# --------------------------------------------------------------------------------------------
# App factory
# --------------------------------------------------------------------------------------------


def create_app(engine_dir: Path, settings: ServerSettings) -> FastAPI:
    """The FastAPI app for one engine. The engine loads in the background at startup (/ready)."""
    engine_dir = Path(engine_dir)
    if settings.model_name is None:
        settings = settings.model_copy(update={"model_name": engine_dir.resolve().name})
    keys = load_keys(settings.api_key.get_secret_value() if settings.api_key else None, settings.api_key_file)
    runtime = Runtime(engine_dir, settings)
    state = AppState(runtime, settings)
    chat_api, completions_api = ChatCompletions(), Completions()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        runtime.watchdog.start(on_stall=lambda reason: loop.call_soon_threadsafe(state.engine_stalled, reason))
        loader = asyncio.create_task(runtime.load())
        try:
            yield
        finally:
            runtime.watchdog.stop()
            loader.cancel()
            for gen in list(state.generations):
                gen.cancel()
            runtime.executor.shutdown(wait=False, cancel_futures=True)
            if state.access_log is not None:
                state.access_log.close()

    app = FastAPI(title="edgeflow edge server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.edgeflow = state
    app.state.auth = bool(keys)

    def rejected(path: str) -> None:
        known = path if path in (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, "/feedback", "/health", "/ready", "/metrics") else "other"
        state.metrics.requests.labels(endpoint=known, status="401").inc()

    app.add_middleware(ApiKeyAuth, keys=keys, protect_probes=settings.auth_probes, on_reject=rejected)
    app.openapi = lambda: _openapi(app)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes / wrong methods answer in the same OpenAI error shape as everything else.
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    # The handler names below are the OpenAPI operation ids: keep them.
    @app.post(CHAT_ENDPOINT)
    async def chat_completions(request: Request) -> Response:
        return await handle_safely(request, state, chat_api)

    @app.post(COMPLETIONS_ENDPOINT)
    async def completions(request: Request) -> Response:
        return await handle_safely(request, state, completions_api)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return list_models(state)

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        return get_model(state, model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await probes.health(state)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return probes.ready(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return probes.metrics(state)

    @app.get("/")
    async def chat_page() -> Response:
        return render_chat_page(settings.model_name, auth=bool(keys))

    @app.post("/feedback")
    async def feedback(request: Request) -> JSONResponse:
        return await record_feedback(request, state)

    return app


_BODIES = ((CHAT_ENDPOINT, "ChatRequest"), (COMPLETIONS_ENDPOINT, "CompletionRequest"), ("/feedback", "Feedback"))


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The server's OpenAPI document (GET /openapi.json) with the request bodies the handlers validate
    themselves (they read the raw body to answer 413/415/400 before any parsing), so clients and fuzzers
    (tests/serving/test_fuzz.py) see every field, type and limit."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version="1", routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    models = {"ChatRequest": ChatRequest, "CompletionRequest": CompletionRequest, "Feedback": Feedback}
    for path, name in _BODIES:
        js = models[name].model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[name] = js
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
    app.openapi_schema = doc
    return doc


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.server",
        description="Serve one edgeflow engine over an OpenAI-compatible HTTP API.",
    )
    p.add_argument("--engine", type=Path, required=True, help="Engine directory (engine.json + tokenizer files).")
    p.add_argument("--host", default="127.0.0.1", help="Interface to bind (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000).")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # One flag per settings field, so the CLI can never drift from ServerSettings.
    for name, field in ServerSettings.model_fields.items():
        default = "" if field.default is None else f" (default {field.default})"
        p.add_argument(_flag(name), dest=name, default=None, metavar=name.upper(), help=f"{field.description}{default}")
    return p


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    values = {k: getattr(args, k) for k in ServerSettings.model_fields if getattr(args, k) is not None}
    return ServerSettings(**values)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        parser.error("; ".join(f"{_flag(str(err['loc'][0])) if err['loc'] else 'settings'}: {err['msg']}" for err in e.errors()))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tasks.engines import EngineIncompatibleError, get_backend

    # Fail fast (non-zero exit) on an engine this machine cannot run, instead of a server that
    # only ever answers 503.
    try:
        app = create_app(args.engine, settings)  # checks engine.json and its backend first
        get_backend(app.state.edgeflow.runtime.settings.backend).check_compatible(args.engine)
    except (EngineIncompatibleError, ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, workers=1)
    return 0
