"""Requests in flight together: one scheduler thread per session steps every active stream, and generate,
generate_batch and score on top of it.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from edgeflow.engines.sampling import GREEDY, PARAMETERS, Sampler, SamplingParams

from edgeflow.engines.cpu_native.runtime import NativeSession, _Decoder, head_argmax, head_sample
from edgeflow.engines.cpu_native.settings import IDLE_EXIT_S, MAX_ROWS


def _check_ids(session: NativeSession, input_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in input_ids]
    if not ids:
        raise ValueError("input_ids is empty")
    if min(ids) < 0 or max(ids) >= session.embed.shape[0]:
        raise ValueError(f"token id out of range [0, {session.embed.shape[0]})")
    return ids


class _Request:
    """One stream in the scheduler: its prompt, limits, slot and the queue its tokens go to."""

    __slots__ = ("ids", "max_new", "stops", "out", "cancelled", "slot", "produced", "h", "sampler")

    def __init__(self, ids: list[int], max_new: int, stops: set[int], sampling: SamplingParams = GREEDY):
        self.ids, self.max_new, self.stops = ids, max_new, stops
        # None: plain greedy, the exact-argmax head (batched over every greedy stream of the step)
        self.sampler = None if sampling.plain_greedy else Sampler(sampling, ids)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False  # set by the consumer (client went away); the scheduler drops the stream
        self.slot = -1
        self.produced: list[int] = []
        self.h: np.ndarray | None = None  # final-normed hidden state of the last position, [1, hidden]


_DONE = object()


class _Scheduler:
    """In-flight batching for one session: a single thread owns one decoder with MAX_ROWS slots, and
    every step carries one row per live stream, so N concurrent `generate` calls unpack the weights
    once per token instead of N times and never compete for cores (a thread per stream, each with
    all cores, would oversubscribe them). Streams that arrive are prefilled (together, STEP_ROWS rows per step)
    and join at the next step; one that ends frees its slot for the next in line (FIFO)."""

    def __init__(self, session: NativeSession):
        self.s = session
        self.cv = threading.Condition()
        self.pending: deque[_Request] = deque()
        self.thread: threading.Thread | None = None
        self.dec: _Decoder | None = None

    def submit(self, req: _Request) -> None:
        with self.cv:
            self.pending.append(req)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="cpu-native-scheduler", daemon=True)
                self.thread.start()
            self.cv.notify()

    def _capacity(self, live: dict[int, _Request], admit: list[_Request]) -> None:
        """(Re)allocate the KV cache when a stream needs more positions than it holds; copy what is live."""
        need = max(len(r.ids) + r.max_new for r in [*live.values(), *admit])
        if self.dec is not None and self.dec.max_len >= need:
            return
        grown = _Decoder(self.s, MAX_ROWS, max(need, 2 * self.dec.max_len if self.dec else need))
        if self.dec is not None and live:
            n = self.dec.max_len
            grown.kc[:, :, :, :n] = self.dec.kc
            grown.vc[:, :, :, :n] = self.dec.vc
        self.dec = grown

    def _run(self) -> None:
        live: dict[int, _Request] = {}
        while True:
            with self.cv:
                while not self.pending and not live:
                    self.dec = None  # idle: give the KV cache back
                    if not self.cv.wait(timeout=IDLE_EXIT_S) and not self.pending:
                        # Idle for a while: end the thread, so it does not keep the session (and its weights)
                        # alive after the caller dropped it; the next submit starts a new one.
                        self.thread = None
                        return
                admit = []
                while self.pending and len(live) + len(admit) < MAX_ROWS:
                    admit.append(self.pending.popleft())
            loop_start = time.perf_counter_ns()  # idle waiting above is not the engine's time
            try:
                for slot in [k for k, r in live.items() if r.cancelled]:
                    del live[slot]
                admit = [r for r in admit if not r.cancelled]
                if admit:
                    self._capacity(live, admit)
                t0 = time.perf_counter_ns()
                for req in admit:
                    req.slot = min(set(range(MAX_ROWS)) - set(live))
                    live[req.slot] = req
                if admit:  # prompts that arrived together share their prefill steps
                    for req, h in zip(admit, self.dec.prefill_many([(r.ids, r.slot) for r in admit])):
                        req.h = h[-1:]
                if not live:
                    continue
                rows = list(live.values())
                streams = len(rows)
                t1 = time.perf_counter_ns()
                tokens = self._next_tokens(rows)
                t2 = time.perf_counter_ns()
                for req, token in zip(rows, tokens):
                    if token in req.stops:
                        self._finish(live, req)
                        continue
                    req.produced.append(token)
                    req.out.put(token)
                    if len(req.produced) == req.max_new:
                        self._finish(live, req)
                rows = [r for r in rows if r.slot in live and not r.cancelled]
                t3 = t4 = time.perf_counter_ns()
                if rows:
                    h = self.dec.step([r.produced[-1] for r in rows], [len(r.ids) + len(r.produced) - 1 for r in rows],
                                      [r.slot for r in rows])
                    t4 = time.perf_counter_ns()
                    for i, req in enumerate(rows):
                        req.h = h[i:i + 1]
                self._account(streams, sum(len(r.ids) for r in admit), t1 - t0, t2 - t1, t4 - t3, loop_start)
            except BaseException as e:  # noqa: BLE001 - every live stream gets the error; the thread goes on
                for req in [*live.values(), *[r for r in admit if r.slot not in live]]:
                    req.out.put(e)
                live.clear()
                self.dec = None

    def _next_tokens(self, rows: list[_Request]) -> list[int]:
        """One token per live stream: the greedy ones through one batched head_argmax, the others sampled."""
        hs = np.concatenate([r.h for r in rows])
        tokens: list[int] = [0] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.sampler is None]
        if greedy:
            picked = head_argmax(self.s, hs[greedy] if len(greedy) < len(rows) else hs, buffers=self.dec.head)[0]
            for i, tok in zip(greedy, picked):
                tokens[i] = tok
        for i, r in enumerate(rows):
            if r.sampler is not None:
                tokens[i] = head_sample(self.s, hs[i:i + 1], r.sampler, self.dec.head)
        return tokens

    def _account(self, streams: int, prefill_tokens: int, prefill_ns: int, head_ns: int, layers_ns: int, loop_start: int) -> None:
        """The engine's own profile (session.stats): where each scheduler step's time went."""
        st = self.s.stats
        with self.s._lock:
            st["scheduler_steps"] += 1
            st["max_streams_in_step"] = max(st["max_streams_in_step"], streams)
            st["prefill_tokens"] += prefill_tokens
            st["prefill_ns"] += prefill_ns
            st["head_ns"] += head_ns
            st["layers_ns"] += layers_ns
            st["scheduler_ns"] += time.perf_counter_ns() - loop_start - prefill_ns - head_ns - layers_ns

    @staticmethod
    def _finish(live: dict[int, _Request], req: _Request) -> None:
        """The stream is complete: free its slot and tell its consumer."""
        live.pop(req.slot, None)
        req.out.put(_DONE)


def _scheduler(session: NativeSession) -> _Scheduler:
    with session._lock:
        if session._scheduler is None:
            session._scheduler = _Scheduler(session)
        return session._scheduler


def _submit(session: NativeSession, input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int],
            sampling: SamplingParams = GREEDY) -> _Request:
    ids = _check_ids(session, input_ids)
    if len(ids) + max_new_tokens > session.context_length:
        raise ValueError(
            f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceed the engine's context length "
            f"{session.context_length}; shorten the prompt or lower max_tokens"
        )
    req = _Request(ids, max_new_tokens, {int(t) for t in stop_token_ids}, sampling or GREEDY)
    if req.sampler is None and session.arch.final_softcap:
        # Softcapped logits can tie where the raw ones do not (tanh saturates in fp32); transformers takes the lowest id
        # among tied ones, so greedy goes through head_sample's capped bounds and Sampler.choose's first maximum.
        req.sampler = Sampler(GREEDY, ids)
    _scheduler(session).submit(req)
    return req


def _tokens(req: _Request) -> Iterator[int]:
    try:
        while True:
            item = req.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        req.cancelled = True


def generate(
    session: NativeSession, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Decode; yields each new token id, never a stop id. Without `sampling` (or with plain greedy params)
    the exact fp32 argmax; otherwise `head_sample`'s draw, as `Token`s carrying logprobs when asked.
    Concurrent calls are decoded together by the session's scheduler (one batched step per token for up
    to 4 streams)."""
    if max_new_tokens <= 0:
        _check_ids(session, input_ids)
        return
    yield from _tokens(_submit(session, input_ids, max_new_tokens, stop_token_ids, sampling or GREEDY))


def generate_batch(
    session: NativeSession, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: Sequence[int],
    sampling: SamplingParams | None = None,
) -> list[list[int]]:
    """Several prompts submitted together (the scheduler batches up to 4 at a time); the same tokens as
    separate `generate` calls with the same parameters."""
    if max_new_tokens <= 0:
        return [[] for _ in (_check_ids(session, p) for p in prompts)]
    reqs = [_submit(session, p, max_new_tokens, stop_token_ids, sampling or GREEDY) for p in prompts]
    return [list(_tokens(r)) for r in reqs]


def sampling_support() -> frozenset[str]:
    """Every sampling parameter: the draw runs on exact fp32 logits of the candidates (head_sample)."""
    return frozenset(PARAMETERS)


def score(session: NativeSession, input_ids: list[int]) -> np.ndarray:
    """Teacher-forced logits for every position: float32 [len(input_ids), vocab], full fp32 head."""
    ids = _check_ids(session, input_ids)
    hidden = _Decoder(session, 1, len(ids)).prefill(ids, 0)
    return np.ascontiguousarray(session.logits(hidden @ session.head.T), dtype=np.float32)
