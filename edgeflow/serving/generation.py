"""The generation request path both OpenAI endpoints share: validate, admit, generate, answer (streamed
or not), and record the request exactly once.

    return await handle_safely(request, state, ChatCompletions())  # edgeflow.serving.chat; edgeflow.serving.completions alike

* An endpoint (edgeflow.serving.chat, edgeflow.serving.completions) is a `GenerationEndpoint`: its schema, how it turns a
  request into prompt text, its logprobs shape and the JSON of its choices. Everything else is here, once:
  limits, sampling resolution, admission, the token -> text loop, and what a deadline (504) or an engine
  error (500) becomes (`generation_error`), for streams and whole answers alike.
* `RequestRecord` is the per-request bookkeeping: metrics and one access-log line, exactly once however
  the request ends (499 client gone, 504 deadline, 500 engine error, the nginx/OpenAI conventions).
* The non-streaming answer is the concatenation of the very same pieces a stream sends, so both modes
  return identical text.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from edgeflow.serving.admission import admit
from edgeflow.serving.decoding import Piece, TextStream
from edgeflow.serving.protocol import ApiError, GenerationRequest, logged_id, model_not_found, read_json, sse, validation_error
from edgeflow.serving.runtime import DeadlineExceeded, EngineFailed, Generation, Runtime
from edgeflow.serving.state import AppState, utc_now
from edgeflow.engines.sampling import SamplingParams

if TYPE_CHECKING:
    from edgeflow.serving.settings import ServerSettings

log = logging.getLogger("edgeflow.serving")


class GenerationEndpoint(ABC):
    """One OpenAI generation endpoint: what differs between /v1/chat/completions and /v1/completions."""

    path: ClassVar[str]  # the route, also the `endpoint` label of metrics and access-log records
    id_prefix: ClassVar[str]  # answer ids are f"{id_prefix}-{uuid hex}"
    input_field: ClassVar[str]  # the request field holding the input: logged under this key, named by prompt errors
    schema: ClassVar[type[GenerationRequest]]
    answer_object: ClassVar[str]  # `object` of a whole answer
    chunk_object: ClassVar[str]  # `object` of a stream chunk

    @abstractmethod
    def logged_input(self, req: Any) -> Any:
        """The request's input as the access log records it."""

    @abstractmethod
    def prompt_text(self, rt: Runtime, req: Any, rec: RequestRecord) -> str:
        """The text the engine continues; ApiError when the request cannot be rendered."""

    @abstractmethod
    def default_max_tokens(self, settings: ServerSettings) -> int:
        """New tokens when the request names no budget (before capping to what fits in max_context)."""

    @abstractmethod
    def logprobs(self, text: TextStream, piece: Piece, offset: int) -> dict[str, Any] | None:
        """The logprobs object of `piece` (starting at character `offset` of the answer), or None."""

    @abstractmethod
    def chunk_choice(self, content: str | None, finish: str | None, logprobs: Any) -> dict[str, Any]:
        """The one choice of a stream chunk carrying `content` (None: no text)."""

    def opening_choices(self) -> list[dict[str, Any]]:
        """Choices of chunks sent before the first token (none unless the endpoint opens its streams)."""
        return []

    @abstractmethod
    def answer_choice(self, answer: str, finish: str, logprobs: Any) -> dict[str, Any]:
        """The one choice of a whole (non-streamed) answer."""


# --------------------------------------------------------------------------------------------
# Per-request bookkeeping: metrics + access log, exactly once
# --------------------------------------------------------------------------------------------


class RequestRecord:
    """One request's metrics and access-log line; `finish` records it once, whichever way it ended."""

    def __init__(self, app_state: AppState, endpoint: str, prefix: str, input_key: str) -> None:
        self.state = app_state
        self.endpoint = endpoint
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.started = time.monotonic()
        self.created = int(time.time())
        self.model: str | None = None
        self.input: Any = None
        self.input_key = input_key
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
                    "ts": utc_now(),
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


# --------------------------------------------------------------------------------------------
# Request handling
# --------------------------------------------------------------------------------------------


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


async def handle_safely(request: Request, state: AppState, api: GenerationEndpoint) -> Response:
    """`handle`, answering any unexpected error as a recorded 500 in the OpenAI error shape."""
    try:
        return await handle(request, state, api)
    except Exception as e:  # noqa: BLE001 - never a bare 500 page: answer in the OpenAI error shape
        log.exception("unhandled error on %s", api.path)
        rec = RequestRecord(state, api.path, "err", api.input_field)
        return rec.fail(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))


async def handle(request: Request, state: AppState, api: GenerationEndpoint) -> Response:
    """One generation request on `api`: body, schema, model, limits, sampling, admission, then the answer."""
    s = state.settings
    rt = state.runtime
    rec = RequestRecord(state, api.path, api.id_prefix, api.input_field)
    rec.conversation_id = logged_id(request.headers.get("x-conversation-id"))  # as sent only when it is id-shaped
    state.metrics.received.labels(endpoint=api.path).inc()
    try:
        body = await read_json(request, s.max_body_bytes, s.request_timeout_s)
        if isinstance(body, dict):  # so rejected requests are logged with what they asked for
            rec.model = body.get("model")
            rec.input = body.get(rec.input_key)
        try:
            req = api.schema.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        rec.model = req.model
        rec.input = api.logged_input(req)
        if req.model != s.model_name:
            raise model_not_found(req.model, s.model_name)
        max_tokens, name = req.max_tokens_asked()
        if max_tokens is not None and max_tokens > s.max_tokens_limit:
            raise ApiError(
                400, f"{name}={max_tokens} exceeds this server's limit max_tokens_limit={s.max_tokens_limit}",
                param=name, code="max_tokens_exceeded",
            )
        if rt.state != "ready":
            raise ApiError(503, f"model not ready: {rt.reason}", code="not_ready", headers={"Retry-After": "5"})
        # Tokenizer calls stay on the event loop thread: HF fast tokenizers are not safe to call
        # from several threads at once ("Already borrowed"), and a 1 MiB body encodes in ~0.1 s.
        prompt_ids = list(rt.tokenizer(api.prompt_text(rt, req, rec), add_special_tokens=False)["input_ids"])
        rec.prompt_tokens = len(prompt_ids)
        param = api.input_field
        if not prompt_ids:
            raise ApiError(400, "prompt is empty after tokenization; give at least one token", param=param)
        if len(prompt_ids) > s.max_prompt_tokens:
            raise ApiError(
                400, f"prompt has {len(prompt_ids)} tokens; the limit is max_prompt_tokens={s.max_prompt_tokens}",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(api.default_max_tokens(s), s.max_context - len(prompt_ids))
        elif len(prompt_ids) + max_tokens > s.max_context:
            raise ApiError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + {name} ({max_tokens}) = {len(prompt_ids) + max_tokens} "
                f"exceeds the context limit max_context={s.max_context}",
                param=name, code="context_length_exceeded",
            )
        sampling = request_sampling(req, rt)
        deadline = await admit(state.admission, rec.started, s.request_timeout_s)
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
    answer = _Answer(state, api, rec, gen, TextStream(rt.tokenizer, req.stop_strings()), max_tokens)
    if req.stream:
        return _GenerationStream(answer.stream(req.include_usage()), on_close=lambda: (gen.cancel(), rec.finish(499)))
    return await answer.complete(request)


def request_sampling(req: GenerationRequest, rt: Runtime) -> SamplingParams:
    """The request's SamplingParams: what it asks, else generation_config.json's defaults, else greedy.
    A parameter the backend cannot honour is a 400 naming it and the backend (never silently greedy)."""
    if req.n != 1:
        raise ApiError(
            400, f"n={req.n}: this server returns one choice per request (engine backend {rt.meta['backend']!r}); "
            f"send {req.n} requests, with different seeds for different answers", param="n", code="unsupported_parameter",
        )
    asked = req.sampling_asked()
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


def generation_error(e: DeadlineExceeded | EngineFailed, rec: RequestRecord, timeout_s: float) -> ApiError:
    """What a generation that ended early answers: 504 past the deadline, 500 on an engine error."""
    if isinstance(e, DeadlineExceeded):
        return ApiError(504, f"generation exceeded request_timeout_s={timeout_s} after {rec.completion_tokens} tokens",
                        code="timeout")
    return ApiError(500, f"engine error: {e}", code="engine_error")


class _Answer:
    """The answer to one admitted request, streamed (`stream`) or whole (`complete`): both take their
    text from the same loop (`pieces`) and end early the same way (`generation_error`)."""

    def __init__(self, state: AppState, api: GenerationEndpoint, rec: RequestRecord, gen: Generation,
                 text: TextStream, max_tokens: int) -> None:
        self.state, self.api, self.rec, self.gen, self.text, self.max_tokens = state, api, rec, gen, text, max_tokens

    async def pieces(self) -> AsyncIterator[Piece]:
        """Engine tokens -> pieces of text (edgeflow.serving.decoding), stopping the engine at a stop string."""
        async for token in self.gen.tokens():
            self.rec.token(self.gen.token_times[-1])
            piece = self.text.push(token)
            if piece is not None:
                yield piece
            if self.text.stopped:
                self.gen.cancel()  # the engine stops at its next token; the slot frees when it has
                return

    def _finish_reason(self) -> str:
        return "stop" if self.text.stopped else "length" if self.rec.completion_tokens >= self.max_tokens else "stop"

    def _usage(self) -> dict[str, int]:
        p = self.rec.prompt_tokens or 0
        return {"prompt_tokens": p, "completion_tokens": self.rec.completion_tokens, "total_tokens": p + self.rec.completion_tokens}

    def _error(self, e: DeadlineExceeded | EngineFailed) -> ApiError:
        return generation_error(e, self.rec, self.state.settings.request_timeout_s)

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        api, rec, text = self.api, self.rec, self.text
        base = {"id": rec.id, "object": api.chunk_object, "created": rec.created,
                "model": self.state.settings.model_name, "system_fingerprint": self.state.runtime.engine_version}
        extra = {"usage": None} if include_usage else {}

        def chunk(choice: dict[str, Any]) -> str:
            return sse({**base, "choices": [choice], **extra})

        status, parts, offset = 200, [], 0
        try:
            for choice in api.opening_choices():
                yield chunk(choice)
            async for piece in self.pieces():
                lp = api.logprobs(text, piece, offset)
                offset += len(piece.text)
                if piece.text or lp:
                    parts.append(piece.text)
                    yield chunk(api.chunk_choice(piece.text, None, lp))
            tail = text.flush()
            parts.append(tail.text)
            rec.finish_reason = self._finish_reason()
            yield chunk(api.chunk_choice(tail.text or None, rec.finish_reason, api.logprobs(text, tail, offset)))
            if include_usage:
                yield sse({**base, "choices": [], "usage": self._usage()})
        except (DeadlineExceeded, EngineFailed) as e:
            err = self._error(e)
            status, rec.error = err.status, err.message
            yield sse(err.body())
        finally:
            # Also runs on disconnect (CancelledError/GeneratorExit): that exception skips the
            # rec.finish below, and the response's on_close records the request as 499 instead.
            rec.response = "".join(parts)
            self.gen.cancel()
        rec.finish(status)
        yield "data: [DONE]\n\n"

    async def complete(self, request: Request) -> Response:
        api, rec, gen, text = self.api, self.rec, self.gen, self.text
        pieces: list[Piece] = []

        async def collect() -> None:
            async for piece in self.pieces():
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
        except (DeadlineExceeded, EngineFailed) as e:
            rec.response = "".join(p.text for p in pieces)
            return rec.fail(self._error(e))
        finally:
            gen.cancel()
        answer = "".join(p.text for p in pieces)
        rec.response = answer
        rec.finish_reason = self._finish_reason()
        logprobs = api.logprobs(text, Piece(answer, [t for p in pieces for t in p.tokens]), 0)
        body = {
            "id": rec.id,
            "object": api.answer_object,
            "created": rec.created,
            "model": self.state.settings.model_name,
            "system_fingerprint": self.state.runtime.engine_version,
            "choices": [api.answer_choice(answer, rec.finish_reason, logprobs)],
            "usage": self._usage(),
        }
        rec.finish(200)
        return JSONResponse(body)
