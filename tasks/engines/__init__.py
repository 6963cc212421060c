"""Engine backends behind one dict.

Every backend module exports the same functions with the same signatures, so the
server and the consistency gate never branch on hardware:

    build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict
        Compile a checkpoint (dense safetensors or an llm-compressor compressed-tensors
        directory) into an engine directory; writes and returns `engine.json` metadata
        (backend, versions, build flags, device fingerprint, checkpoint sha256).
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
        `sampling` (tasks.engines.sampling); with it, the request's temperature, top_p, top_k, seed and
        penalties, and `Token`s (ints) carrying logprobs when it asks for them.
    sampling_support() -> frozenset[str]
        The sampling parameters (tasks.engines.sampling.PARAMETERS) this backend honours; the server
        refuses a request that sets any other with a 400 naming the parameter and the backend.
    score(session, input_ids: list[int]) -> numpy.ndarray
        Logits for every position of `input_ids`, shape [len(input_ids), vocab], float32
        (teacher-forced; used by the consistency gate).

`tensorrt_llm` is imported only inside its own module: importing this package never needs a GPU.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS: dict[str, str] = {
    "cpu": "tasks.engines.cpu_onnx",
    "cpu_native": "tasks.engines.cpu_native",
    "tensorrt_llm": "tasks.engines.tensorrt_llm",
}

API = ("build", "check_compatible", "build_identity", "load", "generate", "score", "sampling_support")


class EngineIncompatibleError(RuntimeError):
    """The engine was built for another device, runtime version or checkpoint."""


def get_backend(name: str) -> ModuleType:
    """Import the backend module registered under `name`."""
    if name not in BACKENDS:
        raise ValueError(f"engine.backend={name!r} is unknown; choose one of {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
