"""The edge server's app: the FastAPI app and routes for one engine, and the CLI (its settings: edgeflow.serving.settings).

    python -m edgeflow.serving.server --engine engines/cpu --host 127.0.0.1 --port 8000

Routes only dispatch: each endpoint family has its own module (edgeflow.serving.chat, edgeflow.serving.completions,
edgeflow.serving.models, edgeflow.serving.probes, edgeflow.serving.feedback, edgeflow.serving.page) and the generation path they share is
edgeflow.serving.generation. `create_app` wires one engine runtime (edgeflow.serving.runtime), the shared state
(edgeflow.serving.state) and API keys (edgeflow.serving.auth); `main` is what `python -m edgeflow.serving.server` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeflow.serving import probes
from edgeflow.serving.auth import ApiKeyAuth, load_keys
from edgeflow.serving.chat import CHAT_ENDPOINT, ChatCompletions
from edgeflow.serving.completions import COMPLETIONS_ENDPOINT, Completions
from edgeflow.serving.feedback import record_feedback
from edgeflow.serving.generation import handle_safely
from edgeflow.serving.models import get_model, list_models
from edgeflow.serving.page import chat_page as render_chat_page
from edgeflow.serving.protocol import ApiError, ChatRequest, CompletionRequest, Feedback
from edgeflow.serving.runtime import Runtime
from edgeflow.serving.settings import ServerSettings, uvicorn_config
from edgeflow.serving.state import AppState

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
        prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.serving.server"),
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
    from edgeflow.engines import EngineIncompatibleError, get_backend

    # Fail fast (non-zero exit) on an engine this machine cannot run, instead of a server that
    # only ever answers 503.
    try:
        app = create_app(args.engine, settings)  # checks engine.json and its backend first
        get_backend(app.state.edgeflow.runtime.settings.backend).check_compatible(args.engine)
    except (EngineIncompatibleError, ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.Server(uvicorn_config(app, args.host, args.port, args.log_level)).run()
    return 0
