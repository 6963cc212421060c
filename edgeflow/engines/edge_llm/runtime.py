"""The edge_llm runtime: load an Edge-LLM engine in this process, generate (streaming), device hooks.

    python -c "from pathlib import Path; from edgeflow.engines.edge_llm import load, generate; s = load(Path('eng')); print(list(generate(s, [1], 8, [2])))"

Written against Edge-LLM 0.10.0's Python bindings (experimental/pybind/edgellm_pybind.cpp, the module
`_edgellm_runtime` that its OpenAI-compatible server, experimental/server/engine.py, drives): LLMRuntime(
engine_dir, "", {}), LLMGenerationRequest (temperature, top_p, top_k, max_generate_length,
apply_chat_template, add_generation_prompt, stream_channels, num_logprobs), Request(messages), StreamChannel
(wait_pop -> StreamChunk.token_ids / finished), LLMGenerationResponse.prompt_token_counts. In-process
bindings are used rather than the server process (`python -m experimental.server --model <engine_dir>`,
0.11: `tensorrt-edgellm-serve`): the server only takes text and chat messages and answers /v1/completions
with "'logprobs' is not supported", so it adds a hop without giving anything the bindings lack.
GPU only; unverified on hardware here.

What the runtime cannot do, and what this module does about it:

* Token ids in: a Request carries text messages, which the runtime tokenizes itself. `generate` decodes
  the ids with the engine's tokenizer.json, sends the text with apply_chat_template=False and
  add_generation_prompt=False ("raw messages ... concatenated without special tokens",
  cpp/runtime/llmRuntimeUtils.h), refuses prompts whose ids do not survive decode -> encode, and checks
  the runtime's prompt_token_counts afterwards.
* Stop ids: the runtime stops at its tokenizer's end id and at stop strings; other stop ids are checked
  here and the request is cancelled through its StreamChannel.
* Sampling: temperature, top_k, top_p only (cpp/sampler/sampling.h SamplingParams): no seed, no
  penalties. Greedy is temperature 0 with top_k 1; plain temperature sampling is top_k = vocab size
  (the sampler refuses top_k 0 with top_p 1: "Either topK or topP must be set").
* score: the runtime returns at most kMaxLogprobsK = 50 log-probabilities per generated token
  (cpp/sampler/sampling.h, LLMGenerationRequest::numLogprobs) and nothing for prompt positions, so
  full-vocabulary teacher-forced logits are not available: `score` raises EngineIncompatibleError.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines import EngineIncompatibleError
from edgeflow.engines import engine_dir as edir
from edgeflow.engines.engine_dir import special_token_ids  # re-exported: the backend's package lists it
from edgeflow.engines.edge_llm.device import check_compatible
from edgeflow.engines.edge_llm.plan import edge_llm_src_dir
from edgeflow.engines.sampling import SamplingParams

# The sampling parameters Edge-LLM's request takes (LLMGenerationRequest: temperature, topP, topK).
SAMPLING_SUPPORT = frozenset({"temperature", "top_p", "top_k"})

# Edge-LLM's plugin library name and the places its server looks for it and for the pybind module
# (experimental/server/engine.py _PLUGIN_LIB_NAME, _ensure_plugin_path, _import_runtime).
PLUGIN_LIB_NAME = "libNvInfer_edgellm_plugin.so"

SCORE_UNAVAILABLE = (
    "Edge-LLM's runtime returns no logits: at most the top-50 log-probabilities of each generated token "
    "(LLMGenerationRequest::numLogprobs, kMaxLogprobsK = 50) and nothing for prompt positions, so score() cannot "
    "give teacher-forced logits over the vocabulary. The consistency gate for an edge_llm engine must compare "
    "generated tokens (greedy agreement via generate()) or run score() on the same checkpoint with another "
    "backend (tensorrt_llm, cpu)"
)


def sampling_support() -> frozenset[str]:
    """temperature, top_p and top_k: Edge-LLM's request has no seed, penalties, or per-request logprobs wired here."""
    return SAMPLING_SUPPORT


def sampler_fields(sampling: SamplingParams | None, vocab_size: int) -> dict[str, Any]:
    """LLMGenerationRequest temperature / top_k / top_p for a request (greedy without sampling)."""
    if sampling is None or sampling.temperature == 0:
        # sampling.h: near-zero temperature is greedy and wants topK 1, topP 1.0
        return {"temperature": 0.0, "top_k": 1, "top_p": 1.0}
    top_k = int(sampling.top_k) if sampling.top_k > 0 else 0
    top_p = float(sampling.top_p)
    if top_k == 0 and top_p >= 1.0:
        top_k = int(vocab_size)  # no truncation, expressed as a top-k the sampler accepts
    return {"temperature": float(sampling.temperature), "top_k": top_k, "top_p": top_p}


def prompt_text(tokenizer: Any, input_ids: list[int]) -> str:
    """The text the runtime re-tokenizes into exactly `input_ids` (ValueError if no such text exists)."""
    text = tokenizer.decode([int(t) for t in input_ids], skip_special_tokens=False)
    again = tokenizer.encode(text, add_special_tokens=False).ids
    if list(again) != [int(t) for t in input_ids]:
        first = next((i for i, (a, b) in enumerate(zip(again, input_ids)) if a != b), min(len(again), len(input_ids)))
        raise ValueError(
            f"input_ids do not survive decode -> encode with the engine's tokenizer.json (first difference at position "
            f"{first}: {list(input_ids[first:first + 3])} -> {list(again[first:first + 3])}); Edge-LLM's runtime takes "
            "text, so this prompt cannot be sent as these exact ids. Fix: send the text the ids came from"
        )
    return text


def import_runtime(src: Path | None = None) -> Any:
    """Edge-LLM's pybind module `_edgellm_runtime` (ImportError naming where it was looked for)."""
    src = Path(src) if src is not None else edge_llm_src_dir({})
    if not os.environ.get("EDGELLM_PLUGIN_PATH"):
        for d in (src / "build" / "core", src / "build" / "lib"):
            if (d / PLUGIN_LIB_NAME).is_file():
                os.environ["EDGELLM_PLUGIN_PATH"] = str(d / PLUGIN_LIB_NAME)
                break
    with contextlib.suppress(ImportError):
        from tensorrt_edgellm import _edgellm_runtime

        return _edgellm_runtime
    dirs = [Path(p) for p in (os.environ.get("EDGELLM_PYBIND_DIR"),) if p]
    dirs += [src / "experimental" / "pybind" / "build", src / "build" / "pybind", *sorted(src.glob("build/lib.*"))]
    for d in dirs:
        for so in sorted(d.glob("*_edgellm_runtime*.so")) if d.is_dir() else []:
            spec = importlib.util.spec_from_file_location("_edgellm_runtime", so)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["tensorrt_edgellm._edgellm_runtime"] = mod
            spec.loader.exec_module(mod)
            return mod
    raise ImportError(f"Edge-LLM's _edgellm_runtime module is not importable and no *_edgellm_runtime*.so is in "
                      f"{[str(d) for d in dirs]}; build it (cmake -DBUILD_PYTHON_BINDINGS=ON, target _edgellm_runtime)")


@dataclass
class EdgeLlmSession:
    """Opaque handle returned by `load`: Edge-LLM's runtime and the facts generate needs."""

    engine_dir: Path
    meta: dict[str, Any]
    rt: Any  # the _edgellm_runtime module
    runtime: Any  # rt.LLMRuntime
    tokenizer: Any  # tokenizers.Tokenizer of the engine's tokenizer.json
    end_id: int
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the runtime serves one request at a time


def load(engine_dir: Path) -> EdgeLlmSession:
    """Check compatibility, then load the engine into Edge-LLM's runtime (GPU only; unverified on hardware here)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)  # EngineIncompatibleError before any Edge-LLM import
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    from tokenizers import Tokenizer

    rt = import_runtime()
    runtime = rt.LLMRuntime(str(engine_dir), "", {})
    runtime.capture_decoding_cuda_graph()  # as the server does after loading (experimental/server/engine.py)
    bp = meta["build_profile"]
    end_id = meta.get("end_id")
    if end_id is None:
        end_id, _ = special_token_ids(engine_dir)
    if end_id is None:
        raise ValueError(f"{engine_dir}: no eos token id in generation_config.json / tokenizer files")
    cfg = json.loads((engine_dir / "config.json").read_text())
    return EdgeLlmSession(
        engine_dir=engine_dir, meta=meta, rt=rt, runtime=runtime,
        tokenizer=Tokenizer.from_file(str(engine_dir / "tokenizer.json")), end_id=int(end_id),
        vocab_size=int(cfg["vocab_size"]), max_input_len=int(bp["max_input_len"]),
        max_seq_len=int(bp["max_kv_cache_capacity"]),
    )


def _check_lengths(session: EdgeLlmSession, n_input: int, max_new_tokens: int) -> None:
    if n_input == 0:
        raise ValueError("input_ids is empty")
    if n_input > session.max_input_len:
        raise ValueError(f"{n_input} input tokens exceed the engine's max_input_len={session.max_input_len} "
                         "(rebuild with a larger one)")
    if n_input + max_new_tokens > session.max_seq_len:
        raise ValueError(f"{n_input} input + {max_new_tokens} new tokens exceed the engine's "
                         f"max_kv_cache_capacity={session.max_seq_len}")


def _request(session: EdgeLlmSession, text: str, max_new_tokens: int, sampling: SamplingParams | None, channel: Any) -> Any:
    rt = session.rt
    message = rt.Message()
    message.role = "user"
    message.contents = [rt.MessageContent("text", text)]
    request = rt.LLMGenerationRequest()
    request.requests = [rt.Request(messages=[message])]
    request.stream_channels = [channel]
    for name, value in sampler_fields(sampling, session.vocab_size).items():
        setattr(request, name, value)
    request.max_generate_length = int(max_new_tokens)
    request.apply_chat_template = False  # the ids already hold any template
    request.add_generation_prompt = False
    request.num_logprobs = 0
    return request


def generate(
    session: EdgeLlmSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Streaming decode through Edge-LLM's runtime; yields each new token id, stopping before any stop id
    (GPU only; unverified on hardware here). Requests are served one at a time per session."""
    if max_new_tokens <= 0:
        if not input_ids:
            raise ValueError("input_ids is empty")
        return
    _check_lengths(session, len(input_ids), max_new_tokens)
    text = prompt_text(session.tokenizer, input_ids)
    stops = {int(t) for t in stop_token_ids}
    with session._lock:
        channel = session.rt.StreamChannel.create()
        request = _request(session, text, max_new_tokens, sampling, channel)
        result: dict[str, Any] = {}

        def _run() -> None:
            try:
                result["response"] = session.runtime.handle_request(request)
            except Exception as e:  # noqa: BLE001  (re-raised in the caller's thread)
                result["error"] = e
                channel.cancel()

        worker = threading.Thread(target=_run, daemon=True)
        worker.start()
        try:
            while True:
                chunk = channel.wait_pop(timeout_ms=200)
                if chunk is None:
                    if channel.is_finished() or channel.is_cancelled():
                        break
                    continue
                for token in chunk.token_ids:
                    if int(token) in stops:
                        return  # the finally cancels the rest of the request
                    yield int(token)
                if chunk.finished:
                    break
        finally:
            if not (channel.is_finished() or channel.is_cancelled()):
                channel.cancel()
            worker.join()
        if "error" in result:
            raise result["error"]
        counts = list(getattr(result.get("response"), "prompt_token_counts", []) or [])
        if counts and counts[0] != len(input_ids):
            raise RuntimeError(f"Edge-LLM tokenized the prompt into {counts[0]} tokens, not the {len(input_ids)} ids "
                               "given (its tokenizer differs from tokenizer.json's round trip)")


def score(session: EdgeLlmSession, input_ids: list[int]) -> np.ndarray:
    """Not available on this backend: EngineIncompatibleError saying why and where the gate must run instead."""
    raise EngineIncompatibleError(SCORE_UNAVAILABLE)


def device_memory_used(session: EdgeLlmSession) -> float | None:
    """Bytes in use on the GPU (total - free from CUDA; on Jetson the whole SoC's shared memory). None if CUDA
    cannot be queried from Python here."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001  (no torch/CUDA in this process: not reported)
        return None
    return float(total - free)


# Jetson's GPU load in per mille (the nvgpu driver's sysfs node; nvidia-smi reports no utilisation there).
_JETSON_GPU_LOAD = ("/sys/devices/platform/gpu.0/load", "/sys/devices/gpu.0/load")


def device_utilization(session: EdgeLlmSession) -> float | None:
    """The GPU's busy fraction [0, 1] from Jetson's sysfs load; None where that node is absent."""
    for path in _JETSON_GPU_LOAD:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(path).read_text().strip()) / 1000.0
    return None
