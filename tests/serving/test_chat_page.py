"""The chat page in a real headless Chromium: type, watch tokens stream, click feedback, find the record."""
from __future__ import annotations

import json

import pytest

from tests.helpers.live_server import LiveServer
from tests.helpers.browser import CHROMIUM, CHROMIUM_ARGS
from tests.helpers.require import require_browser

MODEL = "tiny-edge"


@pytest.fixture(scope="module")
def browser():
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_type_see_tokens_stream_click_feedback_and_find_the_record(browser, engine_dir, tmp_path):
    access = tmp_path / "access.jsonl"
    with LiveServer(engine_dir, model_name=MODEL, access_log=access, max_tokens_limit=40) as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=30_000)
        assert page.text_content("#model") == MODEL
        # Record every change of the answer's text as it happens, from inside the page.
        page.evaluate("""() => {
            window.samples = [];
            new MutationObserver(() => {
                const el = document.querySelector('.assistant .text');
                if (el) window.samples.push([performance.now(), el.textContent.length]);
            }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
        }""")
        page.fill("#input", "Tell me about green tea.")
        page.keyboard.press("Enter")
        page.wait_for_selector(".assistant[data-state='done']", timeout=60_000)

        samples = page.evaluate("window.samples")
        lengths = sorted({n for _, n in samples if n > 0})
        # streamed: the answer grew in many visible steps over time, not in one final paint
        assert len(lengths) >= 5, samples
        grow = [t for t, n in samples if n > 0]
        assert grow[-1] - grow[0] > 0, samples
        shown = page.text_content(".assistant .text")
        request_id = page.get_attribute(".assistant", "data-request-id")
        assert shown and request_id.startswith("chatcmpl-")
        assert "first token" in page.text_content(".assistant .timings")

        page.click(".assistant button[data-kind='wrong_answer']")
        page.wait_for_selector(".feedback-status", timeout=10_000)
        assert page.text_content(".feedback-status") == "thanks, recorded"
        assert page.is_disabled(".assistant button[data-kind='slow']")  # one verdict per answer
        page.close()

    records = [json.loads(line) for line in access.read_text().splitlines()]
    request = next(r for r in records if r["id"] == request_id)
    feedback = next(r for r in records if r["kind"] == "feedback")
    assert request["kind"] == "request" and request["status"] == 200 and request["response"] == shown
    assert request["messages"] == [{"role": "user", "content": "Tell me about green tea."}]
    assert feedback["feedback"] == "wrong_answer" and feedback["request_id"] == request_id
    assert feedback["conversation_id"] == request["conversation_id"] and feedback["conversation_id"].startswith("conv-")
    assert feedback["response"] == shown and feedback["messages"] == request["messages"]
    assert feedback["timings"]["ttft_ms"] > 0 and feedback["timings"]["total_ms"] >= feedback["timings"]["ttft_ms"]
    assert feedback["timings"]["tokens"] == request["completion_tokens"]
    assert feedback["engine_version"] == request["engine_version"]


def test_the_page_works_with_a_key(browser, engine_dir, tmp_path):
    """A keyed server (probes too): the page asks for the key, then chats and records feedback with it."""
    key = "page-key-0123456789abcdef"
    access = tmp_path / "access.jsonl"
    with LiveServer(engine_dir, model_name=MODEL, access_log=access, max_tokens_limit=16, api_key=key,
                    auth_probes=True) as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('status').textContent === 'enter the API key'", timeout=30_000)
        assert page.is_visible("#key")
        page.fill("#key", "wrong-key-0123456789abcdef")
        page.dispatch_event("#key", "change")
        page.fill("#input", "Hello?")
        page.keyboard.press("Enter")
        page.wait_for_selector(".assistant[data-state='error']", timeout=30_000)
        assert "API key is not valid" in page.text_content(".assistant .text")
        page.fill("#key", key)
        page.dispatch_event("#key", "change")
        page.wait_for_function("document.getElementById('status').textContent === 'ready'", timeout=30_000)
        page.fill("#input", "Tell me about green tea.")
        page.keyboard.press("Enter")
        page.wait_for_selector(".assistant[data-state='done']", timeout=60_000)
        page.click(".assistant[data-state='done'] button[data-kind='slow']")
        page.wait_for_selector(".assistant[data-state='done'] .feedback-status", timeout=10_000)
        assert page.text_content(".assistant[data-state='done'] .feedback-status") == "thanks, recorded"
        page.close()
    kinds = [json.loads(line)["kind"] for line in access.read_text().splitlines()]
    assert kinds.count("request") == 1 and kinds.count("feedback") == 1  # the rejected request never reached the log
