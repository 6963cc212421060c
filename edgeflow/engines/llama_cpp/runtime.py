"""The runtime: llama-cpp-python loading the GGUF, generating and scoring, one request at a time per session.
"""
from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.engines import EngineIncompatibleError, engine_dir as edir
from edgeflow.engines.cpu_host import threads_from_env
from edgeflow.engines.sampling import PARAMETERS, Sampler, SamplingParams

from edgeflow.engines.llama_cpp.gguf import _versions
from edgeflow.engines.llama_cpp.settings import BACKEND, GGUF_FILE, Profile, WRITER


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.check_meta(engine_dir, BACKEND)
    if meta.extra("writer") != WRITER:
        raise EngineIncompatibleError(f"{engine_dir}: engine written by {meta.extra('writer')!r}, this device reads "
                                      f"{WRITER!r} (rebuild the engine)")
    have = _versions()["llama_cpp_python"]
    if have == "not installed":
        raise EngineIncompatibleError(f"{engine_dir}: engine needs llama-cpp-python (built with "
                                      f"{meta.extra('llama_cpp_python')}); this device has none (pip install -e .)")


@dataclass
class LlamaCppSession:
    """Opaque handle returned by `load`: llama.cpp contexts over one memory-mapped GGUF file."""

    model_path: Path
    engine_dir: Path
    meta: dict[str, Any]
    vocab_size: int
    context_length: int
    threads: int
    n_batch: int
    contexts: int
    _idle: queue.LifoQueue = field(default_factory=queue.LifoQueue)
    _created: int = 0
    _scorer: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    score_lock: threading.Lock = field(default_factory=threading.Lock)

    def _new(self, logits_all: bool) -> Any:
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise RuntimeError(f"engine.backend llama_cpp needs llama-cpp-python ({e}); install the `llamacpp` extra: "
                               "pip install -e '.[llamacpp]' (make test installs it; make demo does not)") from None

        return Llama(model_path=str(self.model_path), n_ctx=self.context_length, n_batch=self.n_batch,
                     n_ubatch=self.n_batch, n_threads=self.threads, n_threads_batch=self.threads,
                     logits_all=logits_all, verbose=False)

    def acquire(self) -> Any:
        """An idle generation context, or a new one while fewer than `contexts` exist (else wait for one)."""
        with self._lock:
            if self._idle.empty() and self._created < self.contexts:
                self._created += 1
                return self._new(False)
        return self._idle.get()

    def release(self, llm: Any) -> None:
        self._idle.put(llm)

    def close(self) -> None:
        """Free every llama.cpp context now (at interpreter exit llama-cpp-python's own finalizers find ctypes gone)."""
        with self._lock:
            contexts = [self._idle.get_nowait() for _ in range(self._idle.qsize())]
            if self._scorer is not None:
                contexts.append(self._scorer)
            self._scorer, self._created = None, 0
        for llm in contexts:
            llm.close()

    def scorer(self) -> Any:
        """The context that keeps logits for every position (created on first use)."""
        with self._lock:
            if self._scorer is None:
                self._scorer = self._new(True)
            return self._scorer


def load(engine_dir: Path) -> LlamaCppSession:
    """Check compatibility; contexts are created on first use (a generation context per concurrent call)."""
    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    prof = Profile.model_validate(meta.get("profile") or {})
    vocab, trained_ctx = _gguf_sizes(engine_dir / GGUF_FILE)
    session = LlamaCppSession(
        model_path=engine_dir / GGUF_FILE, engine_dir=engine_dir, meta=meta, vocab_size=vocab,
        context_length=min(prof.n_ctx, trained_ctx),
        threads=threads_from_env(), n_batch=prof.n_batch, contexts=prof.contexts,
    )
    session.release(session.acquire())  # one context now: a broken file fails the load, not the first request
    atexit.register(session.close)
    return session


def _gguf_sizes(path: Path) -> tuple[int, int]:
    """(vocabulary, trained context length) as the GGUF file states them (the engine directory has no config.json)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    g = field.contents() if field is not None else "llama"
    vocab, ctx = reader.get_field(f"{g}.vocab_size"), reader.get_field(f"{g}.context_length")
    if vocab is None or ctx is None:
        raise EngineIncompatibleError(f"{path}: no {g}.vocab_size / {g}.context_length; rebuild the engine")
    return int(vocab.contents()), int(ctx.contents())


def _last_logits(llm: Any, n_vocab: int) -> np.ndarray:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)


def generate(
    session: LlamaCppSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode with the KV cache of a pooled context; yields each new token id (never a stop id)."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if max_new_tokens <= 0:
        return
    if len(input_ids) + max_new_tokens > session.context_length:
        raise ValueError(f"{len(input_ids)} prompt tokens + {max_new_tokens} new tokens exceed the engine's context "
                         f"length {session.context_length} (engine.profile.n_ctx)")
    stops = set(int(t) for t in stop_token_ids)
    llm = session.acquire()
    try:
        llm.reset()
        llm.eval(list(map(int, input_ids)))
        sampler = None if sampling is None or sampling.plain_greedy else Sampler(sampling, input_ids)
        ids = np.arange(session.vocab_size)
        for i in range(max_new_tokens):
            logits = _last_logits(llm, session.vocab_size)
            token = int(np.argmax(logits)) if sampler is None else sampler.choose(ids, logits)
            if token in stops:
                break
            yield token
            if i + 1 < max_new_tokens:
                llm.eval([int(token)])
    finally:
        session.release(llm)


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw reads the full fp32 logits of each step."""
    return frozenset(PARAMETERS)


def score(session: LlamaCppSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab]."""
    if not input_ids:
        raise ValueError("input_ids is empty")
    if len(input_ids) > session.context_length:
        raise ValueError(f"{len(input_ids)} tokens exceed the engine's context length {session.context_length}")
    llm = session.scorer()
    with session.score_lock:  # one scoring context: calls take turns
        llm.reset()
        llm.eval(list(map(int, input_ids)))
        return np.array(llm.scores[: len(input_ids), : session.vocab_size], dtype=np.float32)
