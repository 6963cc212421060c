"""Engine backends behind one dict, held to one API (`Backend`).

    python -c "from edgeflow.engines import get_backend; print(get_backend('cpu_native').build_identity())"

Every backend module exports the same names with the same signatures (tests/engines/test_contract.py
compares each against `Backend`), so the server and the consistency gate never branch on hardware:

    Profile
        The backend's pydantic build-profile model (extra="forbid"); `engine.profile` is validated
        against it when the edgeflow profile loads (`validate_profile`).
    build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict
        Compile a checkpoint (dense safetensors or an llm-compressor compressed-tensors directory,
        read by edgeflow.engines.checkpoint) into an engine directory; writes and returns `engine.json`
        (edgeflow.engines.engine_dir.EngineMeta: backend, format, precision, checkpoint sha256, files,
        build identity, plus the backend's own keys).
    check_compatible(engine_dir: Path) -> None
        Raise EngineIncompatibleError, naming both sides, if this device cannot run the engine.
    build_identity() -> str
        What of this machine's builder decides whether an engine built earlier still loads here
        (engine format, kernel source, runtime versions, GPU); part of the build stage's cache key,
        so upgrading edgeflow or the runtime rebuilds engines instead of reusing ones it would refuse.
    load(engine_dir: Path) -> Any
        Check compatibility, then load; returns an opaque session handle.
    generate(session, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
             sampling: SamplingParams | None = None) -> Iterator[int]
        Decoding with a KV cache; yields new token ids one at a time (streaming). Greedy without
        `sampling` (edgeflow.engines.sampling); with it, the request's temperature, top_p, top_k, seed and
        penalties, and `Token`s (ints) carrying logprobs when it asks for them.
    sampling_support() -> frozenset[str]
        The sampling parameters (edgeflow.engines.sampling.PARAMETERS) this backend honours; the server
        refuses a request that sets any other with a 400 naming the parameter and the backend.
    score(session, input_ids: list[int]) -> numpy.ndarray
        Logits for every position of `input_ids`, shape [len(input_ids), vocab], float32
        (teacher-forced; used by the consistency gate).
    device_memory_used(session) -> float | None
    device_utilization(session) -> float | None
        Bytes the engine holds on its device, and the device's busy fraction in [0, 1]; None where
        the device is this process's own memory and CPU (the server then reports process RSS).
        `edgeflow.engines.hooks` holds these defaults; the GPU backend implements both.

`tensorrt_llm` is imported only inside its own backend: importing this package never needs a GPU.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    from pydantic import BaseModel

    from edgeflow.engines.sampling import SamplingParams

# The one list of backend names (EngineConfig.backend, the server's --backend and the docs read it).
BACKENDS: dict[str, str] = {
    "cpu": "edgeflow.engines.cpu_onnx",
    "cpu_native": "edgeflow.engines.cpu_native",
    "llama_cpp": "edgeflow.engines.llama_cpp",
    "edge_llm": "edgeflow.engines.edge_llm",
    "tensorrt_llm": "edgeflow.engines.tensorrt_llm",
    "vllm": "edgeflow.engines.vllm_engine",
}


class EngineIncompatibleError(RuntimeError):
    """The engine was built for another device, runtime version or checkpoint."""


class Backend(Protocol):
    """What every module in BACKENDS exports (see the module docstring for each name's contract)."""

    Profile: type[BaseModel]

    def build(self, checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict: ...
    def check_compatible(self, engine_dir: Path) -> None: ...
    def build_identity(self) -> str: ...
    def load(self, engine_dir: Path) -> Any: ...
    def generate(self, session: Any, input_ids: list[int], max_new_tokens: int, stop_token_ids: Sequence[int],
                 sampling: SamplingParams | None = None) -> Iterator[int]: ...
    def sampling_support(self) -> frozenset[str]: ...
    def score(self, session: Any, input_ids: list[int]) -> np.ndarray: ...
    def device_memory_used(self, session: Any) -> float | None: ...
    def device_utilization(self, session: Any) -> float | None: ...


# Names every backend exports: the Protocol's members (kept in step with it by the contract test).
API = ("Profile", "build", "check_compatible", "build_identity", "load", "generate", "score", "sampling_support",
       "device_memory_used", "device_utilization")


# Requests generate_many keeps in flight at once: the cpu_native scheduler decodes 4 streams a step (MAX_ROWS), a GPU
# engine batches more. 16 greedy continuations of 32 tokens on the demo's engines (2-core AMD EPYC), one at a time
# against 16 at once: fp32 16.4 s / 4.7 s, gptq-w8a16 11.6 s / 5.1 s, gptq-w4a16 3.8 s / 2.1 s, the same tokens
# (BENCHMARKS.md#gate-batching).
GENERATE_MANY_STREAMS = 16


def generate_many(backend: ModuleType, session: Any, prompts: Sequence[list[int]], max_new_tokens: int,
                  stop_token_ids: Sequence[int], sampling: SamplingParams | None = None) -> list[list[int] | ValueError]:
    """Every prompt's generation (`backend.generate`), in flight together as concurrent server requests are, so a
    backend that batches streams reads its weights once per step for all of them. In prompt order: the tokens, or
    the ValueError with which the engine refused that prompt (any other error is raised)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(ids: list[int]) -> list[int] | ValueError:
        try:
            return list(backend.generate(session, ids, max_new_tokens, stop_token_ids, sampling))
        except ValueError as e:
            return e

    if not prompts:
        return []
    with ThreadPoolExecutor(max_workers=min(len(prompts), GENERATE_MANY_STREAMS), thread_name_prefix="generate-many") as pool:
        return list(pool.map(one, prompts))


def get_backend(name: str) -> ModuleType:
    """Import the backend module registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"engine.backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def check_model(backend: str, config: dict, profile: dict | None, where: str) -> None:
    """What a backend refuses about a model given its engine profile, before any work (e.g. a family that the build
    profile's TensorRT-LLM release does not convert yet). Optional per backend (`check_model(config, profile, where)`
    in its module); the family matrix itself is edgeflow.model.architecture.require's."""
    hook = getattr(get_backend(backend), "check_model", None)
    if hook is not None:
        hook(config, profile, where)


def validate_profile(backend: str, profile: dict | None) -> BaseModel:
    """`profile` checked against the backend's Profile model; ValueError naming the key, the value and the fix."""
    from pydantic import ValidationError

    model = get_backend(backend).Profile
    profile = dict(profile or {})
    known = sorted(model.model_fields)
    unknown = sorted(set(profile) - set(known))
    if unknown:
        raise ValueError(f"unknown {backend} engine profile keys {unknown}; known: {known}")
    try:
        return model.model_validate(profile)
    except ValidationError as e:
        problems = "; ".join(
            (f"{'.'.join(map(str, err['loc']))}={err['input']!r}: " if err["loc"] else "")
            + err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise ValueError(f"{backend} engine profile is invalid: {problems}") from None
