"""The vllm runtime: load an engine into vLLM's AsyncLLM, stream tokens, score prompts, report the GPU.

    python -c "from pathlib import Path; from edgeflow.engines.vllm_engine import load, generate; s = load(Path('eng')); print(list(generate(s, [1], 8, [2])))"

`load` runs `vllm.v1.engine.async_llm.AsyncLLM` (vLLM's engine, batching every request in flight) on an asyncio
loop of its own thread; `generate` and `score` are plain iterators and functions, callable from any number of
threads at once, each one a vLLM request. Written against vLLM 0.34.0's API (AsyncLLM.from_engine_args,
AsyncLLM.generate/abort, SamplingParams, TokensPrompt, RequestOutputKind, Logprob/FlatLogprobs); the GPU half is
unverified on hardware here. The pure parts (`sampling_kwargs`, `score_kwargs`, `to_token`,
`dense_logprobs`) carry what the tests check.

score() and log-probabilities: vLLM returns prompt log-probabilities, not logits. For each position,
logprob = logit - logsumexp(logits): the logits shifted by one constant per row. Softmax, log_softmax, KL,
argmax (top-1) and perplexity are unchanged by a per-row constant, and the consistency gate applies
log_softmax to whatever score returns (edgeflow/evaluation/gate.py), so log-probabilities are what it needs.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines import engine_dir as edir
from edgeflow.engines.sampling import GREEDY, PARAMETERS, SamplingParams, Token
from edgeflow.engines.vllm_engine.device import check_compatible

# vLLM's sampler takes every parameter edgeflow defines (vllm/sampling_params.py), with the same meaning:
# penalties on raw logits before temperature, top_k 0/-1 off, raw_logprobs for logprobs.
SAMPLING_SUPPORT = frozenset(PARAMETERS)
# vLLM keeps per-request seeds in an int64 tensor (v1/worker/gpu/sample/states.py): seeds are taken mod 2**63.
_SEED_MASK = (1 << 63) - 1


def sampling_support() -> frozenset[str]:
    """Every parameter of edgeflow.engines.sampling.PARAMETERS: vLLM's own sampler honours them all."""
    return SAMPLING_SUPPORT


def sampling_kwargs(sampling: SamplingParams | None, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for one generate() call (output_kind is added by the caller).

    The stream ends at the caller's stop ids (ignore_eos: the model's eos ends it only if it is one of them, as
    the contract says) or after max_new_tokens. Greedy is temperature 0 (vLLM then drops top_p/top_k); penalties
    apply to greedy too, as in edgeflow.engines.sampling. Seeds are reproducible on one vLLM release and GPU, not
    across backends (each has its own generator)."""
    p = sampling or GREEDY
    sampled = p.temperature > 0
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": int(max_new_tokens),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": True,
        "detokenize": False,
        "skip_special_tokens": False,
        "temperature": float(p.temperature),
        "top_p": float(p.top_p) if sampled else 1.0,
        "top_k": int(p.top_k) if sampled and p.top_k > 0 else 0,
        "repetition_penalty": float(p.repetition_penalty),
        "presence_penalty": float(p.presence_penalty),
        "frequency_penalty": float(p.frequency_penalty),
    }
    if p.seed is not None:
        kw["seed"] = int(p.seed) & _SEED_MASK
    if p.logprobs:
        kw["logprobs"] = int(p.top_logprobs)  # vLLM returns the sampled token's logprob plus this many top ones
    return kw


def score_kwargs() -> dict[str, Any]:
    """vllm.SamplingParams for score(): every position's full-vocabulary log-probabilities.

    prompt_logprobs=-1 gives rows for positions 1..n-1 (position 0 is None: nothing predicts the first
    token); the one generated token's logprobs=-1 gives the row after the last input token. flat_logprobs
    returns them as FlatLogprobs (flat lists), not one Logprob object per token and position."""
    return {"n": 1, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": -1, "logprobs": -1, "flat_logprobs": True,
            "ignore_eos": True, "detokenize": False, "skip_special_tokens": False}


def logprob_rows(container: Any) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """(token ids, log-probabilities) per position of a vLLM PromptLogprobs/SampleLogprobs (None: no entry).

    Either shape vLLM returns: FlatLogprobs (start_indices/end_indices into flat token_ids/logprobs lists) or
    a list of {token_id: Logprob(logprob, rank, decoded_token)} dicts, with None where vLLM has nothing."""
    if container is None:
        return []
    if hasattr(container, "start_indices"):
        ids = np.asarray(container.token_ids, dtype=np.int64)
        lps = np.asarray(container.logprobs, dtype=np.float64)
        return [None if s == e else (ids[s:e], lps[s:e]) for s, e in zip(container.start_indices, container.end_indices)]
    rows: list[tuple[np.ndarray, np.ndarray] | None] = []
    for pos in container:
        if not pos:
            rows.append(None)
            continue
        rows.append((np.fromiter((int(t) for t in pos), dtype=np.int64, count=len(pos)),
                     np.fromiter((float(lp.logprob) for lp in pos.values()), dtype=np.float64, count=len(pos))))
    return rows


def dense_logprobs(prompt_logprobs: Any, next_logprobs: Any, vocab_size: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, vocab_size] float32: row i is the log-distribution after input token i (what predicts i + 1).

    Rows 0..n-2 are vLLM's prompt logprobs of positions 1..n-1; the last row is the logprobs of the one token
    score() generates. Each row must hold every vocabulary entry (ValueError naming the row otherwise)."""
    rows = logprob_rows(prompt_logprobs)
    if len(rows) != n_tokens:
        raise ValueError(f"vLLM returned prompt logprobs for {len(rows)} positions; the prompt has {n_tokens} tokens")
    if rows and rows[0] is not None:
        raise ValueError("vLLM's prompt logprobs have an entry at position 0 (it has None there: nothing predicts "
                         "the first token); refusing to guess at the layout")
    last = logprob_rows(next_logprobs)
    if not last or last[0] is None:
        raise ValueError("vLLM returned no logprobs for the token after the prompt (score asks logprobs=-1)")
    out = np.full((n_tokens, vocab_size), np.nan, dtype=np.float32)
    for r, row in enumerate([*rows[1:], last[0]]):
        if row is None:
            raise ValueError(f"vLLM returned no prompt logprobs at position {r + 1}")
        ids, lps = row
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"row {r}: token ids outside the vocabulary [0, {vocab_size})")
        out[r, ids] = lps  # a token listed twice (the chosen one and its top-k entry) has the same value both times
        missing = int(np.isnan(out[r]).sum())
        if missing:
            raise ValueError(f"row {r}: vLLM returned log-probabilities for {vocab_size - missing} of {vocab_size} tokens; "
                             "the engine must run with max_logprobs=-1 and the request with prompt_logprobs=-1")
    return out


def to_token(token_id: int, position: Any, top_logprobs: int) -> Token:
    """A Token with the chosen id's log-probability and the `top_logprobs` most likely entries (descending
    log-probability, then ascending id, like edgeflow.engines.sampling), from one position of vLLM's logprobs."""
    if not position:
        raise ValueError(f"vLLM returned no logprobs for token {token_id} (the request asked for them)")
    chosen = position.get(token_id)
    top = sorted(((int(t), float(lp.logprob)) for t, lp in position.items()), key=lambda e: (-e[1], e[0]))
    return Token(int(token_id), float(chosen.logprob) if chosen is not None else None, top[:top_logprobs])


@dataclass
class VllmSession:
    """Opaque handle returned by `load`: vLLM's AsyncLLM, the loop it runs on, and facts about the engine."""

    engine_dir: Path
    meta: dict[str, Any]
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    api: Any  # vllm names requests need: SamplingParams, TokensPrompt, RequestOutputKind
    loop: asyncio.AbstractEventLoop
    vocab_size: int
    max_model_len: int
    engine_pids: frozenset[int] = frozenset()  # processes vLLM started for this engine (its EngineCore)


def _child_pids() -> set[int]:
    try:
        import psutil

        return {c.pid for c in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001  (only used to attribute GPU memory)
        return set()


def _shutdown(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(Exception):
        engine.shutdown()
    with contextlib.suppress(Exception):
        loop.call_soon_threadsafe(loop.stop)


def load(engine_dir: Path) -> VllmSession:
    """Check compatibility, then start vLLM's engine on the engine directory with the recorded arguments
    (GPU only; unverified on hardware here). On a machine without CUDA or vLLM this raises
    EngineIncompatibleError before importing vLLM."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    from types import SimpleNamespace

    from vllm import AsyncEngineArgs, SamplingParams as VllmSamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    args = {"model": str(engine_dir), **meta["engine_args"]}
    before = _child_pids()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name=f"vllm-{engine_dir.name}", daemon=True).start()

    async def start() -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    try:
        engine = asyncio.run_coroutine_threadsafe(start(), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        raise
    session = VllmSession(
        engine_dir=engine_dir, meta=meta, engine=engine, loop=loop,
        api=SimpleNamespace(SamplingParams=VllmSamplingParams, TokensPrompt=TokensPrompt, RequestOutputKind=RequestOutputKind),
        vocab_size=int(meta["vocab_size"]), max_model_len=int(meta["engine_args"]["max_model_len"]),
        engine_pids=frozenset(_child_pids() - before),
    )
    weakref.finalize(session, _shutdown, engine, loop)
    return session


def _check_lengths(session: VllmSession, n_input: int, max_new_tokens: int) -> None:
    if n_input == 0:
        raise ValueError("input_ids is empty")
    if n_input + max_new_tokens > session.max_model_len:
        raise ValueError(f"{n_input} input + {max_new_tokens} new tokens exceed the engine's max_model_len="
                         f"{session.max_model_len} (rebuild with a larger engine.profile.max_model_len)")


def _outputs(session: VllmSession, input_ids: list[int], params: Any) -> Iterator[Any]:
    """vLLM's RequestOutputs for one request, in this thread; closing the iterator aborts the request.

    The request runs as a task on the engine's loop (AsyncLLM.generate), handing outputs over a queue;
    cancelling that task makes AsyncLLM.generate abort the request in the engine."""
    handoff: queue.SimpleQueue = queue.SimpleQueue()
    request_id = f"edgeflow-{uuid.uuid4().hex}"
    prompt = session.api.TokensPrompt(prompt_token_ids=[int(t) for t in input_ids])
    done = object()

    async def pump() -> None:
        try:
            async for out in session.engine.generate(prompt, params, request_id):
                handoff.put(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001  (handed to the consuming thread)
            handoff.put(e)
        else:
            handoff.put(done)

    task = asyncio.run_coroutine_threadsafe(pump(), session.loop)
    try:
        while True:
            item = handoff.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise RuntimeError(f"vLLM request {request_id} failed: {type(item).__name__}: {item}") from item
            yield item
    finally:
        if not task.done():
            task.cancel()  # stop token seen, consumer gone, or an error: vLLM aborts the request


def generate(session: VllmSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
             sampling: SamplingParams | None = None) -> Iterator[int]:
    """Streaming decode: yields each new token id as vLLM produces it, never a stop id (GPU only; unverified here).

    Greedy without `sampling`; otherwise vLLM's sampler with `sampling_kwargs`. With sampling.logprobs, each
    token is a Token carrying its log-probability and top_logprobs alternatives (raw_logprobs: the model's own
    distribution). Concurrent calls from several threads are batched by vLLM's scheduler."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens <= 0:
        return
    _check_lengths(session, len(input_ids), max_new_tokens)
    kw = sampling_kwargs(sampling, max_new_tokens, stop_token_ids)
    params = session.api.SamplingParams(**kw, output_kind=session.api.RequestOutputKind.DELTA)
    stops = set(kw["stop_token_ids"])
    want_logprobs = sampling is not None and sampling.logprobs
    for out in _outputs(session, input_ids, params):
        completion = out.outputs[0]
        for i, token in enumerate(completion.token_ids):  # DELTA: only this step's new tokens and their logprobs
            token = int(token)
            if token in stops:
                return
            yield to_token(token, completion.logprobs[i], sampling.top_logprobs) if want_logprobs else token


def score(session: VllmSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced log-probabilities for every position, float32 [len(input_ids), vocab] (GPU only; unverified).

    They are logits up to one constant per row (see the module docstring), which is all the gate's softmax,
    KL, top-1 and perplexity read."""
    _check_lengths(session, len(input_ids), 1)
    params = session.api.SamplingParams(**score_kwargs(), output_kind=session.api.RequestOutputKind.FINAL_ONLY)
    final = None
    for out in _outputs(session, input_ids, params):
        final = out
    if final is None:
        raise RuntimeError("vLLM returned no output for the score request")
    return dense_logprobs(final.prompt_logprobs, final.outputs[0].logprobs, session.vocab_size, len(input_ids))


def _nvml() -> Any:
    """pynvml (nvidia-ml-py, or the copy vLLM ships), initialised; None where NVML cannot be reached."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml
        except ImportError:
            return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001  (no driver)
        return None
    return pynvml


def _nvml_handle(nvml: Any) -> Any:
    """The first visible GPU (NVML ignores CUDA_VISIBLE_DEVICES: its first entry, by index or UUID, is mapped)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(visible)
    return nvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)


def device_memory_used(session: VllmSession) -> float | None:
    """Bytes the engine holds on its GPU: NVML's per-process use of the processes vLLM started for this engine
    (its EngineCore, where the weights and KV cache live), else the GPU's total use, else CUDA's free/total from
    torch. None where none of them answers (no GPU)."""
    nvml = _nvml()
    if nvml is not None:
        try:
            handle = _nvml_handle(nvml)
            pids = set(getattr(session, "engine_pids", ())) | {os.getpid()}
            ours = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    if p.pid in pids and p.usedGpuMemory is not None]
            if ours:
                return float(sum(ours))
            return float(nvml.nvmlDeviceGetMemoryInfo(handle).used)  # pids of another namespace (containers)
        except Exception:  # noqa: BLE001
            pass
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001  (no CUDA: "not applicable")
        return None
    return float(total - free)


def device_utilization(session: VllmSession) -> float | None:
    """The GPU's busy fraction [0, 1] over NVML's last sample period; None where NVML does not answer."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return nvml.nvmlDeviceGetUtilizationRates(_nvml_handle(nvml)).gpu / 100.0
    except Exception:  # noqa: BLE001
        return None
