"""Sampling through the edge server with the openai client (a real tiny engine, edgeflow/engines/cpu_onnx).

Seeds reproduce, stop strings cut exactly (also across tokens, in a stream), penalties change the text,
top-k/top-p keep what they should, logprobs are the FP model's, and a parameter the engine's backend
cannot honour is a 400 naming it and the backend.
"""
from __future__ import annotations

import json
import math
import shutil

import httpx
import numpy as np
import pytest

from tests.helpers.live_server import LiveServer

MODEL = "tiny-edge"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server(engine_dir):
    with LiveServer(engine_dir, model_name=MODEL, max_tokens_limit=64, request_timeout_s=60) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _stream_text(oai, **kw) -> tuple[str, str | None, list[str]]:
    chunks, finish = [], None
    for chunk in oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            if choice.delta.content:
                chunks.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return "".join(chunks), finish, chunks


def test_same_seed_same_answer_streaming_and_not(oai) -> None:
    kw = dict(max_tokens=24, temperature=0.7, seed=1, stop=["\n\n\n"])
    first, finish, _ = _stream_text(oai, **kw)
    again, _, _ = _stream_text(oai, **kw)
    assert first and first == again and finish in ("stop", "length")
    full = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
    assert full.choices[0].message.content == first
    other, _, _ = _stream_text(oai, **{**kw, "seed": 2})
    greedy, _, _ = _stream_text(oai, max_tokens=24)
    assert other != first and greedy != first


def test_stop_string_spanning_tokens_is_cut_exactly_in_a_stream(oai) -> None:
    full = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, logprobs=True)
    text = full.choices[0].message.content
    tokens = [t.token for t in full.choices[0].logprobs.content]
    assert "".join(tokens) == text
    # a stop string made of the end of one token and the start of the next (both at least 2 chars long)
    pos, stop = 0, None
    for a, b in zip(tokens, tokens[1:]):
        pos += len(a)
        cand = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and text.find(cand) == pos - 2:
            stop = cand
            break
    assert stop is not None, f"no token boundary to test in {tokens}"
    got, finish, chunks = _stream_text(oai, max_tokens=32, stop=[stop, "never-produced-zzz"])
    assert got == text[: text.find(stop)] and finish == "stop"
    assert not any(stop in c for c in chunks)
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, stop=stop)
    assert plain.choices[0].message.content == got and plain.choices[0].finish_reason == "stop"


def test_penalties_change_the_output(oai) -> None:
    base = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32).choices[0].message.content
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, extra_body=kw
                                          if "repetition_penalty" in kw else None,
                                          **({} if "repetition_penalty" in kw else kw)).choices[0].message.content
        assert out != base, kw


def test_top_k_and_top_p_keep_the_right_tokens(oai) -> None:
    # top_k=3: every sampled token is one of the three most likely (the logprobs' own top 3)
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=2.0, seed=seed,
                                        logprobs=True, top_logprobs=3, extra_body={"top_k": 3})
        for t in r.choices[0].logprobs.content:
            assert t.token in [a.token for a in t.top_logprobs]
            lps = [a.logprob for a in t.top_logprobs]
            assert lps == sorted(lps, reverse=True) and sum(math.exp(v) for v in lps) <= 1 + 1e-6
    # top_p tiny: only the most likely token survives, i.e. greedy decoding
    greedy = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16).choices[0].message.content
    tiny_p = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.5, top_p=1e-6,
                                         seed=4).choices[0].message.content
    assert tiny_p == greedy


def test_logprobs_compare_with_the_fp_model(oai, engine_dir) -> None:
    """The engine is the fp32 2-layer cut: its logprobs are log-softmax of the HF model's logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = engine_dir.parent / "tiny-ckpt"
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0.9, seed=3,
                               logprobs=2)
    lp = r.choices[0].logprobs
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    gen = tok("".join(lp.tokens), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + gen])).logits[0].double(), -1).numpy()
    assert len(lp.token_logprobs) == len(gen) == 6
    for i, (t, v) in enumerate(zip(gen, lp.token_logprobs)):
        assert v == pytest.approx(ref[len(prompt) - 1 + i, t], abs=2e-3)
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        np.testing.assert_allclose(top, np.sort(ref[len(prompt) - 1 + i])[::-1][:2], atol=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize("field,value", [("temperature", 2.5), ("top_p", 0), ("top_k", -2), ("seed", 2**64),
                                         ("stop", ["a", "b", "c", "d", "e"]), ("stop", ""), ("top_logprobs", 21),
                                         ("frequency_penalty", -3), ("repetition_penalty", 0)])
def test_out_of_range_sampling_fields_are_422_naming_the_field(server, field, value) -> None:
    r = _post(server, {"model": MODEL, "messages": MESSAGES, field: value})
    assert r.status_code == 422 and field in r.json()["error"]["message"], r.text


def test_top_logprobs_without_logprobs_is_400(server) -> None:
    r = _post(server, {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_unsupported_parameter_is_400_naming_it_and_the_backend(engine_dir) -> None:
    """A backend without logprobs (TensorRT-LLM's support set) refuses them instead of ignoring them."""
    from edgeflow.engines import tensorrt_llm

    with LiveServer(engine_dir, model_name=MODEL, max_tokens_limit=8) as s:
        s.app.state.edgeflow.runtime.sampling_support = tensorrt_llm.sampling_support()
        r = _post(s, {"model": MODEL, "messages": MESSAGES, "logprobs": True, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logprobs" and "'cpu'" in err["message"] and err["code"] == "unsupported_parameter"
        ok = _post(s, {"model": MODEL, "messages": MESSAGES, "temperature": 0.5, "seed": 1, "max_tokens": 2})
        assert ok.status_code == 200


def test_generation_config_sets_the_defaults(engine_dir, tmp_path) -> None:
    eng = tmp_path / "engine"
    shutil.copytree(engine_dir, eng)
    cfg = json.loads((eng / "generation_config.json").read_text())
    (eng / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True, "temperature": 1.3, "top_k": 20}))
    with LiveServer(eng, model_name=MODEL, max_tokens_limit=24) as s:
        health = httpx.get(f"{s.url}/health", timeout=30).json()
        assert health["engine"]["sampling_defaults"] == {"temperature": 1.3, "top_k": 20}
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16}
        a = _post(s, {**body, "seed": 5}).json()["choices"][0]["message"]["content"]
        assert a == _post(s, {**body, "seed": 5}).json()["choices"][0]["message"]["content"]
        greedy = _post(s, {**body, "temperature": 0}).json()["choices"][0]["message"]["content"]
        assert a != greedy
    (eng / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 7}))
    with pytest.raises(ValueError, match="temperature"):
        LiveServer(eng, model_name=MODEL)
