"""The engine runtime: one compiled engine directory loaded through its backend, and generations on it.

    rt = Runtime(Path("engines/cpu"), settings); await rt.load(); gen = Generation(rt, ids, 16, deadline, on_done)

* `Runtime` reads engine.json (which backend built the engine, its versions), the tokenizer and
  generation_config.json from the engine dir, loads the backend session in its executor, warms it up,
  answers the one-token health probe and the device hooks (memory, utilisation). Every engine call goes
  through `Runtime.generate`, which tells the watchdog about each token.
* `Generation` runs one engine call in a worker thread and hands its tokens to the event loop, with the
  request's deadline (`DeadlineExceeded`) and engine errors (`EngineFailed`) raised on the loop side.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psutil

from edgeflow.serving.watchdog import Watchdog
from edgeflow.engines.sampling import SamplingParams

if TYPE_CHECKING:
    from edgeflow.serving.settings import ServerSettings

log = logging.getLogger("edgeflow.serving")

_VERSION_RE = re.compile(r"^\d+(\.\d+)+\S*$")


class DeadlineExceeded(Exception):
    pass


class EngineFailed(Exception):
    pass


# generation_config.json keys that set a request's defaults (vLLM's `--generation-config auto` set).
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(engine_dir: Path) -> dict[str, Any]:
    """Sampling defaults from the engine's generation_config.json (copied from the checkpoint at build).

    Only keys present are taken; `do_sample: false` there means greedy (its temperature is ignored).
    A missing or unreadable file means greedy defaults; a value out of range is refused at startup."""
    path = Path(engine_dir) / "generation_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    out = {k: cfg[k] for k in _GENERATION_KEYS if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)}
    if cfg.get("do_sample") is False:
        out.pop("temperature", None)
        out.pop("top_p", None)
        out.pop("top_k", None)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; fix the file or remove the key") from None
    return out


class Runtime:
    """The loaded engine plus what the HTTP layer needs to talk to it."""

    def __init__(self, engine_dir: Path, settings: ServerSettings) -> None:
        from edgeflow.serving.tokenizer import LightTokenizer
        from edgeflow.engines import get_backend

        self.engine_dir = Path(engine_dir)
        meta_path = self.engine_dir / "engine.json"
        self.meta, self.created = self._read_engine_json(meta_path)
        built_for = self.meta.get("backend")
        if settings.backend is None:
            settings = settings.model_copy(update={"backend": built_for})
        if built_for != settings.backend:
            raise ValueError(
                f"{meta_path}: engine backend is {built_for!r} but the server is configured with backend={settings.backend!r}"
            )
        self.backend: ModuleType = get_backend(settings.backend)
        self.settings = settings
        # The tokenizer is cheap to load and needed to validate requests, so it loads here; the
        # engine session loads in the background (`load`) so /ready can say 503 meanwhile.
        # LightTokenizer, not transformers: importing transformers alone adds ~500 MB (torch) to the server.
        self.tokenizer = LightTokenizer(self.engine_dir)
        self.stop_ids = self._stop_ids()
        self.vocab_size = len(self.tokenizer.get_vocab())
        self.engine_version = settings.engine_version or self._default_engine_version()
        self.runtime_versions = {
            k: v for k, v in sorted(self.meta.items()) if isinstance(v, str) and _VERSION_RE.match(v)
        }
        self.session: Any = None
        self.state = "loading"
        self.ready_at: float | None = None
        self.reason = "engine is loading"
        self.probe_ids = self.tokenizer("Hello", add_special_tokens=False)["input_ids"] or [self.stop_ids[0]]
        self.sampling_support: frozenset[str] = self.backend.sampling_support()
        self.sampling_defaults = generation_defaults(self.engine_dir)
        self.executor = ThreadPoolExecutor(max_workers=settings.max_concurrency + 1, thread_name_prefix="engine")
        self._probe: asyncio.Future | None = None
        self.watchdog = Watchdog(settings.watchdog_stall_s)

    def _read_engine_json(self, meta_path: Path) -> tuple[dict[str, Any], int]:
        """engine.json of the engine dir (edgeflow.engines.engine_dir: which backend built it, its versions) and its
        mtime (the model's `created`); EngineIncompatibleError when the directory has none or it does not parse."""
        from edgeflow.engines.engine_dir import read_meta

        meta = read_meta(self.engine_dir).model_dump(mode="json")
        return meta, int(meta_path.stat().st_mtime)

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int],
                 sampling: SamplingParams | None = None) -> Iterator[int]:
        """`backend.generate`, with the watchdog told about every token; every engine call goes through here."""
        call = self.watchdog.begin()
        gen = self.backend.generate(self.session, input_ids, max_new_tokens, stop_ids, sampling)
        stall_after, corrupt = self.settings.fault_stall_after_tokens, self.settings.fault_corrupt_every
        if self._wedged():
            threading.Event().wait()  # chaos: the whole engine wedged (never returns; the watchdog ends the process)
        try:
            for i, token in enumerate(gen):
                if stall_after is not None and i >= stall_after:
                    threading.Event().wait()  # chaos: hang the way a stuck kernel does (never returns)
                self.watchdog.progress(call)
                if corrupt is not None and (i + 1) % corrupt == 0 and token not in stop_ids:
                    token += 1  # chaos: a wrong token (never a stop token); the request still succeeds
                    while token in stop_ids or token >= self.vocab_size:
                        token = (token + 1) % self.vocab_size
                yield token
        finally:
            self.watchdog.end(call)
            close = getattr(gen, "close", None)
            if close:
                close()

    def _wedged(self) -> bool:
        """Chaos (`fault_stall_after_s`): the engine has been ready that long, in the server's first start."""
        after = self.settings.fault_stall_after_s
        return (after is not None and self.ready_at is not None and time.monotonic() - self.ready_at >= after
                and os.environ.get("EDGEFLOW_SERVER_RESTARTS", "0") == "0")

    def _stop_ids(self) -> list[int]:
        """Where a generation stops (edgeflow.engines.engine_dir.stop_ids: eos, generation_config's eos list, the
        family's end-of-turn tokens), plus the server tokenizer's own eos."""
        from edgeflow.engines.engine_dir import stop_ids

        ids = set(stop_ids(self.engine_dir))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        if not ids:
            raise ValueError(f"{self.engine_dir}: tokenizer has no eos_token and no <|endoftext|>; cannot stop generation")
        return sorted(ids)

    def _default_engine_version(self) -> str:
        if self.meta.get("engine_version"):
            return str(self.meta["engine_version"])
        sha = self.meta.get("checkpoint_sha256")
        return f"{self.meta['backend']}-{sha[:12]}" if sha else str(self.meta["backend"])

    def engine_info(self) -> dict[str, Any]:
        return {"backend": self.meta["backend"], "runtime": self.runtime_versions, "engine_version": self.engine_version,
                "sampling_defaults": self.sampling_defaults, "sampling_support": sorted(self.sampling_support)}

    async def load(self) -> None:
        """Load the session and run one warm-up generation, then mark ready (or failed, with why)."""
        loop = asyncio.get_running_loop()
        try:
            self.session = await loop.run_in_executor(self.executor, self.backend.load, self.engine_dir)
            warm = await loop.run_in_executor(self.executor, self._generate_n, 2)
            log.info("engine %s ready (warm-up produced %d tokens)", self.engine_version, warm)
            self.state, self.reason = "ready", "ready"
            self.ready_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - any load failure must show up in /ready and /health
            log.exception("engine load failed")
            self.state, self.reason = "failed", f"engine load failed: {type(e).__name__}: {e}"

    def _generate_n(self, n: int) -> int:
        # No stop ids: the probe must exercise a real decode step even if the model would stop.
        gen = self.generate(list(self.probe_ids), n, [])
        try:
            return len(list(itertools.islice(gen, n)))
        finally:
            gen.close()

    async def probe(self) -> float:
        """One-token generation in the engine executor; seconds taken. Single flight: concurrent
        probes share one run, and a probe still stuck from before is awaited, not duplicated."""
        if self.state != "ready":
            raise EngineFailed(self.reason)
        if self._probe is None or self._probe.done():
            loop = asyncio.get_running_loop()

            def timed() -> float:
                t0 = time.monotonic()
                if self._generate_n(1) != 1:
                    raise RuntimeError("engine produced no token for the health probe")
                return time.monotonic() - t0

            self._probe = loop.run_in_executor(self.executor, timed)
        try:
            return await asyncio.wait_for(asyncio.shield(self._probe), self.settings.health_timeout_s)
        except TimeoutError:
            raise EngineFailed(
                f"engine did not produce a token within health_timeout_s={self.settings.health_timeout_s}"
            ) from None
        except Exception as e:  # noqa: BLE001
            raise EngineFailed(f"health probe failed: {type(e).__name__}: {e}") from None

    def device_memory_used(self) -> float:
        """Bytes the engine holds: the backend's device_memory_used where the engine has a device of its own
        (edgeflow.engines API; None for the CPU backends), else this process's RSS."""
        if self.session is not None:
            with contextlib.suppress(Exception):
                used = self.backend.device_memory_used(self.session)
                if used is not None:
                    return float(used)
        return float(psutil.Process().memory_info().rss)

    def device_utilization(self) -> float | None:
        """The engine device's busy fraction (edgeflow.engines API); None where not applicable or not loaded."""
        if self.session is None:
            return None
        with contextlib.suppress(Exception):
            return self.backend.device_utilization(self.session)
        return None


class Generation:
    """Runs `backend.generate` in a worker thread and hands tokens to the event loop.

    The thread checks `cancel` after every token, so a cancelled generation (client gone,
    deadline) stops at its next token; `on_done` runs on the loop once the thread has exited.
    """

    def __init__(
        self,
        runtime: Runtime,
        input_ids: list[int],
        max_new_tokens: int,
        deadline: float,
        on_done: Callable[[], None],
        sampling: SamplingParams | None = None,
    ) -> None:
        self.runtime = runtime
        self.sampling = sampling
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.deadline = deadline
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_done = on_done
        self.token_times: list[float] = []

    def start(self) -> None:
        self.runtime.executor.submit(self._run)

    def cancel(self) -> None:
        self.cancelled.set()

    def fail(self, reason: str) -> None:
        """End the consumer with an engine error now, even if the engine thread is stuck."""
        self.cancelled.set()
        self._post(("error", reason))

    def _post(self, item: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def _run(self) -> None:
        gen = None
        try:
            gen = self.runtime.generate(self.input_ids, self.max_new_tokens, self.runtime.stop_ids, self.sampling)
            for token in gen:
                if self.cancelled.is_set():
                    break
                self._post(("token", token, time.monotonic()))  # an int, or a Token carrying logprobs
                if time.monotonic() >= self.deadline:
                    self._post(("timeout",))
                    break
        except Exception as e:  # noqa: BLE001 - reported to the client as an engine error
            log.exception("generation failed")
            self._post(("error", f"{type(e).__name__}: {e}"))
        finally:
            if gen is not None and hasattr(gen, "close"):
                with contextlib.suppress(Exception):
                    gen.close()
            self._post(("end",))
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.on_done)

    async def tokens(self) -> AsyncIterator[int]:
        """Token ids as produced; DeadlineExceeded past the deadline, EngineFailed on engine errors."""
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                # Waiting here (not only in the thread) bounds the wait even if one engine step hangs.
                item = await asyncio.wait_for(self.events.get(), remaining)
            except TimeoutError:
                self.cancel()
                raise DeadlineExceeded from None
            kind = item[0]
            if kind == "token":
                self.token_times.append(item[2])
                yield item[1]
            elif kind == "timeout":
                raise DeadlineExceeded
            elif kind == "error":
                raise EngineFailed(item[1])
            else:
                return
