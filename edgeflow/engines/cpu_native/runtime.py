"""The runtime: an engine loaded into a NativeSession, one decode step, and the head (exact argmax by bounds and
rescoring, the rows, the sampled draw in C).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edgeflow.model.architecture import Architecture
from edgeflow.engines import EngineIncompatibleError, engine_dir as edir
from edgeflow.engines.cpu_host import cpu_flags as _cpu_flags, device_fingerprint, int_from_env, threads_from_env
from edgeflow.engines.sampling import NUCLEUS_ROWS, REDRAWS, REJECTION_TRIES, TAIL_LOG, Sampler, Token, Universe

from edgeflow.engines.cpu_native.kernels import _compiler, _library, kernel_sha256
from edgeflow.engines.cpu_native.settings import (BACKEND, FIX, FORMAT_VERSION, REQUIRED_ISA, SOURCE, SPIN_ENV,
    SPIN_US_DEFAULT, STEP_ROWS, WEIGHTS, _COLUMNS, _FUSED, _KINDS)


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.check_meta(engine_dir, BACKEND).model_dump(mode="json")
    if meta.get("format_version") != FORMAT_VERSION:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine format_version {meta.get('format_version')!r}, this runtime reads {FORMAT_VERSION} (rebuild the engine)"
        )
    have = kernel_sha256()
    if meta.get("kernel_sha256") != have:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine built for kernel source sha256 {meta.get('kernel_sha256')}, this runtime's "
            f"{SOURCE.name} is {have} (the weight layout may differ; rebuild the engine)"
        )
    flags = _cpu_flags()
    missing = [f for f in meta.get("required_isa", REQUIRED_ISA) if f not in flags]
    if missing:
        raise EngineIncompatibleError(
            f"{engine_dir}: engine needs CPU flags {meta.get('required_isa')}, this CPU "
            f"({device_fingerprint()['cpu_model'] or 'unknown'}) lacks {missing}; {FIX}"
        )
    _compiler()  # the kernels are compiled on this machine (once, cached): no compiler, no engine


@dataclass
class NativeSession:
    """Opaque handle returned by `load`: weights, layer pointer table and the kernels (read-only after load),
    plus the session's `_Scheduler`. Every `generate` call is a request to that one scheduler thread, which
    owns the decoder and its shared KV cache (MAX_ROWS slots, grown when a stream needs more positions);
    `score` builds a decoder and KV cache of its own per call. Concurrent calls of both are safe."""

    lib: Any
    engine_dir: Path
    meta: dict[str, Any]
    arch: Architecture
    tensors: dict[str, np.ndarray]
    layers: np.ndarray  # int64 [n_layers, len(_COLUMNS)]: pointers + kind + window, see layer_t in q4.c (cos/sin: 0)
    family: Any  # _FamilyT: what the family adds to a Llama step (activation, attention scale and softcap)
    threads: int
    team: int | None  # q4.c's team_t* (None: one thread); destroyed when the session is collected
    max_candidates: int
    vocab_size: int
    context_length: int
    stats: dict[str, int] = field(default_factory=lambda: {"head_calls": 0, "candidates": 0, "max_candidates_seen": 0, "full_passes": 0,
                                                         "scheduler_steps": 0, "max_streams_in_step": 0, "prefill_tokens": 0,
                                                         "prefill_ns": 0, "layers_ns": 0, "head_ns": 0, "scheduler_ns": 0,
                                                         "sampled": 0, "sampled_candidates": 0, "sampled_full_passes": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _scheduler: Any = None  # the session's _Scheduler, created by the first generate call
    _rope: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # kind -> (cos, sin) [n, head_dim]

    def rope_tables(self, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """cos/sin [>= n, head_dim] per attention kind, computed up to the longest length asked so far (a decoder keeps
        the arrays it was given, so growing them never moves a table under a running step)."""
        with self._lock:
            if not self._rope or len(next(iter(self._rope.values()))[0]) < n:
                self._rope = {kind: _rope_tables(r.inv_freq(self.arch.head_dim), n) for kind, r in self.arch.rope.items()}
            return self._rope

    def logits(self, raw: np.ndarray) -> np.ndarray:
        """The model's output logits from the head's x . E_r: Gemma 2's final softcap (cap * tanh(l / cap), in fp32 as
        transformers computes it), else unchanged. Monotone, so the exact argmax of the raw logits is the model's."""
        cap = self.arch.final_softcap
        if not cap:
            return raw
        c = np.float32(cap)
        return (np.tanh((np.asarray(raw, np.float32) / c).astype(np.float32)) * c).astype(np.float32)

    def team_stats(self) -> dict[str, int]:
        """The thread team's counters: parallel regions run, waits that ended asleep, wait-policy probes
        (and how many chose spinning), and the policy now in force (1: spin first)."""
        lib, t = self.lib, self.team
        return {"threads": self.threads, "regions": lib.team_regions(t), "sleeps": lib.team_sleeps(t),
                "probes": lib.team_probes(t), "probes_spin": lib.team_probes_spin(t), "spinning": lib.team_spinning(t)}

    @property
    def embed(self) -> np.ndarray:
        return self.tensors["embed"]

    @property
    def head(self) -> np.ndarray:
        return self.tensors.get("head.fp32", self.tensors["embed"])


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class _FamilyT(ctypes.Structure):
    """q4.c's family_t."""

    _fields_ = [("act", ctypes.c_int), ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
                ("pad", ctypes.c_float)]


def _rope_tables(inv: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n, head_dim] from the inverse frequencies, as transformers computes them (fp32)."""
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=1)
    return np.ascontiguousarray(np.cos(emb), np.float32), np.ascontiguousarray(np.sin(emb), np.float32)


def load(engine_dir: Path) -> NativeSession:
    """Check compatibility, compile (or reuse) the kernels, and map the weights once."""
    from safetensors.numpy import load_file

    engine_dir = Path(engine_dir)
    check_compatible(engine_dir)
    meta = edir.read_meta(engine_dir).model_dump(mode="json")
    lib = _library()
    t = {k: np.ascontiguousarray(v) for k, v in load_file(str(engine_dir / WEIGHTS)).items()}
    arch = Architecture.model_validate(meta["architecture"])
    rows = []
    for i in range(arch.num_hidden_layers):
        # q4.c's layer_t.kind: 2 bits per fused linear, told by how it is stored (uint16 int4 words, int8, fp32)
        kind = sum(_KINDS[t[f"layers.{i}.{f}.w"].dtype] << (2 * j) for j, (f, _) in enumerate(_FUSED))
        row = dict.fromkeys(_COLUMNS, 0) | {"kind": kind, "window": arch.window(i) or 0}
        for col in _COLUMNS:  # linears are stored as "qkv.w", "qkv.s", ...; the rest by their layer_t name
            name = f"layers.{i}." + (col.replace("_", ".") if col[-2:] in ("_w", "_s", "_z") else col)
            if name in t:
                row[col] = _ptr(t[name])  # cos/sin: per decoder (_Decoder); absent optional tensors stay 0
        rows.append([row[k] for k in _COLUMNS])
    threads = threads_from_env()
    team = lib.team_create(threads, spin_us_from_env() * 1000)
    session = NativeSession(
        lib=lib, engine_dir=engine_dir, meta=meta, arch=arch, tensors=t, layers=np.asarray(rows, dtype=np.int64),
        family=_FamilyT(act={"silu": 0, "gelu_tanh": 1}[arch.activation], attn_scale=arch.attn_scale,
                        attn_softcap=arch.attn_softcap or 0.0),
        threads=lib.team_threads(team), team=team, max_candidates=int(meta["profile"]["max_candidates"]),
        vocab_size=int(meta["lm_head"]["vocab_size"]), context_length=arch.context_length,
    )
    if team:
        weakref.finalize(session, lib.team_destroy, team)  # the workers stop and are joined with the session
    return session


def spin_us_from_env() -> int:
    """$EDGEFLOW_ENGINE_SPIN_US (0: workers sleep at once), else SPIN_US_DEFAULT."""
    spin = int_from_env(SPIN_ENV, lo=0, hi=1_000_000,
                        meaning=f"microseconds an idle engine thread spins before it sleeps; default {SPIN_US_DEFAULT}")
    return SPIN_US_DEFAULT if spin is None else spin


class _Decoder:
    """KV cache + scratch for `slots` streams of at most `max_len` positions (one per call: thread-safe)."""

    def __init__(self, session: NativeSession, slots: int, max_len: int):
        a = session.arch
        if max_len > session.context_length:
            raise ValueError(f"{max_len} tokens exceed the engine's context length {session.context_length}")
        self.s, self.a = session, a
        self.slots, self.max_len = slots, max_len
        shape = (a.num_hidden_layers, slots, a.num_key_value_heads, max_len, a.head_dim)
        self.kc = np.empty(shape, np.float32)
        self.vc = np.empty(shape, np.float32)
        n = session.lib.llama_scratch_floats(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                             a.head_dim, a.intermediate_size, max_len, session.threads)
        self.scratch = np.empty(n, np.float32)
        self.head = _HeadBuffers(session, slots)
        # this decoder's layer table: the session's, with each layer's RoPE table (held here, so it outlives the decoder)
        self.rope = session.rope_tables(max_len)
        self.layers = session.layers.copy()
        cos, sin = _COLUMNS.index("cos"), _COLUMNS.index("sin")
        for i, kind in enumerate(a.layer_types):
            self.layers[i, cos], self.layers[i, sin] = _ptr(self.rope[kind][0]), _ptr(self.rope[kind][1])
        self.embed_scale = np.float32(a.embed_scale)

    def step(self, ids: Sequence[int], pos: Sequence[int], slots: Sequence[int]) -> np.ndarray:
        """One decoder pass over <= STEP_ROWS rows; returns the final-normed hidden states [M, hidden]."""
        s, a = self.s, self.a
        m = len(ids)
        h = np.ascontiguousarray(s.embed[np.asarray(ids, dtype=np.int64)], np.float32)
        if self.embed_scale != 1:
            h *= self.embed_scale  # Gemma: embeddings times sqrt(hidden), in fp32 as transformers does
        out = np.empty_like(h)
        p = np.asarray(pos, dtype=np.int32)
        sl = np.asarray(slots, dtype=np.int32)
        s.lib.llama_step(m, _ptr(p), _ptr(sl), _ptr(h), _ptr(self.layers), a.num_hidden_layers,
                         a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                         a.intermediate_size, a.rms_norm_eps, ctypes.addressof(s.family), _ptr(self.kc), _ptr(self.vc),
                         self.slots, self.max_len, _ptr(s.tensors["norm"]), _ptr(out), _ptr(self.scratch), s.team)
        return out

    def prefill(self, ids: Sequence[int], slot: int) -> np.ndarray:
        """Run a prompt from position 0; returns the hidden states of every position."""
        return self.prefill_many([(ids, slot)])[0]

    def prefill_many(self, prompts: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Run several prompts (ids, slot) from position 0 together, STEP_ROWS rows per step (each slot's
        rows stay consecutive and in order); returns each prompt's hidden states [len(ids), hidden]."""
        rows = [(t, p, slot, n) for n, (ids, slot) in enumerate(prompts) for p, t in enumerate(ids)]
        hs = []
        for i in range(0, len(rows), STEP_ROWS):
            chunk = rows[i:i + STEP_ROWS]
            hs.append(self.step([r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk]))
        h = np.concatenate(hs)
        owner = np.asarray([r[3] for r in rows])
        return [h[owner == n] for n in range(len(prompts))]


class _HeadBuffers:
    """Scratch for head_argmax and head_sample, kept by a decoder so a step does not map (and page-fault) fresh
    vocabulary-sized arrays for every row: 0.24 ms of head_sample's 0.9 ms on the demo student before it had its own
    (docs/benchmarks/history/2026-12-05.md). The arrays a sampled step hands to Sampler are views of these, valid until the next step."""

    def __init__(self, session: NativeSession, rows: int):
        vp, v = session.tensors["head.q8_scale"].shape[0], session.vocab_size
        self.rows = rows
        self.logits = np.zeros((rows, vp), np.float32)
        self.cand = np.zeros((rows, v), np.int32)
        self.tok = np.zeros(rows, np.int32)
        self.nc = np.zeros(rows, np.int32)
        # head_sample: the bounds, then the universe (ids, envelope weights, their running sum; q4.c head_envelope)
        self.lower, self.upper = np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.ids = np.zeros(v, np.int32)
        self.weight, self.cum = np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.envelope = np.zeros(2, np.float64)
        # sample_bounded: exact logits by universe row, the nucleus test's gaps and their selection, its counters
        self.pen, self.gap, self.sel = np.zeros(v, np.float64), np.zeros(v, np.float64), np.zeros(v, np.float64)
        self.sample_stats = np.zeros(2, np.int64)


def head_argmax(session: NativeSession, x: np.ndarray, max_candidates: int | None = None,
                buffers: _HeadBuffers | None = None) -> tuple[list[int], list[int], list[list[int]]]:
    """Exact argmax_r x[m] . E_r for each row of x [M, hidden].

    Returns (tokens, ncand, candidates): ncand[m] >= 0 is how many rows were rescored (their ids in
    candidates[m]); a negative ncand[m] = -(count) - 1 means the full fp32 pass ran for that row.
    """
    x = np.ascontiguousarray(x, np.float32)
    m, k = x.shape
    t = session.tensors
    v = session.vocab_size
    vp = t["head.q8_scale"].shape[0]
    cap = session.max_candidates if max_candidates is None else int(max_candidates)
    if buffers is None or buffers.rows < m:
        buffers = _HeadBuffers(session, m)
    scratch, cand, tok, nc = buffers.logits, buffers.cand, buffers.tok, buffers.nc
    session.lib.head_argmax(_ptr(x), m, k, v, vp, _ptr(t["head.q8"]), _ptr(t["head.q8_scale"]), _ptr(t["head.dn"]),
                            _ptr(t["head.en"]), _ptr(session.head), _ptr(scratch), _ptr(cand), cap, _ptr(tok), _ptr(nc),
                            session.team)
    ncand = nc[:m].tolist()
    with session._lock:
        st = session.stats
        st["head_calls"] += m
        st["candidates"] += sum(n if n >= 0 else -n - 1 for n in ncand)
        st["max_candidates_seen"] = max([st["max_candidates_seen"]] + [n if n >= 0 else -n - 1 for n in ncand])
        st["full_passes"] += sum(n < 0 for n in ncand)
    return tok[:m].tolist(), ncand, [cand[i, :n].tolist() if n >= 0 else [] for i, n in enumerate(ncand)]


def head_rows(session: NativeSession, x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """x . E_r in fp32 for the head rows `ids` (every row when None), from one activation row x [1, hidden]: q4.c's
    head_rows, the sum head_argmax rescores with (and on the engine's own threads, not numpy's BLAS pool)."""
    head = session.head
    if ids is None:
        out = np.empty(session.vocab_size, np.float32)
        session.lib.head_rows(_ptr(x), x.shape[1], _ptr(head), None, len(out), _ptr(out), session.team)
        return out
    rows = np.ascontiguousarray(ids, np.int32)
    out = np.empty(len(rows), np.float32)
    session.lib.head_rows(_ptr(x), x.shape[1], _ptr(head), _ptr(rows), len(rows), _ptr(out), session.team)
    return out


def head_universe(session: NativeSession, buffers: _HeadBuffers, up: np.ndarray, t: float, weights: bool) -> Universe:
    """sampling.numpy_universe by q4.c's head_envelope, into `buffers`: the same tokens, zmax and cut, with weights that
    exceed exp(up / t - zmax) by at most 2^-16 (a bound is what the rejection step needs; the draw stays exact)."""
    up = np.ascontiguousarray(up, np.float64)
    b = buffers
    n = session.lib.head_envelope(_ptr(up), len(up), float(t), TAIL_LOG, _ptr(b.ids), _ptr(b.weight) if weights else None,
                                  _ptr(b.cum) if weights else None, _ptr(b.envelope))
    zmax, cut = float(b.envelope[0]), float(b.envelope[1])
    return Universe(b.ids[:n], b.weight[:n] if weights else None, b.cum[:n] if weights else None, zmax, cut)


# Uniforms a sampled step takes from the request's generator for q4.c's sample_bounded: what REJECTION_TRIES rounds can
# use at most (a proposal's draw and its redraw test, REDRAWS + 1 times, and the acceptance test), 10 us of numpy's.
SAMPLE_UNIFORMS = REJECTION_TRIES * (2 * (REDRAWS + 1) + 1)


def _sample_in_c(session: NativeSession, b: _HeadBuffers, x: np.ndarray, sampler: Sampler) -> Token | None:
    """Sampler.draw_bounded by q4.c's sample_bounded from the (penalised) bounds in `b`: one C call instead of a Python
    call per proposal, per nucleus round and per top_k step. None: the step goes to the whole head."""
    p = sampler.params
    u = sampler.uniforms(SAMPLE_UNIFORMS)
    tids, trep, tsub = sampler.penalty_table()
    b.sample_stats[:] = 0
    token = session.lib.sample_bounded(
        _ptr(x), x.shape[1], _ptr(session.head), _ptr(b.lower), _ptr(b.upper), session.vocab_size, p.temperature,
        p.top_p, p.top_k, _ptr(tids), _ptr(trep), _ptr(tsub), len(tids), p.repetition_penalty, TAIL_LOG, REJECTION_TRIES,
        REDRAWS, NUCLEUS_ROWS, session.max_candidates, _ptr(u), len(u), _ptr(b.ids), _ptr(b.weight), _ptr(b.cum),
        _ptr(b.pen), _ptr(b.gap), _ptr(b.sel), _ptr(b.sample_stats))
    sampler.rescored += int(b.sample_stats[0])
    sampler.head_reads += int(b.sample_stats[1])
    return sampler.emit(token) if token >= 0 else None


def head_sample(session: NativeSession, x: np.ndarray, sampler: Sampler, buffers: _HeadBuffers | None = None) -> Token:
    """The next token of one stream whose request samples (or penalises, or asks for logprobs).

    The int8 head gives a_r and, as in head_argmax, a bound e_r with |x . E_r - a_r| <= e_r, so every logit lies in
    [a_r - e_r, a_r + e_r] (q4.c's head_bounds, one pass). `Sampler.draw_bounded` draws from those bounds and the fp32
    logits of the rows it asks for (head_rows), exactly from the distribution the full head gives (rejection sampling,
    see there); q4.c's sample_bounded runs the same draw in one call (the Python one remains for Gemma 2's softcap).
    When that would take more than `max_candidates` rows, and for logprobs (which need the normaliser), the full fp32
    head runs instead.
    """
    x = np.ascontiguousarray(x, np.float32).reshape(1, -1)
    k = x.shape[1]
    t = session.tensors
    v = session.vocab_size
    vp = t["head.q8_scale"].shape[0]
    token = None
    before, reads = sampler.rescored, sampler.head_reads
    if not sampler.params.logprobs:
        b = buffers if buffers is not None else _HeadBuffers(session, 1)
        a, lower, upper = b.logits[0], b.lower, b.upper
        session.lib.head_bounds(_ptr(x), k, v, vp, _ptr(t["head.q8"]), _ptr(t["head.q8_scale"]), _ptr(t["head.dn"]),
                                _ptr(t["head.en"]), _ptr(a), _ptr(lower), _ptr(upper), session.team)
        if not session.arch.final_softcap:
            sampler.penalised_bounds(lower, upper, in_place=True)
            token = _sample_in_c(session, b, x, sampler)
        else:  # monotone: the capped bounds bound the capped logits
            cap = session.arch.final_softcap
            lower, upper = cap * np.tanh(lower / cap), cap * np.tanh(upper / cap)
            token = sampler.draw_bounded(lower, upper, lambda ids: session.logits(head_rows(session, x, ids)),
                                         session.max_candidates, partial(head_universe, session, b), scratch=True)
    full = token is None
    if full:
        token = sampler.choose(np.arange(v), session.logits(head_rows(session, x)))
    with session._lock:
        st = session.stats
        st["sampled"] += 1
        st["sampled_candidates"] += v if full else sampler.rescored - before
        st["sampled_full_passes"] += int(full) + sampler.head_reads - reads
    return token
