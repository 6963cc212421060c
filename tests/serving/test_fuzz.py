"""No client input yields a 5xx: the server's own OpenAPI schema, fuzzed by schemathesis against a live
server (positive and negative cases for every operation), then hand-picked pathological bodies sent raw.

Any 5xx, a request that hangs past its deadline, or a server that is not healthy afterwards fails.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import hypothesis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.helpers.live_server import LiveServer

MODEL = "fuzz-edge"
KEY = "fuzz-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 5.0  # the server's request_timeout_s: every answer must come well within it


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "access.jsonl"
    with LiveServer(engine_dir, model_name=MODEL, api_key=KEY, max_tokens_limit=4, max_prompt_tokens=64,
                    max_context=80, max_body_bytes=16 * 1024, max_concurrency=2, max_queue=4,
                    request_timeout_s=TIMEOUT_S, access_log=log) as s:
        yield s


OPERATIONS = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /v1/models/{model_id}",
              "GET /health", "GET /ready", "GET /metrics", "GET /", "POST /feedback"]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_schema_lists_every_operation(api_schema) -> None:
    assert sorted(r.ok().label for r in api_schema.get_all_operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis_finds_no_server_error(api_schema, server, label: str, mode) -> None:
    """Hypothesis cases from the server's own schema (schemathesis strategies, driven with @given here)."""
    operation = api_schema.find_operation_by_label(label)
    calls = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case) -> None:
        t0 = time.monotonic()
        response = case.call(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S + 10)
        assert time.monotonic() - t0 < TIMEOUT_S + 5, f"{case.method} {case.path} hung"
        calls.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # negative cases are impossible for an operation that takes no input
        assert mode == GenerationMode.NEGATIVE
    assert all(c < 500 for c in calls)
    assert calls or mode == GenerationMode.NEGATIVE


def _raw(server, data: bytes, read: bool = True, timeout: float = TIMEOUT_S + 10) -> int | None:
    """Send bytes on a fresh connection; the status code of the answer (None when the server just closes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        if not read:
            return None
        buf = b""
        while b"\r\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                return None
            buf += chunk
    return int(buf.split(b" ", 2)[1])


def _request(body: bytes, ctype: str = "application/json", path: str = "/v1/chat/completions",
             length: int | None = None) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            + (f"Content-Type: {ctype}\r\n" if ctype else "")
            + f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def _chat(content) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


PATHOLOGICAL = {
    "deep-array": b"[" * 7000 + b"]" * 7000,  # past the parser's recursion limit, within max_body_bytes
    "deep-array-over-size": b"[" * 100_000 + b"]" * 100_000,
    "deep-object": b'{"a":' * 2500 + b"1" + b"}" * 2500,
    "deep-but-parseable": json.dumps(_chat("x") | {"user": None}).replace('"user": null', '"user": ' + "[" * 200 + "]" * 200).encode(),
    "deep-messages": json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}).replace(
        '"text": "x"', '"text": ' + "[" * 100 + "]" * 100).encode(),
    "invalid-utf8": b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
    "overlong-utf8": b'{"model": "\xc0\xaf"}',
    "lone-surrogate": json.dumps(_chat("\\ud800")).replace("\\\\ud800", "\\ud800").encode(),
    "lone-low-surrogate-in-stop": json.dumps(_chat("hi") | {"stop": "X"}).replace('"X"', '"\\udc00"').encode(),
    "surrogate-pair-ok": json.dumps(_chat("\U0001f600")).encode(),
    "nul-bytes": json.dumps(_chat("a\u0000b")).encode(),
    "bom": b"\xef\xbb\xbf" + json.dumps(_chat("hi")).encode(),
    "huge-float": json.dumps(_chat("hi")).replace('"max_tokens": 2', '"max_tokens": 2, "temperature": 1e400').encode(),
    "huge-int": json.dumps(_chat("hi")).replace('"max_tokens": 2', '"max_tokens": ' + "9" * 5000).encode(),
    "big-int-seed": json.dumps(_chat("hi") | {"seed": 10**40}).encode(),
    "nan": json.dumps(_chat("hi")).replace('"max_tokens": 2', '"max_tokens": 2, "top_p": NaN').encode(),
    "negative-zero-temperature": json.dumps(_chat("hi") | {"temperature": -0.0}).encode(),
    "bool-as-int": json.dumps(_chat("hi") | {"max_tokens": True}).encode(),
    "content-number": json.dumps(_chat(12345)).encode(),
    "content-null": json.dumps(_chat(None)).encode(),
    "parts-wrong-type": json.dumps(_chat([{"type": "image_url", "image_url": {"url": "x"}}])).encode(),
    "many-stop-strings": json.dumps(_chat("hi") | {"stop": ["a"] * 1000}).encode(),
    "stop-all-chars": json.dumps(_chat("hi") | {"stop": ["\n", " ", "e", "a"]}).encode(),
    "top-level-array": b"[1, 2, 3]",
    "top-level-string": b'"hello"',
    "empty-object": b"{}",
    "trailing-garbage": json.dumps(_chat("hi")).encode() + b"}}}",
    "feedback-deep": b'{"feedback": "slow", "comment": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "feedback-huge-timing": b'{"feedback": "slow", "timings": {"ttft_ms": 1e400}}',
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_bodies_get_4xx(server, name) -> None:
    body = PATHOLOGICAL[name]
    path = "/feedback" if name.startswith("feedback") else "/v1/chat/completions"
    status = _raw(server, _request(body, path=path))
    want_ok = name in ("surrogate-pair-ok", "nul-bytes", "negative-zero-temperature", "stop-all-chars", "bom")
    assert status is not None and (status == 200 if want_ok else 400 <= status < 500), (name, status)


@pytest.mark.parametrize("ctype,status", [("text/plain", 415), ("multipart/form-data; boundary=x", 415),
                                          ("application/x-www-form-urlencoded", 415), ("", 200),
                                          ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200)])
def test_content_types(server, ctype, status) -> None:
    assert _raw(server, _request(json.dumps(_chat("hi")).encode(), ctype=ctype)) == status


def test_bodies_that_stop_midway(server) -> None:
    # declared 1000 bytes, sent 20, then silence: 408 at the deadline, not a hang and not a 500
    t0 = time.monotonic()
    assert _raw(server, _request(b'{"model": "fuzz-edge"', length=1000)) == 408
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    # declared 1000 bytes, sent 20, then the client hangs up: nothing to answer, the server stays up
    _raw(server, _request(b'{"model": "fuzz-edge"', length=1000), read=False)
    # a chunked body cut before its last chunk
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n").encode()
    _raw(server, head, read=False)
    assert _raw(server, head) in (400, 408)


def test_no_5xx_was_recorded_and_the_server_is_healthy(server) -> None:
    """Runs last in this module: after everything above, no 5xx in the server's own counters, every
    request was logged, and the deep probe passes."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    statuses = {s.labels["status"]: s.value for f in text_string_to_metric_families(text) if f.name == "edgeflow_requests"
                for s in f.samples if s.name == "edgeflow_requests_total"}
    assert statuses and not any(k.startswith("5") for k in statuses), statuses
    assert sum(v for k, v in statuses.items() if k.startswith("4")) > 50
    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    lines = server.settings.access_log.read_bytes().split(b"\n")  # records end in \n only (text may hold U+2028)
    assert lines[-1] == b"" and len(lines) > 50
    for line in lines[:-1]:
        json.loads(line)  # every record is valid JSON (no surrogate or NaN reached the log)
