"""The OpenAI wire format of the edge server: request schemas, the error shape, reading a JSON body, SSE framing.

    req = ChatRequest.model_validate(await read_json(request, limit, timeout_s)); asked = req.sampling_asked()

* Request schemas reject unknown fields (422): a client asking for e.g. logit_bias or tools must not get
  a plausible-looking answer that ignored it. Each schema says which of its fields ask for sampling
  (`sampling_asked`) and how it names its token budget (`max_tokens_asked`), so no handler branches on
  which endpoint it serves.
* Every error answer is `ApiError`: {"error": {"message", "type", "param", "code"}}, the message naming
  the field, the value, the limit and the fix.
* Bodies are read here, before any parsing, so a request gets 415/413/408/400 in that shape too.
"""
from __future__ import annotations

import asyncio
import json
import hashlib
import re
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import ClientDisconnect

from edgeflow.engines.sampling import MAX_TOP_LOGPROBS

# --------------------------------------------------------------------------------------------
# Request schemas
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

# The request fields that go to the engine's SamplingParams under their own name (logprobs are per schema).
REQUEST_SAMPLING = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty")


class GenerationRequest(_Request):
    # What /v1/chat/completions and /v1/completions requests share (a comment, not a docstring: pydantic
    # would put a docstring into the OpenAPI description of both subclasses).
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

    def max_tokens_asked(self) -> tuple[int | None, str]:
        """The token budget the request asks for (None: the endpoint's default) and the field it came from."""
        return self.max_tokens, "max_tokens"

    def sampling_asked(self) -> dict[str, Any]:
        """The sampling fields the request sets, as SamplingParams names; logprobs in this schema's own shape."""
        return {k: getattr(self, k) for k in REQUEST_SAMPLING if getattr(self, k) is not None}

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, rendered by the chat template.")
    max_completion_tokens: Annotated[StrictInt, Field(gt=0)] | None = Field(
        default=None, description="Newer OpenAI name for max_tokens."
    )
    logprobs: StrictBool | None = Field(default=None, description="Return each token's log-probability (the model's own distribution).")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="Most likely alternatives per token (needs logprobs: true).")

    def message_dicts(self) -> list[dict[str, str]]:
        """The messages as the model sees them: text parts joined (ingestion reads string content only)."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def max_tokens_asked(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return super().max_tokens_asked()

    def sampling_asked(self) -> dict[str, Any]:
        asked = super().sampling_asked()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, f"top_logprobs={self.top_logprobs} needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
        if self.logprobs:
            asked["logprobs"], asked["top_logprobs"] = True, self.top_logprobs or 0
        return asked


class CompletionRequest(GenerationRequest):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] = Field(
        description="Raw prompt text (a list of exactly one string is accepted too)."
    )
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5,
                                       description="Legacy: return logprobs and this many alternatives per token.")

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def sampling_asked(self) -> dict[str, Any]:
        asked = super().sampling_asked()
        if self.logprobs is not None:
            asked["logprobs"], asked["top_logprobs"] = True, self.logprobs
        return asked


class FeedbackTimings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, ge=0, description="Send to first token, as the browser saw it.")
    total_ms: float | None = Field(default=None, ge=0, description="Send to end of stream, as the browser saw it.")
    tokens: StrictInt | None = Field(default=None, ge=0, description="Completion tokens (from the stream's usage).")


# What a client-supplied identifier may be (a conversation or answer id): letters, digits and . _ : -, up to 128. The
# access log ships home for the nightly; an id is copied there as sent, unlike text, which the nightly scrubs, so
# anything else (an e-mail address, a phone number, a name) must not be stored as an id.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ID = re.compile(ID_PATTERN)


def logged_id(value: str | None) -> str | None:
    """A client's identifier as the access log keeps it: as sent when it matches ID_PATTERN, else a digest of it
    (`sha256:` and 16 hex digits: the same value links the same records, without its text)."""
    if not value:
        return None
    if _ID.fullmatch(value):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class Feedback(_Request):
    """What the chat page's buttons post: the verdict, the conversation and what the user waited."""

    feedback: Literal["wrong_answer", "slow", "no_response"] = Field(description="The button pressed.")
    request_id: StrictStr | None = Field(default=None, pattern=ID_PATTERN, description="id of the answer judged (links "
                                         "the request record): letters, digits and . _ : -, at most 128.")
    conversation_id: StrictStr | None = Field(default=None, pattern=ID_PATTERN, description="The page's conversation id: "
                                              "letters, digits and . _ : -, at most 128.")
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


def model_not_found(asked: str, served: str | None) -> ApiError:
    """404 for a model id this server does not serve (a request's `model`, or GET /v1/models/{id})."""
    return ApiError(404, f"model {asked!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*[\[\]-].*)$")


def _shown(value: Any, limit: int = 80) -> str:
    """A short rendering of a client's value for an error message; never raises (huge ints, odd types)."""
    try:
        text = json.dumps(value, default=str)
    except (ValueError, TypeError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text[:limit] + ("…" if len(text) > limit else "")


def validation_error(exc: ValidationError) -> ApiError:
    """422 naming every invalid field by its JSON path, with the value the client sent."""
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
# Request bodies and SSE
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


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The request's JSON body: 415 not JSON, 413 over `limit` bytes, 408 not arrived within `timeout_s`,
    499 client gone, 400 empty/invalid/too deep/lone surrogates."""
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


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
