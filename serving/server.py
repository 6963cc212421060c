"""Edge server: an OpenAI-compatible HTTP API in front of one compiled edgeflow engine.

    python -m serving.server --engine engines/cpu --host 127.0.0.1 --port 8000

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming SSE and not),
GET /v1/models, GET /health (deep probe: one real token through the engine), GET /ready,
GET /metrics (Prometheus), GET / (a chat page), POST /feedback (the page's feedback buttons).

Design notes (the why):

* Hardware-agnostic. The server only calls the engine interface of `tasks.engines`
  (`check_compatible`, `load`, `generate`) on the backend named in the settings; it never looks
  at the device. `engine.json` in the engine dir says which backend built it, and the tokenizer
  and chat template are read from the same dir, so what is served is exactly what was built.
* Sampling: `temperature`, `top_p`, `top_k`, `seed`, `stop`, `frequency_penalty`, `presence_penalty`,
  `repetition_penalty`, `logprobs`/`top_logprobs` go to the engine as one `SamplingParams`
  (tasks.engines.sampling); where the request is silent the engine's generation_config.json decides,
  and where that is silent too decoding is greedy (what the consistency gate measured). A parameter the
  engine's backend cannot honour gets 400 naming it and the backend, never silent greedy decoding.
  `n` must be 1. Any unknown field is rejected (422) rather than silently ignored.
* API keys (serving.auth): with a key configured, /v1/* and /feedback answer 401 without it (and the
  probes too with `auth_probes`).
* Engine calls block, so each generation runs in a worker thread of one executor with
  `max_concurrency + 1` threads: `max_concurrency` for requests, one kept free for /health and
  the warm-up so a busy server still answers its probes. A request beyond `max_concurrency`
  waits in a queue of at most `max_queue`; beyond that it gets 429 + Retry-After at once
  (shedding load early beats letting every client time out).
* A slot is released when the worker thread has really stopped, not when the client leaves:
  the concurrency bound is about CPU/GPU work, and a cancelled generation stops at its next token.
* Every generation has a deadline (`request_timeout_s`, counted from arrival, queueing included).
  Past it the client gets 504, or an SSE error event if the stream already started; a connection
  is never left open silently.
* Streaming text, stop strings and logprobs come from serving.decoding; the non-streaming answer is
  the concatenation of the very same pieces, so both modes return identical text.
* Status codes recorded for streams that already answered 200 describe the outcome: 499 client
  went away, 504 deadline, 500 engine error (the nginx/OpenAI conventions).
* A watchdog thread (serving.watchdog) ends the process when an engine call makes no progress for
  `watchdog_stall_s`, after failing /health and sending an error event to every open stream; run the
  server under serving.supervisor (deploy-edge does) or systemd to get it restarted.
* Chat requests keep the last `history_turns` turns; older ones are condensed into one summary
  line (serving.conversation), so a long chat stays under max_prompt_tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serving.access_log import AccessLog
from serving.auth import ApiKeyAuth, load_keys
from tasks.pii import scrub_value
from serving.decoding import Piece, TextStream, chat_logprobs, completion_logprobs
from tasks.engines.sampling import MAX_TOP_LOGPROBS, SamplingParams
from serving.conversation import condense
from serving.watchdog import Watchdog

log = logging.getLogger("edgeflow.serving")

MiB = 1 << 20
CHAT_PAGE = Path(__file__).with_name("chat.html")
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


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
    access_log_max_bytes: int = Field(default=64 * MiB, ge=1024, description="Rotate the access log before it grows past this size.")
    access_log_backups: int = Field(default=5, ge=0, description="Rotated access log files kept (access.jsonl.1 … .N).")
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

    @model_validator(mode="after")
    def _limits_consistent(self) -> ServerSettings:
        if self.max_prompt_tokens >= self.max_context:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} must be below max_context={self.max_context} "
                "(a full-length prompt must leave room for at least one new token)"
            )
        return self


# --------------------------------------------------------------------------------------------
# OpenAI request schemas
# --------------------------------------------------------------------------------------------


class _Request(BaseModel):
    # Unknown fields are rejected: a client asking for e.g. logit_bias or tools must not get a
    # plausible-looking answer that ignored it.
    model_config = ConfigDict(extra="forbid")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: StrictStr = Field(description="The text.")


class ChatMessage(BaseModel):
    # Clients attach extras such as `name`; they do not change what the template renders.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"] = Field(description="Who said it.")
    content: StrictStr | list[TextPart] = Field(description="Text, or a list of text parts (joined).")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = Field(default=False, description="Send a final chunk with token usage.")


Unit = Annotated[float, Field(allow_inf_nan=False)]
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 128


class _GenerationRequest(_Request):
    model: StrictStr = Field(description="Must equal the served model name.")
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = Field(default=None, description="New tokens at most.")
    stream: StrictBool = Field(default=False, description="Server-sent events instead of one JSON answer.")
    stream_options: StreamOptions | None = Field(default=None, description="include_usage for streams.")
    temperature: Unit | None = Field(default=None, ge=0, le=2, description="0 is greedy; default: generation_config.json, else 0.")
    top_p: Unit | None = Field(default=None, gt=0, le=1, description="Nucleus mass kept; default: generation_config.json, else 1.")
    top_k: StrictInt | None = Field(default=None, ge=-1, description="Most likely tokens kept (extension, as vLLM); 0 or -1: all.")
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**64 - 1,
                                   description="Same seed and request give the same tokens; default: random.")
    stop: (Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                       Field(max_length=MAX_STOP_STRINGS)]
           | None) = Field(default=None, description=f"Up to {MAX_STOP_STRINGS} strings; the text ends before the first one.")
    frequency_penalty: Unit | None = Field(default=None, ge=-2, le=2, description="Subtracted x count from generated tokens' logits.")
    presence_penalty: Unit | None = Field(default=None, ge=-2, le=2, description="Subtracted once from generated tokens' logits.")
    repetition_penalty: Unit | None = Field(default=None, gt=0, le=10,
                                            description="Extension (as vLLM): divides positive / multiplies negative logits of seen tokens.")
    user: StrictStr | None = Field(default=None, max_length=256, description="Ignored (end-user id).")
    n: StrictInt = Field(default=1, ge=1, le=128, description="Choices per request; this server returns 1 (400 otherwise).")

    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, rendered by the chat template.")
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = Field(
        default=None, description="Newer OpenAI name for max_tokens."
    )
    logprobs: StrictBool | None = Field(default=None, description="Return each token's log-probability (the model's own distribution).")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="Most likely alternatives per token (needs logprobs: true).")


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] = Field(
        description="Raw prompt text (a list of exactly one string is accepted too)."
    )
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5,
                                       description="Legacy: return logprobs and this many alternatives per token.")


class FeedbackTimings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, ge=0, description="Send to first token, as the browser saw it.")
    total_ms: float | None = Field(default=None, ge=0, description="Send to end of stream, as the browser saw it.")
    tokens: StrictInt | None = Field(default=None, ge=0, description="Completion tokens (from the stream's usage).")


class Feedback(_Request):
    """What the chat page's buttons post: the verdict, the conversation and what the user waited."""

    feedback: Literal["wrong_answer", "slow", "no_response"] = Field(description="The button pressed.")
    request_id: StrictStr | None = Field(default=None, max_length=128, description="id of the answer judged (links the request record).")
    conversation_id: StrictStr | None = Field(default=None, max_length=128, description="The page's conversation id.")
    messages: list[ChatMessage] = Field(default_factory=list, max_length=256, description="The conversation as shown.")
    response: StrictStr | None = Field(default=None, description="The answer as shown (may be partial or empty).")
    timings: FeedbackTimings = Field(default_factory=FeedbackTimings, description="Client-side timings of the answer.")
    comment: StrictStr | None = Field(default=None, max_length=2000, description="Optional free text.")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    415: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*[\[\]-].*)$")


def _shown(value: Any, limit: int = 80) -> str:
    """A short rendering of a client's value for an error message; never raises (huge ints, odd types)."""
    try:
        text = json.dumps(value, default=str)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text[:limit] + ("…" if len(text) > limit else "")


def _validation_error(exc: ValidationError) -> ApiError:
    parts, first_loc = [], None
    for err in exc.errors(include_url=False):
        # Union members add their type name ("str", "list[TextPart]") to the location; drop those
        # so the path reads like the JSON the client sent.
        loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p)))
        first_loc = first_loc or loc or None
        shown = "" if err["type"] == "missing" else f" (got {_shown(err.get('input'))})"
        parts.append(f"{loc or 'body'}: {err['msg']}{shown}")
    return ApiError(422, "; ".join(parts), param=first_loc, code="invalid_value")


# --------------------------------------------------------------------------------------------
# Admission: max_concurrency running, max_queue waiting, 429 beyond
# --------------------------------------------------------------------------------------------


class QueueFull(Exception):
    pass


class Admission:
    """Slots and a FIFO queue, driven from the event loop thread only (so no locks)."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self, timeout: float) -> None:
        """Take a slot, waiting at most `timeout` s; QueueFull at once if the queue is full."""
        if self.active < self.max_active and not self.waiting:
            self.active += 1
            return
        if self.waiting >= self.max_queue:
            raise QueueFull
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # a slot was handed over just as we gave up: pass it on
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        # Hand the slot straight to the oldest waiter (active stays the same), else free it.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class Metrics:
    """Prometheus collectors in a registry owned by one app (several apps can share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "edgeflow_request_duration_seconds",
            "Arrival to last byte of admitted generation requests.",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120),
            registry=r,
        )
        self.queue_time = Histogram(
            "edgeflow_queue_time_seconds",
            "Time an admitted request waited for a generation slot.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60),
            registry=r,
        )
        self.ttft = Histogram(
            "edgeflow_time_to_first_token_seconds",
            "Arrival to first generated token (queueing and prefill included).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30),
            registry=r,
        )
        self.tpot = Histogram(
            "edgeflow_time_per_output_token_seconds",
            "Mean inter-token time of a request (decode speed), after the first token.",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1),
            registry=r,
        )
        self.prompt_tokens = Counter("edgeflow_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("edgeflow_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "edgeflow_requests", "Finished generation requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.received = Counter(
            "edgeflow_requests_received", "Generation requests received (before validation and admission).", ["endpoint"], registry=r
        )
        self.device_memory = Gauge(
            "edgeflow_device_memory_used_bytes",
            "Memory the engine holds: the backend's device_memory_used hook (GPU), else this process's RSS "
            "(on Jetson, GPU and CPU share the same DRAM).",
            registry=r,
        )
        self.in_flight = Gauge("edgeflow_requests_in_flight", "Generations holding a slot (running).", registry=r)
        self.queue_depth = Gauge("edgeflow_queue_depth", "Requests waiting for a slot.", registry=r)
        self.engine = Info("edgeflow_engine", "The engine being served.", registry=r)
        self.feedback = Counter(
            "edgeflow_feedback", "Feedback sent from the chat page, by kind.", ["kind"], registry=r
        )
        self.restarts = Gauge(
            "edgeflow_server_restarts",
            "Times the supervisor restarted this server (watchdog exits and crashes) since the deploy started it.",
            registry=r,
        )


# --------------------------------------------------------------------------------------------
# Engine runtime: tokenizer, session, warm-up, health probe
# --------------------------------------------------------------------------------------------

_VERSION_RE = re.compile(r"^\d+(\.\d+)+\S*$")


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class DeadlineExceeded(Exception):
    pass


class EngineFailed(Exception):
    pass


# generation_config.json keys that set a request's defaults (vLLM's `--generation-config auto` set).
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(engine_dir: Path) -> dict[str, Any]:
    """Sampling defaults from the engine's generation_config.json (copied from the checkpoint at build).

    Only keys present are taken; `do_sample: false` there means greedy (its temperature is ignored).
    A missing or unreadable file means greedy defaults; a value out of range is refused at startup."""
    path = Path(engine_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    out = {k: cfg[k] for k in _GENERATION_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)}
    if cfg.get("do_sample") is False:
        out.pop("temperature", None)
        out.pop("top_p", None)
        out.pop("top_k", None)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; fix the file or remove the key") from None
    return out


class Runtime:
    """The loaded engine plus what the HTTP layer needs to talk to it."""

    def __init__(self, engine_dir: Path, settings: ServerSettings) -> None:
        from serving.tokenizer import LightTokenizer
        from tasks.engines import get_backend

        self.engine_dir = Path(engine_dir)
        meta_path = self.engine_dir / "engine.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{self.engine_dir}: no engine.json; not an engine directory (build one first)")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        built_for = self.meta.get("backend")
        if settings.backend is None:
            settings = settings.model_copy(update={"backend": built_for})
        if built_for != settings.backend:
            raise ValueError(
                f"{meta_path}: engine backend is {built_for!r} but the server is configured with backend={settings.backend!r}"
            )
        self.backend: ModuleType = get_backend(settings.backend)
        self.settings = settings
        # The tokenizer is cheap to load and needed to validate requests, so it loads here; the
        # engine session loads in the background (`load`) so /ready can say 503 meanwhile.
        # LightTokenizer, not transformers: importing transformers alone adds ~500 MB (torch) to the server.
        self.tokenizer = LightTokenizer(self.engine_dir)
        self.stop_ids = self._stop_ids()
        self.engine_version = settings.engine_version or self._default_engine_version()
        self.runtime_versions = {
            k: v for k, v in sorted(self.meta.items()) if isinstance(v, str) and _VERSION_RE.match(v)
        }
        self.created = int(meta_path.stat().st_mtime)
        self.session: Any = None
        self.state = "loading"
        self.reason = "engine is loading"
        self.probe_ids = self.tokenizer("Hello", add_special_tokens=False)["input_ids"] or [self.stop_ids[0]]
        self.sampling_support: frozenset[str] = self.backend.sampling_support()
        self.sampling_defaults = generation_defaults(self.engine_dir)
        self.executor = ThreadPoolExecutor(max_workers=settings.max_concurrency + 1, thread_name_prefix="engine")
        self._probe: asyncio.Future | None = None
        self.watchdog = Watchdog(settings.watchdog_stall_s)

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int],
                 sampling: SamplingParams | None = None) -> Iterator[int]:
        """`backend.generate`, with the watchdog told about every token; every engine call goes through here."""
        call = self.watchdog.begin()
        gen = self.backend.generate(self.session, input_ids, max_new_tokens, stop_ids, sampling)
        stall_after = self.settings.fault_stall_after_tokens
        try:
            for i, token in enumerate(gen):
                if stall_after is not None and i >= stall_after:
                    threading.Event().wait()  # chaos: hang the way a stuck kernel does (never returns)
                self.watchdog.progress(call)
                yield token
        finally:
            self.watchdog.end(call)
            close = getattr(gen, "close", None)
            if close:
                close()

    def _stop_ids(self) -> list[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        # <|endoftext|> ends base-model text even when the chat eos is <|im_end|>.
        eot = self.tokenizer.get_vocab().get("<|endoftext|>")
        if eot is not None:
            ids.add(int(eot))
        if not ids:
            raise ValueError(f"{self.engine_dir}: tokenizer has no eos_token and no <|endoftext|>; cannot stop generation")
        return sorted(ids)

    def _default_engine_version(self) -> str:
        if self.meta.get("engine_version"):
            return str(self.meta["engine_version"])
        sha = self.meta.get("checkpoint_sha256")
        return f"{self.meta['backend']}-{sha[:12]}" if sha else str(self.meta["backend"])

    def engine_info(self) -> dict[str, Any]:
        return {"backend": self.meta["backend"], "runtime": self.runtime_versions, "engine_version": self.engine_version,
                "sampling_defaults": self.sampling_defaults, "sampling_support": sorted(self.sampling_support)}

    async def load(self) -> None:
        """Load the session and run one warm-up generation, then mark ready (or failed, with why)."""
        loop = asyncio.get_running_loop()
        try:
            self.session = await loop.run_in_executor(self.executor, self.backend.load, self.engine_dir)
            warm = await loop.run_in_executor(self.executor, self._generate_n, 2)
            log.info("engine %s ready (warm-up produced %d tokens)", self.engine_version, warm)
            self.state, self.reason = "ready", "ready"
        except Exception as e:  # noqa: BLE001 - any load failure must show up in /ready and /health
            log.exception("engine load failed")
            self.state, self.reason = "failed", f"engine load failed: {type(e).__name__}: {e}"

    def _generate_n(self, n: int) -> int:
        # No stop ids: the probe must exercise a real decode step even if the model would stop.
        gen = self.generate(list(self.probe_ids), n, [])
        try:
            return len(list(itertools.islice(gen, n)))
        finally:
            gen.close()

    async def probe(self) -> float:
        """One-token generation in the engine executor; seconds taken. Single flight: concurrent
        probes share one run, and a probe still stuck from before is awaited, not duplicated."""
        if self.state != "ready":
            raise EngineFailed(self.reason)
        if self._probe is None or self._probe.done():
            loop = asyncio.get_running_loop()

            def timed() -> float:
                t0 = time.monotonic()
                if self._generate_n(1) != 1:
                    raise RuntimeError("engine produced no token for the health probe")
                return time.monotonic() - t0

            self._probe = loop.run_in_executor(self.executor, timed)
        try:
            return await asyncio.wait_for(asyncio.shield(self._probe), self.settings.health_timeout_s)
        except TimeoutError:
            raise EngineFailed(
                f"engine did not produce a token within health_timeout_s={self.settings.health_timeout_s}"
            ) from None
        except Exception as e:  # noqa: BLE001
            raise EngineFailed(f"health probe failed: {type(e).__name__}: {e}") from None

    def device_memory_used(self) -> float:
        """Bytes the engine holds: a backend hook where the device has its own memory, else process RSS."""
        hook = getattr(self.backend, "device_memory_used", None)
        if hook is not None and self.session is not None:
            with contextlib.suppress(Exception):
                return float(hook(self.session))
        return float(psutil.Process().memory_info().rss)

    def device_utilization(self) -> float | None:
        # Optional backend hook (GPU backends may report utilisation); absent means "not applicable".
        hook = getattr(self.backend, "device_utilization", None)
        if hook is None or self.session is None:
            return None
        with contextlib.suppress(Exception):
            return hook(self.session)
        return None


# --------------------------------------------------------------------------------------------
# One generation: worker thread -> asyncio queue -> consumer
# --------------------------------------------------------------------------------------------


class Generation:
    """Runs `backend.generate` in a worker thread and hands tokens to the event loop.

    The thread checks `cancel` after every token, so a cancelled generation (client gone,
    deadline) stops at its next token; `on_done` runs on the loop once the thread has exited.
    """

    def __init__(
        self,
        runtime: Runtime,
        input_ids: list[int],
        max_new_tokens: int,
        deadline: float,
        on_done: Callable[[], None],
        sampling: SamplingParams | None = None,
    ) -> None:
        self.runtime = runtime
        self.sampling = sampling
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.deadline = deadline
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_done = on_done
        self.token_times: list[float] = []

    def start(self) -> None:
        self.runtime.executor.submit(self._run)

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, reason: str) -> None:
        """End the consumer with an engine error now, even if the engine thread is stuck."""
        self.cancelled.set()
        self._post(("error", reason))

    def _post(self, item: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def _run(self) -> None:
        gen = None
        try:
            gen = self.runtime.generate(self.input_ids, self.max_new_tokens, self.runtime.stop_ids, self.sampling)
            for token in gen:
                if self.cancelled.is_set():
                    break
                self._post(("token", token, time.monotonic()))  # an int, or a Token carrying logprobs
                if time.monotonic() >= self.deadline:
                    self._post(("timeout",))
                    break
        except Exception as e:  # noqa: BLE001 - reported to the client as an engine error
            log.exception("generation failed")
            self._post(("error", f"{type(e).__name__}: {e}"))
        finally:
            if gen is not None and hasattr(gen, "close"):
                with contextlib.suppress(Exception):
                    gen.close()
            self._post(("end",))
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.on_done)

    async def tokens(self) -> AsyncIterator[int]:
        """Token ids as produced; DeadlineExceeded past the deadline, EngineFailed on engine errors."""
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                # Waiting here (not only in the thread) bounds the wait even if one engine step hangs.
                item = await asyncio.wait_for(self.events.get(), remaining)
            except TimeoutError:
                self.cancel()
                raise DeadlineExceeded from None
            kind = item[0]
            if kind == "token":
                self.token_times.append(item[2])
                yield item[1]
            elif kind == "timeout":
                raise DeadlineExceeded
            elif kind == "error":
                raise EngineFailed(item[1])
            else:
                return


# --------------------------------------------------------------------------------------------
# Per-request bookkeeping: metrics + access log, exactly once
# --------------------------------------------------------------------------------------------


class RequestRecord:
    def __init__(self, app_state: AppState, endpoint: str, prefix: str) -> None:
        self.state = app_state
        self.endpoint = endpoint
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.started = time.monotonic()
        self.created = int(time.time())
        self.model: str | None = None
        self.input: Any = None
        self.input_key = "messages" if endpoint == CHAT_ENDPOINT else "prompt"
        self.prompt_tokens: int | None = None
        self.completion_tokens = 0
        self.response: str | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.admitted = False
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.done = False
        self.condensed_turns = 0
        self.conversation_id: str | None = None

    def token(self, t: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = t
            self.state.metrics.ttft.observe(max(0.0, t - self.started))
        self.last_token_at = t
        self.completion_tokens += 1

    def finish(self, status: int) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        m = self.state.metrics
        m.requests.labels(endpoint=self.endpoint, status=str(status)).inc()
        if self.admitted:
            m.request_duration.labels(endpoint=self.endpoint).observe(now - self.started)
            m.prompt_tokens.inc(self.prompt_tokens or 0)
            m.generation_tokens.inc(self.completion_tokens)
            if self.completion_tokens > 1 and self.first_token_at is not None and self.last_token_at is not None:
                m.tpot.observe((self.last_token_at - self.first_token_at) / (self.completion_tokens - 1))
        if self.state.access_log is not None:
            self.state.log(
                {
                    "ts": _utc_now(),
                    "id": self.id,
                    "kind": "request",
                    "conversation_id": self.conversation_id,
                    "endpoint": self.endpoint,
                    "model": self.model,
                    "engine_version": self.state.runtime.engine_version,
                    self.input_key: self.input,
                    "response": self.response,
                    "finish_reason": self.finish_reason,
                    "status": status,
                    "error": self.error,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "condensed_turns": self.condensed_turns,
                    "ttft_ms": None if self.first_token_at is None else round((self.first_token_at - self.started) * 1000, 2),
                    "duration_ms": round((now - self.started) * 1000, 2),
                }
            )

    def fail(self, err: ApiError) -> JSONResponse:
        self.error = err.message
        self.finish(err.status)
        return err.response()


class AppState:
    def __init__(self, runtime: Runtime, settings: ServerSettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.metrics = Metrics()
        self.admission = Admission(settings.max_concurrency, settings.max_queue)
        self.access_log = (
            AccessLog(settings.access_log, settings.access_log_max_bytes, settings.access_log_backups)
            if settings.access_log
            else None
        )
        self.generations: set[Generation] = set()
        self.metrics.in_flight.set_function(lambda: self.admission.active)
        self.metrics.queue_depth.set_function(lambda: self.admission.waiting)
        self.metrics.device_memory.set_function(runtime.device_memory_used)
        self.metrics.engine.info(
            {"backend": runtime.meta["backend"], "engine_version": runtime.engine_version, "model": settings.model_name or ""}
        )
        restarts = os.environ.get("EDGEFLOW_SERVER_RESTARTS", "0")
        self.metrics.restarts.set(int(restarts) if restarts.isdigit() else 0)

    # The fields of a record that carry client or model text (ids, timings and versions carry none).
    TEXT_FIELDS = ("messages", "prompt", "response", "error", "comment")

    def log(self, record: dict[str, Any]) -> None:
        """Write one access-log record, PII and secrets scrubbed first (tasks.pii) unless scrub_access_log
        is off: raw prompts never rest on the device. What was replaced is counted in `pii_scrubbed`."""
        if self.access_log is None:
            return
        if self.settings.scrub_access_log:
            found: dict[str, int] = {}
            for key in self.TEXT_FIELDS:
                if record.get(key) is not None:
                    record[key], hits = scrub_value(record[key])
                    for kind, n in hits.items():
                        found[kind] = found.get(kind, 0) + n
            record["pii_scrubbed"] = found
        self.access_log.write(record)

    def engine_stalled(self, reason: str) -> None:
        """The watchdog fired: fail the probes and end every open generation with the reason."""
        self.runtime.state, self.runtime.reason = "failed", reason
        for gen in list(self.generations):
            gen.fail(reason)


# --------------------------------------------------------------------------------------------
# Request handling
# --------------------------------------------------------------------------------------------


MAX_JSON_DEPTH = 32  # the deepest request body the schemas have is 5 (messages[].content[].text)
_JSON_TYPES = ("application/json", "+json")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is too large for a float")
    return value


def _check_json(value: Any) -> None:
    """Refuse what json.loads lets through but no field can hold: lone surrogates (not Unicode text,
    they cannot be encoded back to UTF-8) and nesting deeper than MAX_JSON_DEPTH. Iterative: no recursion."""
    stack: list[tuple[Any, str, int]] = [(value, "body", 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels at {where}; flatten it",
                           code="invalid_json")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where}: text holds a lone UTF-16 surrogate (not valid Unicode); send UTF-8 text",
                               param=where if where != "body" else None, code="invalid_text") from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((k, where, depth + 1))
                stack.append((item, f"{where}.{k}" if where != "body" else str(k), depth + 1))
        elif isinstance(v, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(v))


async def _read_json(request: Request, limit: int, timeout_s: float) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and not any(ctype == t or ctype.endswith(t) for t in _JSON_TYPES):
        raise ApiError(415, f"Content-Type {ctype!r} is not JSON; send the body as application/json",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise ApiError(
            413, f"request body is {int(length)} bytes; the limit is max_body_bytes={limit}", code="request_too_large"
        )

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked uploads carry no Content-Length: stop reading at the limit
                raise ApiError(
                    413, f"request body exceeds {limit} bytes; the limit is max_body_bytes={limit}", code="request_too_large"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within request_timeout_s={timeout_s}", code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "client disconnected before the request body was complete", code="client_closed_request") from None
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not UTF-8 text: {e}; send UTF-8 JSON", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"request body nests too deep to parse; the limit is {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers past Python's 4300-digit limit
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    _check_json(body)
    return body


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _GenerationStream(StreamingResponse):
    """StreamingResponse that always runs `on_close` (cancel the generation, record the request),
    however the stream ends: normally, by client disconnect, or by the task being cancelled
    before the body iterator ever started (its own `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _handle(request: Request, state: AppState, endpoint: str) -> Response:
    chat = endpoint == CHAT_ENDPOINT
    s = state.settings
    rt = state.runtime
    rec = RequestRecord(state, endpoint, "chatcmpl" if chat else "cmpl")
    rec.conversation_id = (request.headers.get("x-conversation-id") or "")[:128] or None
    state.metrics.received.labels(endpoint=endpoint).inc()
    try:
        body = await _read_json(request, s.max_body_bytes, s.request_timeout_s)
        if isinstance(body, dict):  # so rejected requests are logged with what they asked for
            rec.model = body.get("model")
            rec.input = body.get(rec.input_key)
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        rec.model = req.model
        if chat:
            # as the model saw them: text parts joined (ingestion reads string content only)
            rec.input = [{"role": m.role, "content": m.text()} for m in req.messages]
        else:
            rec.input = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        if req.model != s.model_name:
            raise ApiError(
                404, f"model {req.model!r} does not exist; this server serves {s.model_name!r}", param="model",
                code="model_not_found",
            )
        max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
        name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens > s.max_tokens_limit:
            raise ApiError(
                400, f"{name}={max_tokens} exceeds this server's limit max_tokens_limit={s.max_tokens_limit}",
                param=name, code="max_tokens_exceeded",
            )
        if rt.state != "ready":
            raise ApiError(503, f"model not ready: {rt.reason}", code="not_ready", headers={"Retry-After": "5"})
        prompt_ids = _prompt_ids(rt, req, chat, rec)
        rec.prompt_tokens = len(prompt_ids)
        param = "messages" if chat else "prompt"
        if not prompt_ids:
            raise ApiError(400, "prompt is empty after tokenization; give at least one token", param=param)
        if len(prompt_ids) > s.max_prompt_tokens:
            raise ApiError(
                400, f"prompt has {len(prompt_ids)} tokens; the limit is max_prompt_tokens={s.max_prompt_tokens}",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is None:
            # OpenAI defaults: completions 16 tokens; chat "as many as fit", capped by our limit.
            max_tokens = 16 if not chat else s.max_tokens_limit
            max_tokens = min(max_tokens, s.max_context - len(prompt_ids))
        elif len(prompt_ids) + max_tokens > s.max_context:
            raise ApiError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + {name} ({max_tokens}) = {len(prompt_ids) + max_tokens} "
                f"exceeds the context limit max_context={s.max_context}",
                param=name, code="context_length_exceeded",
            )
        sampling = _sampling(req, chat, rt)
        deadline = rec.started + s.request_timeout_s
        try:
            await state.admission.acquire(max(0.0, deadline - time.monotonic()))
        except QueueFull:
            raise ApiError(
                429,
                f"server is at capacity: {state.admission.active} generating (max_concurrency={s.max_concurrency}) "
                f"and {state.admission.waiting} waiting (max_queue={s.max_queue}); retry shortly",
                code="rate_limit_exceeded", headers={"Retry-After": "1"},
            ) from None
        except TimeoutError:
            raise ApiError(
                504, f"waited {time.monotonic() - rec.started:.1f} s for a generation slot; "
                f"request_timeout_s={s.request_timeout_s}", code="timeout",
            ) from None
        rec.admitted = True
        state.metrics.queue_time.observe(time.monotonic() - rec.started)
    except ApiError as e:
        return rec.fail(e)

    def released() -> None:
        state.admission.release()
        state.generations.discard(gen)

    gen = Generation(rt, prompt_ids, max_tokens, deadline, released, sampling)
    state.generations.add(gen)
    try:
        gen.start()
    except RuntimeError as e:  # executor shut down (server stopping)
        released()
        return rec.fail(ApiError(503, f"server is shutting down: {e}", code="shutting_down"))
    text = TextStream(rt.tokenizer, req.stop_strings())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _GenerationStream(
            _stream(state, rec, gen, text, chat, max_tokens, include_usage),
            on_close=lambda: (gen.cancel(), rec.finish(499)),
        )
    return await _complete(request, state, rec, gen, text, chat, max_tokens)


_REQUEST_SAMPLING = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty")


def _sampling(req: ChatRequest | CompletionRequest, chat: bool, rt: Runtime) -> SamplingParams:
    """The request's SamplingParams: what it asks, else generation_config.json's defaults, else greedy.
    A parameter the backend cannot honour is a 400 naming it and the backend (never silently greedy)."""
    asked = {k: getattr(req, k) for k in _REQUEST_SAMPLING if getattr(req, k) is not None}
    if req.n != 1:
        raise ApiError(
            400, f"n={req.n}: this server returns one choice per request (engine backend {rt.meta['backend']!r}); "
            f"send {req.n} requests, with different seeds for different answers", param="n", code="unsupported_parameter",
        )
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, f"top_logprobs={req.top_logprobs} needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
        if req.logprobs:
            asked["logprobs"], asked["top_logprobs"] = True, req.top_logprobs or 0
    elif req.logprobs is not None:
        asked["logprobs"], asked["top_logprobs"] = True, req.logprobs
    values = {**rt.sampling_defaults, **asked}
    if values.get("top_k") == -1:
        values["top_k"] = 0
    backend = rt.meta["backend"]
    for name in (f for f in asked if f not in rt.sampling_support):
        if name == "top_logprobs" and not asked[name]:
            continue
        raise ApiError(
            400, f"{name}={asked[name]!r} is not supported by this server's engine backend {backend!r} "
            f"(it honours {sorted(rt.sampling_support)}); leave {name} out", param=name, code="unsupported_parameter",
        )
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def _prompt_ids(rt: Runtime, req: ChatRequest | CompletionRequest, chat: bool, rec: RequestRecord) -> list[int]:
    # Tokenizer calls stay on the event loop thread: HF fast tokenizers are not safe to call
    # from several threads at once ("Already borrowed"), and a 1 MiB body encodes in ~0.1 s.
    tok = rt.tokenizer
    if chat:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        kept = condense(messages, rt.settings.history_turns, rt.settings.history_summary_chars)
        messages, rec.condensed_turns = kept.messages, kept.condensed_turns
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise ApiError(400, f"chat template rejected the messages: {e}", param="messages") from None
    else:
        text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _usage(rec: RequestRecord) -> dict[str, int]:
    p = rec.prompt_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": rec.completion_tokens, "total_tokens": p + rec.completion_tokens}


def _finish_reason(rec: RequestRecord, text: TextStream, max_tokens: int) -> str:
    return "stop" if text.stopped else "length" if rec.completion_tokens >= max_tokens else "stop"


class _Pieces:
    """Engine tokens -> pieces of text (serving.decoding), stopping the engine at a stop string; one
    loop for both the streaming and the non-streaming answer."""

    def __init__(self, rec: RequestRecord, gen: Generation, text: TextStream) -> None:
        self.rec, self.gen, self.text = rec, gen, text

    async def __aiter__(self) -> AsyncIterator[Piece]:
        async for token in self.gen.tokens():
            self.rec.token(self.gen.token_times[-1])
            piece = self.text.push(token)
            if piece is not None:
                yield piece
            if self.text.stopped:
                self.gen.cancel()  # the engine stops at its next token; the slot frees when it has
                return


def _logprobs(text: TextStream, piece: Piece, chat: bool, offset: int) -> dict[str, Any] | None:
    return chat_logprobs(text, piece.tokens) if chat else completion_logprobs(text, piece.tokens, offset)


async def _stream(
    state: AppState,
    rec: RequestRecord,
    gen: Generation,
    text: TextStream,
    chat: bool,
    max_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    model = state.settings.model_name
    fp = state.runtime.engine_version
    base = {"id": rec.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": rec.created,
            "model": model, "system_fingerprint": fp}
    extra = {"usage": None} if include_usage else {}

    def chunk(content: str | None, finish: str | None, role: bool = False, logprobs: Any = None) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"text": content or "", "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**base, "choices": [choice], **extra})

    status, parts, offset = 200, [], 0
    try:
        if chat:
            yield chunk("", None, role=True)  # OpenAI opens a chat stream with the role
        async for piece in _Pieces(rec, gen, text):
            lp = _logprobs(text, piece, chat, offset)
            offset += len(piece.text)
            if piece.text or lp:
                parts.append(piece.text)
                yield chunk(piece.text, None, logprobs=lp)
        tail = text.flush()
        parts.append(tail.text)
        rec.finish_reason = _finish_reason(rec, text, max_tokens)
        yield chunk(tail.text if tail.text else (None if chat else ""), rec.finish_reason,
                    logprobs=_logprobs(text, tail, chat, offset))
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(rec)})
    except DeadlineExceeded:
        status = 504
        rec.error = (
            f"generation exceeded request_timeout_s={state.settings.request_timeout_s} "
            f"after {rec.completion_tokens} tokens"
        )
        yield _sse(ApiError(504, rec.error, code="timeout").body())
    except EngineFailed as e:
        status = 500
        rec.error = f"engine error: {e}"
        yield _sse(ApiError(500, rec.error, code="engine_error").body())
    finally:
        # Also runs on disconnect (CancelledError/GeneratorExit): that exception skips the
        # rec.finish below, and the response's on_close records the request as 499 instead.
        rec.response = "".join(parts)
        gen.cancel()
    rec.finish(status)
    yield "data: [DONE]\n\n"


async def _complete(
    request: Request,
    state: AppState,
    rec: RequestRecord,
    gen: Generation,
    text: TextStream,
    chat: bool,
    max_tokens: int,
) -> Response:
    pieces: list[Piece] = []

    async def collect() -> None:
        async for piece in _Pieces(rec, gen, text):
            pieces.append(piece)
        pieces.append(text.flush())

    task = asyncio.create_task(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            # Nobody awaits a non-streaming answer of a client that left: stop generating.
            if await request.is_disconnected():
                gen.cancel()
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                rec.response = "".join(p.text for p in pieces)
                return rec.fail(ApiError(499, "client disconnected", code="client_closed_request"))
        task.result()
    except DeadlineExceeded:
        rec.response = "".join(p.text for p in pieces)
        return rec.fail(
            ApiError(
                504,
                f"generation exceeded request_timeout_s={state.settings.request_timeout_s} "
                f"after {rec.completion_tokens} tokens",
                code="timeout",
            )
        )
    except EngineFailed as e:
        rec.response = "".join(p.text for p in pieces)
        return rec.fail(ApiError(500, f"engine error: {e}", code="engine_error"))
    finally:
        gen.cancel()
    answer = "".join(p.text for p in pieces)
    rec.response = answer
    rec.finish_reason = _finish_reason(rec, text, max_tokens)
    logprobs = _logprobs(text, Piece(answer, [t for p in pieces for t in p.tokens]), chat, 0)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer}, "logprobs": logprobs,
                  "finish_reason": rec.finish_reason}
    else:
        choice = {"text": answer, "index": 0, "logprobs": logprobs, "finish_reason": rec.finish_reason}
    body = {
        "id": rec.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": rec.created,
        "model": state.settings.model_name,
        "system_fingerprint": state.runtime.engine_version,
        "choices": [choice],
        "usage": _usage(rec),
    }
    rec.finish(200)
    return JSONResponse(body)


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

    @app.post(CHAT_ENDPOINT)
    async def chat_completions(request: Request) -> Response:
        return await _handle_safely(request, state, CHAT_ENDPOINT)

    @app.post(COMPLETIONS_ENDPOINT)
    async def completions(request: Request) -> Response:
        return await _handle_safely(request, state, COMPLETIONS_ENDPOINT)

    def _model_card() -> dict[str, Any]:
        return {"id": settings.model_name, "object": "model", "created": runtime.created, "owned_by": "edgeflow"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> Response:
        if model_id != settings.model_name:
            return ApiError(404, f"model {model_id!r} does not exist; this server serves {settings.model_name!r}",
                            param="model", code="model_not_found").response()
        return JSONResponse(_model_card())

    @app.get("/health")
    async def health() -> JSONResponse:
        base = {"model": settings.model_name, "engine": runtime.engine_info(), "gpu_util": runtime.device_utilization()}
        try:
            took = await runtime.probe()
        except EngineFailed as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e), **base}, status_code=503)
        return JSONResponse(
            {
                "status": "healthy",
                **base,
                "probe_ms": round(took * 1000, 2),
                "in_flight": state.admission.active,
                "queue_depth": state.admission.waiting,
            }
        )

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if runtime.state == "ready":
            return JSONResponse({"status": "ready", "model": settings.model_name})
        return JSONResponse({"status": runtime.state, "reason": runtime.reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def chat_page() -> Response:
        page = (CHAT_PAGE.read_text(encoding="utf-8")
                .replace("{{MODEL}}", json.dumps(settings.model_name).replace("<", "\\u003c"))
                .replace("{{AUTH}}", "true" if keys else "false"))
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.post("/feedback")
    async def feedback(request: Request) -> JSONResponse:
        try:
            fb = Feedback.model_validate(await _read_json(request, settings.max_body_bytes, settings.request_timeout_s))
        except ValidationError as e:
            return _validation_error(e).response()
        except ApiError as e:
            return e.response()
        state.metrics.feedback.labels(kind=fb.feedback).inc()
        record_id = f"fb-{uuid.uuid4().hex}"
        if state.access_log is not None:
            state.log({
                "ts": _utc_now(), "id": record_id, "kind": "feedback", "engine_version": runtime.engine_version,
                "model": settings.model_name, **fb.model_dump(mode="json"),
            })
        return JSONResponse({"status": "recorded", "id": record_id, "access_log": state.access_log is not None})

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


async def _handle_safely(request: Request, state: AppState, endpoint: str) -> Response:
    try:
        return await _handle(request, state, endpoint)
    except Exception as e:  # noqa: BLE001 - never a bare 500 page: answer in the OpenAI error shape
        log.exception("unhandled error on %s", endpoint)
        rec = RequestRecord(state, endpoint, "err")
        return rec.fail(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))


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


if __name__ == "__main__":
    sys.exit(main())
