"""API keys (edgeflow/serving/auth.py) on a live server: 401 in the OpenAI shape, probes by flag, keys from flag/file/env."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from edgeflow.serving.auth import KEY_ENV, load_keys
from tests.helpers.live_server import LiveServer

MODEL = "tiny-edge"
KEY = "test-key-0123456789abcdef"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_keys_from_flag_file_and_env(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# rotated 2026-12-01\nold-key-0123456789abcdef\n\n  new-key-0123456789abcdef  \n")
    keys = load_keys("flag-key-0123456789abcdef", f, {KEY_ENV: "env-key-0123456789abcdef"})
    assert keys == {"flag-key-0123456789abcdef", "old-key-0123456789abcdef", "new-key-0123456789abcdef", "env-key-0123456789abcdef"}
    assert load_keys(None, None, {}) == frozenset()


@pytest.mark.parametrize("content,match", [(None, "cannot read"), ("# only a comment\n", "holds no key"),
                                           ("short\n", "at least 16 characters")])
def test_bad_key_files_are_startup_errors(tmp_path, content, match) -> None:
    f = tmp_path / "keys"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_keys(None, f, {})


@pytest.fixture(scope="module")
def keyed(engine_dir):
    with LiveServer(engine_dir, model_name=MODEL, api_key=KEY, max_tokens_limit=8) as s:
        yield s


def test_v1_and_feedback_need_the_key(keyed) -> None:
    for method, path, body in [("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
                               ("POST", "/feedback", {"feedback": "slow"}), ("GET", "/v1/nowhere", None)]:
        for headers, why in [({}, "no API key"), ({"Authorization": "Bearer not-the-key-0123456789"}, "not valid"),
                             ({"Authorization": f"Basic {KEY}"}, "no API key")]:
            r = httpx.request(method, keyed.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and why in err["message"] and KEY not in r.text
            assert r.headers["www-authenticate"].startswith("Bearer")
    ok = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"X-Api-Key": KEY}, timeout=30).status_code == 200
    # probes and the page stay open without auth_probes; the 401s are counted
    for path in ("/health", "/ready", "/metrics", "/"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 200, path
    metrics = httpx.get(keyed.url + "/metrics", timeout=30).text
    assert 'edgeflow_requests_total{endpoint="/v1/chat/completions",status="401"} 3.0' in metrics
    assert "const AUTH = true;" in httpx.get(keyed.url + "/", timeout=30).text


def test_the_openai_client_with_and_without_the_key(keyed) -> None:
    import openai

    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong-key-0123456789abcdef", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)


def test_auth_probes_protects_health_ready_metrics(engine_dir, tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text(KEY + "\n")
    with LiveServer(engine_dir, model_name=MODEL, api_key_file=f, auth_probes=True) as s:
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(s.url + path, timeout=30).status_code == 401, path
            assert httpx.get(s.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
        assert httpx.get(s.url + "/", timeout=30).status_code == 200  # the page is static; it asks for the key


def test_cli_refuses_a_missing_key_file(engine_dir, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "edgeflow.serving.server", "--engine", str(engine_dir),
                        "--api-key-file", str(tmp_path / "absent")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key-file" in r.stderr and "cannot read" in r.stderr
