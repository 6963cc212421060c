"""Whether this machine can run a vllm engine: the GPU fingerprint plus the installed vLLM, and a pure comparison.

    python -c "from edgeflow.engines.vllm_engine.device import device_fingerprint; print(device_fingerprint())"

A vllm engine directory holds the checkpoint itself (vLLM compiles nothing ahead of time), so nothing binds it
to one GPU or one CUDA build. What does: a CUDA GPU at least as new as the engine's `min_sm` (vLLM's
compressed-tensors weight-only kernels) and the vLLM release whose API the backend's engine arguments,
sampling mapping and prompt-logprob reading were written for (major.minor: vLLM changes those across minor
releases, e.g. 0.34 refusing act-order 'group' checkpoints that earlier releases loaded).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeflow.engines import EngineIncompatibleError, engine_dir as edir
from edgeflow.engines.gpu_host import dist_version, gpu_fingerprint, mmp
from edgeflow.engines.vllm_engine.plan import BACKEND, FORMAT_VERSION, sm_number


def device_fingerprint() -> dict[str, Any]:
    """The GPU fingerprint (edgeflow.engines.gpu_host) plus the installed vLLM's version (None when absent)."""
    return gpu_fingerprint() | {"vllm": dist_version("vllm")}


def _minor(version: str | None) -> tuple[int, ...] | None:
    v = mmp(version)
    return v[:2] if v else None


def compare(engine_meta: dict[str, Any], device: dict[str, Any]) -> None:
    """Raise EngineIncompatibleError naming both sides and the fix if `device` cannot run the engine."""
    backend = engine_meta.get("backend")
    if backend != BACKEND:
        raise EngineIncompatibleError(
            f"engine backend is {backend!r}; this backend runs {BACKEND!r} engines (load it with the {backend!r} backend)")
    e_sm, e_v = engine_meta.get("min_sm"), engine_meta.get("vllm_version")
    built = f"engine needs a CUDA GPU of {e_sm} or newer with vLLM {e_v}"
    if not device.get("cuda_available") or not device.get("sm"):
        raise EngineIncompatibleError(
            f"{built}; this device has no CUDA GPU ({device.get('reason') or 'none found'}). Fix: load it on an A100 "
            f"(sm80) host with vllm=={e_v}, or serve the cpu backend here (engine.backend: cpu)")
    d_sm, d_v = device["sm"], device.get("vllm")
    if sm_number(e_sm) is None or sm_number(d_sm) is None or sm_number(d_sm) < sm_number(e_sm):
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} ({device.get('device_name')}), older than the engine's minimum: vLLM's "
            f"weight-only kernels (Marlin) and the engine's dtype need {e_sm}. Fix: load it on a {e_sm}+ GPU (A100 "
            f"sm80, H100 sm90), or rebuild with engine.profile.min_sm and dtype float16 for this GPU")
    if d_v is None:
        raise EngineIncompatibleError(
            f"{built}; this device ({d_sm}) has no vLLM installed (no 'vllm' distribution). Fix: pip install "
            f"vllm=={e_v} (the pyproject extra `vllm`)")
    if _minor(e_v) is None or _minor(d_v) != _minor(e_v):
        raise EngineIncompatibleError(
            f"{built}; this device ({d_sm}) has vLLM {d_v}: major.minor differ, and the engine's arguments, sampling "
            f"mapping and prompt-logprob reading follow vLLM {e_v}'s API. Fix: pip install vllm=={e_v}, or rebuild "
            f"the engine with engine.profile.vllm_version={d_v!r} once that release is checked")


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine in `engine_dir`."""
    meta = edir.read_meta(engine_dir)
    if meta.backend == BACKEND:  # another backend's engine: `compare` names both sides
        meta = edir.check_meta(engine_dir, BACKEND)  # every engine file present
    compare(meta.model_dump(mode="json"), device_fingerprint())


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: this backend's engine layout, the
    installed vLLM and the GPU architecture (part of the build stage's cache key)."""
    return build_identity_of(device_fingerprint())


def build_identity_of(fp: dict[str, Any]) -> str:
    """build_identity() of the machine `fp` (a device_fingerprint()) describes."""
    return f"{BACKEND} engine dir v{FORMAT_VERSION}, vLLM {fp.get('vllm') or 'not installed'}, {fp.get('sm') or 'no CUDA GPU'}"


def check_build_host(vllm_version: str, installed: str | None) -> None:
    """Refuse to record an engine for one vLLM release on a host that has another installed (ValueError)."""
    if installed is not None and _minor(installed) != _minor(vllm_version):
        raise ValueError(
            f"engine.profile.vllm_version={vllm_version!r} but this host has vLLM {installed}: the engine would be "
            f"refused here. Fix: set engine.profile.vllm_version={installed!r} or install vllm=={vllm_version}")
