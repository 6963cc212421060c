"""Requests for the edge server's tests: the served model's name, a chat body, and the table of bad requests with the
status and the words each answer must carry."""
from __future__ import annotations

MODEL = "tiny-edge"


def chat_body(content: str = "Say hello.", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


ERROR_CASES = [
    # (id, endpoint, body, status, words the message must contain)
    ("malformed-json", "chat", b'{"model": "tiny-edge", "messages": [', 400, ["JSON"]),
    ("empty-body", "chat", b"", 400, ["empty"]),
    ("body-too-large", "chat", chat_body("x" * 70_000), 413, ["max_body_bytes=65536"]),
    ("missing-messages", "chat", {"model": MODEL}, 422, ["messages"]),
    ("missing-model", "chat", {"messages": [{"role": "user", "content": "hi"}]}, 422, ["model"]),
    ("empty-messages", "chat", chat_body() | {"messages": []}, 422, ["messages"]),
    ("content-wrong-type", "chat", chat_body() | {"messages": [{"role": "user", "content": 5}]}, 422, ["content"]),
    ("max-tokens-string", "chat", chat_body(max_tokens="5"), 422, ["max_tokens"]),
    ("max-tokens-zero", "chat", chat_body(max_tokens=0), 422, ["max_tokens", "greater than 0"]),
    ("max-tokens-negative", "chat", chat_body(max_tokens=-3), 422, ["max_tokens"]),
    ("max-tokens-over-limit", "chat", chat_body(max_tokens=257), 400, ["max_tokens=257", "max_tokens_limit=256"]),
    ("prompt-too-long", "chat", chat_body("hello " * 400), 400, ["max_prompt_tokens=200"]),
    ("context-exceeded", "chat", chat_body("hello " * 120, max_tokens=200), 400, ["max_context=300"]),
    ("unknown-model", "chat", chat_body() | {"model": "gpt-4"}, 404, ["gpt-4", MODEL]),
    ("unsupported-field", "chat", chat_body(logit_bias={"1": 5}), 422, ["logit_bias"]),
    ("n-not-1", "chat", chat_body(n=2), 400, ["n=2", "one choice per request", "'cpu'"]),
    ("temperature-over-2", "chat", chat_body(temperature=2.5), 422, ["temperature", "less than or equal to 2"]),
    ("stop-too-many", "chat", chat_body(stop=["a", "b", "c", "d", "e"]), 422, ["stop"]),
    ("top-logprobs-alone", "chat", chat_body(top_logprobs=3), 400, ["top_logprobs=3", "logprobs: true"]),
    ("seed-not-int", "chat", chat_body(seed="1"), 422, ["seed"]),
    ("not-an-object", "chat", [1, 2], 422, ["body"]),
    ("completion-too-long", "completions", {"model": MODEL, "prompt": "hello " * 400}, 400, ["max_prompt_tokens=200"]),
    ("completion-over-limit", "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400,
     ["max_tokens_limit=256"]),
    ("completion-empty-prompt", "completions", {"model": MODEL, "prompt": ""}, 400, ["empty"]),
    ("completion-missing-prompt", "completions", {"model": MODEL}, 422, ["prompt"]),
]
