"""The tensorrt_llm runtime: load an engine, generate (streaming, in-flight batching), score, device hooks.

    python -c "from pathlib import Path; from edgeflow.engines.tensorrt_llm import load, generate; s = load(Path('eng')); print(list(generate(s, [1], 8, [2])))"

GPU only; written against TensorRT-LLM's runtime API (ModelRunnerCpp / the C++ executor, ModelRunner as
fallback) and unverified on hardware here.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines import engine_dir as edir
from edgeflow.engines.engine_dir import special_token_ids  # re-exported: the backend's package lists it
from edgeflow.engines.sampling import SamplingParams
from edgeflow.engines.tensorrt_llm.device import check_compatible

@dataclass
class TrtLlmSession:
    """Opaque handle returned by `load`: the runner (C++ executor or Python session) and facts about it."""

    engine_dir: Path
    meta: dict[str, Any]
    runner: Any
    runtime: str  # "cpp" (ModelRunnerCpp / executor, in-flight batching) or "python" (ModelRunner)
    end_id: int
    pad_id: int
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    _score_runner: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)  # python runner + lazy score runner


def _runner(engine_dir: Path, bp: dict[str, Any], score: bool = False) -> tuple[Any, str]:
    """A ModelRunnerCpp (C++ executor) if the bindings exist and the profile wants in-flight batching, else ModelRunner."""
    from tensorrt_llm.runtime import PYTHON_BINDINGS, ModelRunner

    if PYTHON_BINDINGS and bp.get("in_flight_batching", True):
        from tensorrt_llm.runtime import ModelRunnerCpp

        # Orin's GPU shares 32/64 GB with the CPU: the default KV-cache grab (90% of free memory) would
        # starve the host, so the profile's fraction applies and the cache is capped at what the build
        # limits can use (max_batch_size full-length sequences).
        slots = 1 if score else int(bp["max_batch_size"])
        runner = ModelRunnerCpp.from_dir(
            engine_dir=str(engine_dir),
            rank=0,
            max_batch_size=slots,
            kv_cache_free_gpu_memory_fraction=float(bp["kv_cache_free_gpu_memory_fraction"]),
            max_tokens_in_paged_kv_cache=slots * int(bp["max_seq_len"]),
        )
        return runner, "cpp"
    return ModelRunner.from_dir(engine_dir=str(engine_dir), rank=0), "python"


def load(engine_dir: Path) -> TrtLlmSession:
    """Check compatibility, then load the engine into a runner (GPU only; unverified on hardware here)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    runner, runtime = _runner(engine_dir, meta["build_profile"])
    end_id, pad_id = meta.get("end_id"), meta.get("pad_id")
    if end_id is None:
        end_id, pad_id = special_token_ids(engine_dir)
    if end_id is None:
        raise ValueError(f"{engine_dir}: no eos token id in generation_config.json / tokenizer files (needed as end_id)")
    bp = meta["build_profile"]
    return TrtLlmSession(
        engine_dir=engine_dir, meta=meta, runner=runner, runtime=runtime, end_id=int(end_id),
        pad_id=int(pad_id if pad_id is not None else end_id), vocab_size=int(runner.vocab_size),
        max_input_len=int(bp["max_input_len"]), max_seq_len=int(bp["max_seq_len"]),
    )


def _executor(runner: Any) -> Any:
    # ModelRunnerCpp keeps the trtllm.Executor as .executor (mainline) or .session (0.10-0.12)
    return getattr(runner, "executor", None) or runner.session


def _check_lengths(session: TrtLlmSession, n_input: int, max_new_tokens: int) -> None:
    if n_input == 0:
        raise ValueError("input_ids is empty")
    if n_input > session.max_input_len:
        raise ValueError(f"{n_input} input tokens exceed the engine's max_input_len={session.max_input_len} (rebuild with a larger one)")
    if n_input + max_new_tokens > session.max_seq_len:
        raise ValueError(
            f"{n_input} input + {max_new_tokens} new tokens exceed the engine's max_seq_len={session.max_seq_len}"
        )


# What the runtime's own sampler (SamplingConfig) is given; logprobs are not wired through (400 at the server).
SAMPLING_SUPPORT = frozenset({"temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
                              "repetition_penalty"})


def sampling_support() -> frozenset[str]:
    """The parameters TensorRT-LLM's sampler takes from a request (logprobs and top_logprobs are not wired)."""
    return SAMPLING_SUPPORT


def sampling_kwargs(sampling: SamplingParams | None) -> dict[str, Any]:
    """SamplingConfig / ModelRunner.generate keyword arguments for a request (top_k=1 is greedy).

    The seed's keyword is `random_seed` in the v0.12.0-jetson runtime and `seed` in mainline; the caller
    maps it (`_with_seed`). Penalties are passed only when set, so a greedy request stays `top_k=1`."""
    if sampling is None or sampling.temperature == 0:
        kw: dict[str, Any] = {"top_k": 1}
    else:
        kw = {"temperature": float(sampling.temperature)}
        if sampling.top_k > 0:
            kw["top_k"] = int(sampling.top_k)
        if sampling.top_p < 1.0:
            kw["top_p"] = float(sampling.top_p)
    if sampling is not None:
        if sampling.seed is not None:
            kw["seed"] = int(sampling.seed) & ((1 << 64) - 1)
        if sampling.repetition_penalty != 1:
            kw["repetition_penalty"] = float(sampling.repetition_penalty)
        if sampling.presence_penalty:
            kw["presence_penalty"] = float(sampling.presence_penalty)
        if sampling.frequency_penalty:
            kw["frequency_penalty"] = float(sampling.frequency_penalty)
    return kw


def _with_seed(factory: Any, kw: dict[str, Any]) -> Any:
    """Call `factory(**kw)`, renaming `seed` to `random_seed` for runtimes that spell it so."""
    try:
        return factory(**kw)
    except TypeError:
        if "seed" not in kw:
            raise
        kw = {("random_seed" if k == "seed" else k): v for k, v in kw.items()}
        return factory(**kw)


def generate(
    session: TrtLlmSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Streaming decode; yields each new token id, stopping before any stop id (GPU only; unverified here).
    Greedy (top_k=1) unless `sampling` asks otherwise; sampling runs in the runtime's sampler (`sampling_kwargs`).

    C++ runtime: one executor request per call (streaming, top_k=1), awaited by its own id, so concurrent
    calls from several threads are batched in flight by the executor. The request's end_id is the first
    stop id (else the tokenizer's eos) and the other stop ids are stop words; the Python-side check
    guarantees no stop id is ever yielded whichever way the runtime reports it. Closing the generator
    early cancels the request. Unlike the cpu backend, an eos that is not among the stop ids does not
    end the stream (the executor has one end_id, and it is given the caller's first stop id).
    """
    if max_new_tokens <= 0:
        if not input_ids:
            raise ValueError("input_ids is empty")
        return
    _check_lengths(session, len(input_ids), max_new_tokens)
    stops = [int(t) for t in stop_token_ids]
    stop_set = set(stops)
    end_id = stops[0] if stops else session.end_id
    if session.runtime == "python":
        yield from _generate_python(session, input_ids, max_new_tokens, end_id, stop_set, sampling)
        return
    import tensorrt_llm.bindings.executor as trtllm

    executor = _executor(session.runner)
    request = trtllm.Request(
        [int(t) for t in input_ids],
        int(max_new_tokens),  # positional: named max_new_tokens in 0.12, max_tokens in mainline
        streaming=True,
        sampling_config=_with_seed(trtllm.SamplingConfig, {"beam_width": 1, **sampling_kwargs(sampling)}),
        output_config=trtllm.OutputConfig(),
        end_id=end_id,
        pad_id=session.pad_id,
        stop_words=[[t] for t in stops[1:]] or None,
    )
    request_id = executor.enqueue_request(request)
    final = False
    try:
        while not final:
            for response in executor.await_responses(request_id):
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {request_id} failed: {response.error_msg}")
                result = response.result
                for token in result.output_token_ids[0]:  # streaming: only this step's new tokens
                    if int(token) in stop_set:
                        return  # the finally cancels the rest of the request
                    yield int(token)
                final = final or bool(result.is_final)
    finally:
        if not final:  # stop token, consumer closed the stream, or an error: free the batch slot
            with contextlib.suppress(Exception):
                executor.cancel_request(request_id)


def _generate_python(session: TrtLlmSession, input_ids: list[int], max_new_tokens: int, end_id: int, stops: set[int],
                     sampling: SamplingParams | None = None) -> Iterator[int]:
    """ModelRunner (Python session) fallback: one call at a time per session, streaming dicts of growing output_ids."""
    import torch

    with session._lock:
        kw = {"random_seed" if k == "seed" else k: v for k, v in sampling_kwargs(sampling).items()}
        outputs = session.runner.generate(
            [torch.tensor(input_ids, dtype=torch.int32)], max_new_tokens=max_new_tokens, end_id=end_id,
            pad_id=session.pad_id, num_beams=1, streaming=True, return_dict=True, output_sequence_lengths=True, **kw,
        )
        emitted = len(input_ids)
        for step in outputs:
            length = int(step["sequence_lengths"][0][0])
            new = step["output_ids"][0][0][emitted:length].tolist()
            for token in new:
                if int(token) in stops:
                    return
                yield int(token)
            emitted = length


def _score_runner(session: TrtLlmSession) -> tuple[Any, str]:
    where = session.meta.get("score_engine")
    if where is None:
        raise RuntimeError(
            f"{session.engine_dir}: built with gather_context_logits=off, so it cannot return logits for every position; "
            "rebuild with gather_context_logits=score_engine"
        )
    if where == ".":
        return session.runner, session.runtime
    with session._lock:
        if session._score_runner is None:
            session._score_runner = _runner(session.engine_dir / where, session.meta["build_profile"], score=True)
        return session._score_runner


def score(session: TrtLlmSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position, float32 [len(input_ids), vocab] (GPU only; unverified here).

    One context pass with return_context_logits on the engine built with --gather_context_logits
    (score/ by default: same converted checkpoint and flags as the serving engine, plus that flag).
    """
    _check_lengths(session, len(input_ids), 1)
    runner, runtime = _score_runner(session)
    if runtime == "cpp":
        import tensorrt_llm.bindings.executor as trtllm

        executor = _executor(runner)
        request = trtllm.Request(
            [int(t) for t in input_ids], 1, streaming=False,
            sampling_config=trtllm.SamplingConfig(beam_width=1, top_k=1),
            output_config=trtllm.OutputConfig(return_context_logits=True),
            end_id=session.end_id, pad_id=session.pad_id,
        )
        request_id = executor.enqueue_request(request)
        logits = None
        while logits is None:
            for response in executor.await_responses(request_id):
                if response.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {request_id} failed: {response.error_msg}")
                if response.result.is_final:
                    logits = response.result.context_logits
                    if logits is None:
                        raise RuntimeError("no context logits returned: was the score engine built with --gather_context_logits?")
    else:
        import torch

        with session._lock:
            out = runner.generate([torch.tensor(input_ids, dtype=torch.int32)], max_new_tokens=1, end_id=session.end_id,
                                  pad_id=session.pad_id, top_k=1, num_beams=1, return_dict=True)
        logits = out["context_logits"]
        logits = logits[0] if isinstance(logits, list) or getattr(logits, "ndim", 2) == 3 else logits
    arr = logits.float().cpu().numpy() if hasattr(logits, "float") else np.asarray(logits, dtype=np.float32)
    arr = arr[: len(input_ids), : session.vocab_size]
    if arr.shape != (len(input_ids), session.vocab_size):
        raise RuntimeError(f"engine returned context logits of shape {arr.shape} for {len(input_ids)} tokens")
    return np.ascontiguousarray(arr, dtype=np.float32)


def device_memory_used(session: TrtLlmSession) -> float | None:
    """Bytes in use on the engine's GPU (total - free from the CUDA driver; on Jetson the GPU shares the
    host's memory, so this is the whole SoC's use). None when CUDA cannot be queried."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001  (no CUDA here: "not applicable")
        return None
    return float(total - free)


# Jetson's GPU load in per mille (the nvgpu driver's sysfs node; nvidia-smi has no utilisation there).
_JETSON_GPU_LOAD = ("/sys/devices/platform/gpu.0/load", "/sys/devices/gpu.0/load")


def device_utilization(session: TrtLlmSession) -> float | None:
    """The GPU's busy fraction [0, 1]: Jetson's sysfs load, else NVML's utilisation; None if neither answers."""
    for path in _JETSON_GPU_LOAD:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(path).read_text().strip()) / 1000.0
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except Exception:  # noqa: BLE001  (no NVML: not reported)
        return None
