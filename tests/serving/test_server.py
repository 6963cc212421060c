"""Edge server tests against a real (tiny) engine: no mocks.

A 2-layer cut of the teacher (EDGEFLOW_TEST_TEACHER) is compiled by the CPU backend once per
session, and the server runs for real under uvicorn on a free 127.0.0.1 port in a background
thread. The 2-layer model writes gibberish, which is what we want: it rarely emits a stop token,
so long generations are easy to hold open for the concurrency and disconnect tests.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers.live_server import LiveServer
from tests.helpers.server import ERROR_CASES, MODEL, chat_body

# ---------------------------------------------------------------------------------------------
# Fixtures: live servers (the tiny engine is `engine_dir` in tests/conftest.py)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "access.jsonl"
    with LiveServer(
        engine_dir,
        model_name=MODEL,
        max_prompt_tokens=200,
        max_tokens_limit=256,
        max_context=300,
        max_body_bytes=64 * 1024,
        max_concurrency=2,
        max_queue=8,
        request_timeout_s=30,
        access_log=log,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tight(engine_dir, tmp_path_factory):
    """One slot, no queue, a short deadline: for 429, disconnect and timeout behaviour."""
    log = tmp_path_factory.mktemp("logs") / "access.jsonl"
    with LiveServer(
        engine_dir,
        model_name=MODEL,
        max_concurrency=1,
        max_queue=0,
        max_tokens_limit=2000,
        request_timeout_s=2.0,
        access_log=log,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _post(url: str, body, headers: dict[str, str] | None = None, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    r = httpx.post(url, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=30, **kw)
    assert not (r.status_code == 200 and not r.content), f"200 with an empty body from {url}"
    return r


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _wait_gauge(url: str, name: str, value: float, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if _metrics(url).get(name) == value:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach {value} within {within} s: {_metrics(url).get(name)}")


# ---------------------------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------------------------


def test_chat_streaming_matches_non_streaming(oai):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    stream = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert pieces, "no content chunk streamed"
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish in ("stop", "length")

    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    # Greedy decoding (no temperature asked, none in generation_config.json): both answers are the same text.
    assert full.choices[0].message.content == "".join(pieces)
    assert full.usage.completion_tokens == usage.completion_tokens
    assert full.model == MODEL and full.object == "chat.completion"


def test_completions_both_modes(oai):
    full = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12)
    assert full.object == "text_completion" and full.usage.completion_tokens > 0
    text = full.choices[0].text
    assert text
    pieces, usage = [], None
    for chunk in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        pieces.extend(c.text for c in chunk.choices)
    assert "".join(pieces) == text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completion_default_max_tokens_is_16(server):
    r = _post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "Once upon a time"})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= 16


def test_models(oai, server):
    ids = [m.id for m in oai.models.list()]
    assert ids == [MODEL]
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").status_code == 200
    assert httpx.get(f"{server.url}/v1/models/other").status_code == 404


def test_health_and_ready(server):
    r = httpx.get(f"{server.url}/health", timeout=15)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "healthy"
    assert body["engine"]["backend"] == "cpu" and body["engine"]["runtime"] and body["engine"]["engine_version"]
    assert "gpu_util" in body and body["gpu_util"] is None  # CPU engine: not applicable
    assert body["model"] == MODEL
    r = httpx.get(f"{server.url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_concurrent_requests_queue_and_all_succeed(server):
    before = _metrics(server.url)
    results = []

    def one(i):
        results.append(_post(f"{server.url}/v1/chat/completions", chat_body(f"Count to {i}.", max_tokens=8)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]  # 2 run, 2 queue
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [200] * 4
    after = _metrics(server.url)
    assert after["edgeflow_queue_time_seconds_count"] - before["edgeflow_queue_time_seconds_count"] == 4


def test_metrics_histograms_count_requests(server):
    before = _metrics(server.url)
    r = _post(f"{server.url}/v1/chat/completions", chat_body(max_tokens=6))
    assert r.status_code == 200
    after = _metrics(server.url)
    key = "edgeflow_request_duration_seconds_count{endpoint=/v1/chat/completions}"
    assert after[key] == before.get(key, 0) + 1
    for h in ("queue_time", "time_to_first_token", "time_per_output_token"):
        name = f"edgeflow_{h}_seconds_count"
        assert after[name] == before[name] + 1, name
    status_key = "edgeflow_requests_total{endpoint=/v1/chat/completions,status=200}"
    assert after[status_key] == before.get(status_key, 0) + 1
    usage = r.json()["usage"]
    assert after["edgeflow_prompt_tokens_total"] - before["edgeflow_prompt_tokens_total"] == usage["prompt_tokens"]
    assert (
        after["edgeflow_generation_tokens_total"] - before["edgeflow_generation_tokens_total"]
        == usage["completion_tokens"]
    )
    assert after["edgeflow_requests_in_flight"] == 0 and after["edgeflow_queue_depth"] == 0
    assert after["edgeflow_engine_info{backend=cpu,engine_version=%s,model=%s}" % (
        r.json()["system_fingerprint"], MODEL)] == 1


def test_access_log_line(server):
    body = chat_body("Name a colour.", max_tokens=5)
    r = _post(f"{server.url}/v1/chat/completions", body)
    assert r.status_code == 200
    answer = r.json()
    lines = [json.loads(x) for x in server.settings.access_log.read_text().splitlines()]
    rec = next(x for x in lines if x["id"] == answer["id"])
    assert rec["ts"].endswith("Z") and "T" in rec["ts"]
    assert rec["kind"] == "request" and rec["model"] == MODEL
    assert rec["engine_version"] == answer["system_fingerprint"]
    assert rec["messages"] == body["messages"]
    assert rec["response"] == answer["choices"][0]["message"]["content"]
    assert rec["status"] == 200
    assert rec["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert rec["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert rec["ttft_ms"] > 0 and rec["duration_ms"] >= rec["ttft_ms"]
    # Rejected requests are logged too, with their status.
    _post(f"{server.url}/v1/chat/completions", chat_body(max_tokens=10_000))
    last = json.loads(server.settings.access_log.read_text().splitlines()[-1])
    assert last["status"] == 400 and "max_tokens_limit" in last["error"]


def _long_chat(turns: int) -> list[dict[str, str]]:
    msgs = []
    for i in range(turns - 1):
        msgs += [{"role": "user", "content": "Is tea green?"}, {"role": "assistant", "content": "Yes, it is."}]
    return msgs + [{"role": "user", "content": "And coffee?"}]


def test_long_chats_keep_the_last_turns_and_condense_the_rest(server, engine_dir):
    """60 turns do not fit max_prompt_tokens=200; with history_turns=4 the server keeps 4 and summarises 56."""
    messages = _long_chat(60)
    r = _post(f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4},
              headers={"X-Conversation-Id": "conv-long"})
    assert r.status_code == 200, r.text
    rec = next(json.loads(x) for x in server.settings.access_log.read_text().splitlines() if r.json()["id"] in x)
    assert rec["condensed_turns"] == 56 and rec["conversation_id"] == "conv-long"
    # a conversation id that is not id-shaped is logged as its digest: the same value links the same records, its
    # text (here a phone number) is not kept
    ids = []
    for _ in range(2):
        r = _post(f"{server.url}/v1/chat/completions", chat_body("Name a fruit.", max_tokens=2),
                  headers={"X-Conversation-Id": "+49 30 1234567"})
        assert r.status_code == 200, r.text
        ids.append(next(json.loads(x) for x in server.settings.access_log.read_text().splitlines()
                        if r.json()["id"] in x)["conversation_id"])
    assert ids[0] == ids[1] and ids[0].startswith("sha256:") and len(ids[0]) == 23
    assert "1234567" not in server.settings.access_log.read_text()
    assert rec["messages"] == messages  # the log keeps what the client sent
    assert rec["prompt_tokens"] <= server.settings.max_prompt_tokens
    # a server keeping every turn refuses the same chat, naming the limit
    with LiveServer(engine_dir, model_name=MODEL, max_prompt_tokens=200, max_context=300, history_turns=1000) as full:
        r = _post(f"{full.url}/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4})
        assert r.status_code == 400 and "max_prompt_tokens=200" in r.json()["error"]["message"]


def test_feedback_lands_in_the_access_log_and_metrics(server):
    answer = _post(f"{server.url}/v1/chat/completions", chat_body("Name a fruit.", max_tokens=4)).json()
    before = _metrics(server.url).get("edgeflow_feedback_total{kind=slow}", 0)
    fb = {"feedback": "slow", "request_id": answer["id"], "conversation_id": "conv-1",
          "messages": [{"role": "user", "content": "Name a fruit."}], "response": answer["choices"][0]["message"]["content"],
          "timings": {"ttft_ms": 12.5, "total_ms": 80.0, "tokens": 4}}
    r = _post(f"{server.url}/feedback", fb)
    assert r.status_code == 200 and r.json()["status"] == "recorded" and r.json()["access_log"] is True
    rec = json.loads(server.settings.access_log.read_text().splitlines()[-1])
    assert rec["kind"] == "feedback" and rec["id"] == r.json()["id"]
    assert {k: rec[k] for k in fb} == fb and rec["engine_version"] == answer["system_fingerprint"]
    assert _metrics(server.url)["edgeflow_feedback_total{kind=slow}"] == before + 1
    # an identifier that is not id-shaped (here an e-mail address) is refused, naming the field, and never stored
    for field in ("conversation_id", "request_id"):
        pii = _post(f"{server.url}/feedback", {**fb, field: "jane.doe@example.com"})
        assert pii.status_code == 422 and field in pii.json()["error"]["message"], pii.text
    assert "jane.doe" not in server.settings.access_log.read_text()
    bad = _post(f"{server.url}/feedback", {**fb, "feedback": "meh"})
    assert bad.status_code == 422 and "feedback" in bad.json()["error"]["message"]
    assert _post(f"{server.url}/feedback", b"{").status_code == 400


def test_chat_page_is_served_with_the_model_name(server):
    r = httpx.get(f"{server.url}/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert f'const MODEL = "{MODEL}";' in r.text and "/feedback" in r.text


def test_access_log_rotation(tmp_path):
    import re

    from edgeflow.serving.access_log import AccessLog

    path = tmp_path / "a.jsonl"
    log = AccessLog(path, max_bytes=1024, backups=2)
    threads = [threading.Thread(target=lambda i=i: [log.write({"i": i, "j": j, "pad": "x" * 50}) for j in range(30)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    files = sorted(f for f in tmp_path.iterdir() if not f.name.startswith("."))  # .a.lock: the writers' lock
    # the active file and two immutable segments: retention keeps backups x max_bytes of unshipped segments
    assert [f.name for f in files][-1] == "a.jsonl" and len(files) == 3
    assert all(re.fullmatch(r"a-\d{8}T\d{6}Z-\d+\.jsonl", f.name) for f in files[:2]), files
    for f in files:
        assert f.stat().st_size <= 1024
        for line in f.read_text().splitlines():
            json.loads(line)  # never a torn line


def test_incremental_decoding_of_multibyte_text(engine_dir):
    """Byte-level BPE splits CJK/emoji over several tokens; the stream must never show U+FFFD."""
    from transformers import AutoTokenizer

    from edgeflow.serving.decoding import IncrementalDecoder

    tok = AutoTokenizer.from_pretrained(str(engine_dir))
    for text in ["你好世界🙂 café — ok", "🙂🙂🙂x", " naïve façade ✓"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        dec = IncrementalDecoder(tok)
        parts = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(parts) == text
        assert not any("\ufffd" in p for p in parts)


# ---------------------------------------------------------------------------------------------
# Errors: status, OpenAI shape, a message naming the limit, fast
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_cases(server, case):
    _, endpoint, body, status, words = case
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    t0 = time.monotonic()
    r = _post(f"{server.url}{path}", body)
    took = time.monotonic() - t0
    assert r.status_code == status, r.text
    assert took < 1.0, f"error answered in {took:.2f} s"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_chunked_body_over_limit_is_413(server):
    def gen():
        for _ in range(20):
            yield b"x" * 8192

    r = httpx.post(f"{server.url}/v1/chat/completions", content=gen(), timeout=10)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_get_endpoints_never_empty(server):
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        r = httpx.get(f"{server.url}{path}", timeout=15)
        assert r.status_code == 200 and r.content, path


def test_not_ready_before_engine_loads(engine_dir):
    """Without the lifespan (no load), everything that needs the engine says 503 with a reason."""
    from fastapi.testclient import TestClient

    from edgeflow.serving.app import ServerSettings, create_app

    client = TestClient(create_app(engine_dir, ServerSettings(model_name=MODEL)))  # not entered: no startup
    assert client.get("/ready").status_code == 503
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"]
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert r.status_code == 503 and r.headers["retry-after"] and "not ready" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------
# Concurrency, disconnects, deadlines (one slot, no queue, 2 s deadline)
# ---------------------------------------------------------------------------------------------


def _open_stream(client: httpx.Client, url: str, max_tokens: int = 2000):
    body = chat_body("Tell me a very long story.", max_tokens=max_tokens, stream=True)
    return client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30)


def test_429_when_full_and_disconnect_frees_slot(tight):
    with httpx.Client() as client, _open_stream(client, tight.url) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        for line in lines:  # wait until it is really generating (holds the only slot)
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                seen += 1
                if seen == 2:
                    break
        assert _metrics(tight.url)["edgeflow_requests_in_flight"] == 1
        t0 = time.monotonic()
        r = _post(f"{tight.url}/v1/chat/completions", chat_body(max_tokens=4))
        assert time.monotonic() - t0 < 1.0
        assert r.status_code == 429, r.text
        assert r.headers.get("retry-after")
        assert "max_concurrency=1" in r.json()["error"]["message"] and "max_queue=0" in r.json()["error"]["message"]
        t_close = time.monotonic()
    # Leaving the block closed the connection mid-stream: the generation must stop at its next
    # token and free the slot long before its 2000 tokens or the 2 s deadline.
    _wait_gauge(tight.url, "edgeflow_requests_in_flight", 0, within=1.0)
    print(f"slot freed {time.monotonic() - t_close:.3f} s after the client left")
    assert time.monotonic() - t_close < 1.0
    r = _post(f"{tight.url}/v1/chat/completions", chat_body(max_tokens=4))
    assert r.status_code == 200, r.text
    time.sleep(0.2)
    statuses = [json.loads(x)["status"] for x in tight.settings.access_log.read_text().splitlines()]
    assert 499 in statuses and 429 in statuses


def test_non_streaming_disconnect_frees_slot(tight):
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tight.url}/v1/chat/completions", json=chat_body("Keep talking.", max_tokens=2000), timeout=0.5)
    # The server polls for the disconnect every 0.25 s; well before the 2 s deadline the slot is free.
    _wait_gauge(tight.url, "edgeflow_requests_in_flight", 0, within=1.0)
    assert time.monotonic() - t0 < 1.8
    time.sleep(0.1)
    last = json.loads(tight.settings.access_log.read_text().splitlines()[-1])
    assert last["status"] == 499 and last["completion_tokens"] > 0


def test_deadline_non_streaming_is_504(tight):
    t0 = time.monotonic()
    r = _post(f"{tight.url}/v1/chat/completions", chat_body("Go on forever.", max_tokens=2000))
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text[:300]
    assert "request_timeout_s=2.0" in r.json()["error"]["message"]
    assert took < 4.0
    _wait_gauge(tight.url, "edgeflow_requests_in_flight", 0, within=1.0)


def test_deadline_streaming_ends_with_error_event(tight):
    t0 = time.monotonic()
    with httpx.Client() as client, _open_stream(client, tight.url) as resp:
        assert resp.status_code == 200
        events = _sse_events(resp.iter_lines())
    assert time.monotonic() - t0 < 4.0
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "request_timeout_s=2.0" in events[-2]["error"]["message"]
    assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
    _wait_gauge(tight.url, "edgeflow_requests_in_flight", 0, within=1.0)


def test_openai_client_raises_on_stream_error_event(tight):
    from openai import APIError, OpenAI

    client = OpenAI(base_url=f"{tight.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(APIError, match="request_timeout_s"):
        for _ in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Never stop."}], max_tokens=2000, stream=True
        ):
            pass


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_flags_map_to_settings():
    from edgeflow.serving.app import ServerSettings, build_parser, settings_from_args

    args = build_parser().parse_args(
        ["--engine", "e", "--port", "9000", "--model-name", "m", "--max-queue", "3", "--request-timeout-s", "1.5",
         "--access-log", "/tmp/x.jsonl"]
    )
    s = settings_from_args(args)
    assert (s.model_name, s.max_queue, s.request_timeout_s, str(s.access_log)) == ("m", 3, 1.5, "/tmp/x.jsonl")
    assert args.port == 9000
    # Every settings field has a description and a flag.
    flags = build_parser().format_help()
    for name, field in ServerSettings.model_fields.items():
        assert field.description, name
        assert "--" + name.replace("_", "-") in flags
    with pytest.raises(Exception):
        ServerSettings(max_prompt_tokens=3000, max_context=2560)
    with pytest.raises(Exception):
        ServerSettings(bogus=1)


def test_cli_refuses_a_non_engine_dir(tmp_path, capsys):
    from edgeflow.serving.app import main

    assert main(["--engine", str(tmp_path)]) == 2
    assert "engine.json" in capsys.readouterr().err


def test_deploy_smoke_chat_needs_a_finished_stream_with_tokens(server):
    """deploy-edge's smoke check: a complete stream with generated tokens passes whatever the text; a model
    name the server does not serve (an error answer) fails."""
    from edgeflow.device.health import smoke_chat

    answer = smoke_chat(server.url, MODEL, "Say hello.", max_tokens=4)
    assert isinstance(answer, str)
    with pytest.raises(httpx.HTTPStatusError):
        smoke_chat(server.url, "not-this-model", "Say hello.", max_tokens=4)


def test_backend_defaults_to_engine_json_and_a_named_one_must_match(engine_dir):
    """Without --backend the server runs the backend engine.json names; a different one is refused, naming both."""
    from edgeflow.serving.app import ServerSettings
    from edgeflow.serving.runtime import Runtime

    runtime = Runtime(engine_dir, ServerSettings(model_name=MODEL))
    assert runtime.settings.backend == json.loads((engine_dir / "engine.json").read_text())["backend"]
    with pytest.raises(ValueError, match=r"engine backend is 'cpu' but the server is configured with backend='cpu_native'"):
        Runtime(engine_dir, ServerSettings(model_name=MODEL, backend="cpu_native"))
