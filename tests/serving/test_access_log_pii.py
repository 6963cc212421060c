"""The server scrubs each access-log record before writing it (edgeflow.pii); a flag keeps raw text."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.live_server import LiveServer

MODEL = "tiny-edge"
SECRET = "Call me on +49 151 23456789 or at jo.doe@example.com; my card is 4111 1111 1111 1111."


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]


@pytest.mark.parametrize("scrub", [True, False], ids=["scrubbed", "raw-for-debugging"])
def test_requests_and_feedback_are_logged_scrubbed(engine_dir, tmp_path, scrub: bool) -> None:
    log = tmp_path / "access.jsonl"
    with LiveServer(engine_dir, model_name=MODEL, access_log=log, max_tokens_limit=4, scrub_access_log=scrub) as s:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        bad = httpx.post(f"{s.url}/v1/chat/completions", json={**chat, "max_tokens": "two"}, timeout=60)
        assert bad.status_code == 422  # rejected requests are logged too (with what they asked for)
        fb = {"feedback": "wrong_answer", "messages": chat["messages"], "response": "ok", "comment": f"again: {SECRET}"}
        assert httpx.post(f"{s.url}/feedback", json=fb, timeout=60).status_code == 200
        prompt = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": SECRET, "max_tokens": 2}, timeout=60)
        assert prompt.status_code == 200
    text = log.read_text()
    records = _records(log)
    assert [r["kind"] for r in records] == ["request", "request", "feedback", "request"]
    if scrub:
        for secret in ("23456789", "jo.doe@example.com", "4111 1111 1111 1111"):
            assert secret not in text
        assert records[0]["messages"][0]["content"] == "Call me on [PHONE] or at [EMAIL]; my card is [CARD]."
        assert records[0]["pii_scrubbed"] == {"phone": 1, "email": 1, "card": 1}
        assert records[2]["comment"].startswith("again: Call me on [PHONE]")
        assert records[3]["prompt"].startswith("Call me on [PHONE]")
        assert "error" in records[1] and "4111" not in json.dumps(records[1])
    else:
        assert records[0]["messages"][0]["content"] == SECRET and "pii_scrubbed" not in records[0]
