"""What GPU and TensorRT stack this machine has, and whether an engine built elsewhere runs on it.

    python -c "from edgeflow.engines.tensorrt_llm.device import device_fingerprint; print(device_fingerprint())"

A TensorRT engine holds kernels for the GPU architecture (sm80 A100, sm87 Orin) and the TensorRT /
TensorRT-LLM versions that built it: `compare` refuses any other device naming both sides, the build
stage's cache key (`build_identity`, `cache_key`) keeps engines of different devices apart, and
`check_build_environment` refuses to build anywhere but on the profile's target.

Both sides also carry a TensorRT-LLM API generation (plan.API_GENERATIONS): the engine's is engine.json's
`api` ("tensorrt-engine"; an engine.json without it, from builds before the field, reads as that legacy
flow), the device's is what its installed TensorRT-LLM offers ("pytorch-llm-api" from 1.3.0rc21 on, which
has no TensorRT engine runtime at all). Every refusal names both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import sha256_json
from edgeflow.engines import EngineIncompatibleError, engine_dir as edir
from edgeflow.engines.gpu_host import JETPACK_BY_L4T, dist_version, gpu_fingerprint, mmp, parse_nv_tegra_release  # noqa: F401 (re-exported)
from edgeflow.engines.tensorrt_llm.plan import (
    BACKEND,
    TRTLLM_SRC_ENV,
)
from edgeflow.engines.tensorrt_llm.versions import (
    API_GENERATIONS,
    BACKEND_API,
    api_generation_of,
)


def device_fingerprint() -> dict[str, Any]:
    """The GPU fingerprint (edgeflow.engines.gpu_host) plus the installed TensorRT-LLM's version."""
    return gpu_fingerprint() | {"tensorrt_llm": dist_version("tensorrt_llm", "tensorrt-llm")}


_mmp = mmp


def engine_api(engine_meta: dict[str, Any]) -> tuple[str, bool]:
    """(API generation of the engine, whether it was implied): engine.json's `api`, else the legacy flow."""
    api = engine_meta.get("api")
    return (api, False) if api else (BACKEND_API, True)


def _api_label(api: str | None, implied: bool = False) -> str:
    if api is None:
        return "API none"
    return f"API {api}" + (", implied: engine.json predates its api field" if implied else "")


def compare(engine_meta: dict[str, Any], device: dict[str, Any]) -> None:
    """Raise EngineIncompatibleError naming both sides (SM, TensorRT-LLM version and API generation) if `device`
    cannot run the engine described by engine_meta."""
    backend = engine_meta.get("backend")
    if backend != BACKEND:
        raise EngineIncompatibleError(
            f"engine backend is {backend!r}; this backend runs {BACKEND!r} engines (load it with the {backend!r} backend)"
        )
    e_sm, e_llm, e_trt = engine_meta.get("sm"), engine_meta.get("tensorrt_llm"), engine_meta.get("tensorrt")
    e_api, implied = engine_api(engine_meta)
    built = f"engine built for {e_sm} with TensorRT-LLM {e_llm} ({_api_label(e_api, implied)})"
    if e_api != BACKEND_API:
        raise EngineIncompatibleError(
            f"{built}: this backend runs {BACKEND_API!r} engines (API generations: "
            f"{ {k: g.range() for k, g in API_GENERATIONS.items()} }). Fix: load it with the backend that built it, "
            "or rebuild with this backend"
        )
    fix = f"Fix: rebuild the engine on this device (build() with a build profile whose target is {device.get('sm')})"
    if not device.get("cuda_available") or not device.get("sm"):
        raise EngineIncompatibleError(
            f"{built}; this device has no CUDA GPU ({device.get('reason') or 'none found'}). "
            f"Fix: run it on an {e_sm} device with TensorRT-LLM {e_llm}, or serve the cpu backend here"
        )
    d_sm, d_llm, d_trt = device["sm"], device.get("tensorrt_llm"), device.get("tensorrt")
    d_api = api_generation_of(d_llm)
    here = f"this device is {d_sm} with {d_llm or 'no TensorRT-LLM'} ({_api_label(d_api)})"
    if d_sm != e_sm:
        raise EngineIncompatibleError(
            f"{built}; {here}: a TensorRT engine holds kernels for the GPU architecture that built it. {fix}"
        )
    if d_llm is None:
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} with no TensorRT-LLM installed (tensorrt_llm not importable). "
            f"Fix: install TensorRT-LLM {e_llm} here"
        )
    if d_api is not None and d_api != e_api:  # an unparseable version fails the exact-version check below
        gen = API_GENERATIONS[e_api]
        raise EngineIncompatibleError(
            f"{built}; {here}: TensorRT-LLM removed the {e_api!r} flow (TensorRT engines, ModelRunnerCpp) in "
            f"{gen.removed_in}, so this TensorRT-LLM cannot load the engine at all. Fix: install TensorRT-LLM {e_llm} "
            "here, or serve the checkpoint with the vllm backend"
        )
    if _mmp(d_llm) != _mmp(e_llm) or _mmp(e_llm) is None:
        raise EngineIncompatibleError(
            f"{built}; {here}: TensorRT-LLM versions must match exactly (major.minor.patch), "
            f"engine plans and plugins are not portable across versions. {fix}, or install TensorRT-LLM {e_llm}"
        )
    if d_trt is None:
        raise EngineIncompatibleError(
            f"{built} and TensorRT {e_trt}; this device ({d_sm}) has no TensorRT Python bindings. Fix: install TensorRT {e_trt}"
        )
    if _mmp(d_trt) != _mmp(e_trt) or _mmp(e_trt) is None:
        raise EngineIncompatibleError(
            f"{built} and TensorRT {e_trt}; this device ({d_sm}) has TensorRT {d_trt}: a serialized TensorRT plan "
            f"only deserializes with the TensorRT version that built it. {fix}"
        )


# Fingerprint fields an engine depends on: architecture, the exact software that compiled it, and
# the Jetson OS image. The driver is left out (engines do not depend on it), so a driver update
# alone does not trigger a rebuild.
DEVICE_KEY_FIELDS = ("sm", "device_name", "cuda_version", "tensorrt", "tensorrt_llm", "l4t_release", "jetpack")


def cache_key(checkpoint_sha256: str, build_profile: dict, device: dict) -> str:
    """Device engine cache key: same checkpoint + build profile + device fingerprint -> same key (reuse)."""
    return sha256_json({
        "backend": BACKEND,
        "checkpoint_sha256": checkpoint_sha256,
        "build_profile": build_profile,
        "device": {k: device.get(k) for k in DEVICE_KEY_FIELDS},
    })


def build_identity() -> str:
    """What decides whether an engine built earlier still loads here: the GPU architecture and the
    TensorRT / TensorRT-LLM / L4T versions (a TensorRT engine runs only where it was built)."""
    return build_identity_of(device_fingerprint())


def build_identity_of(fp: dict[str, Any]) -> str:
    """build_identity() of the machine `fp` (a device_fingerprint()) describes."""
    return (f"{BACKEND} {fp.get('sm')}, TensorRT {fp.get('tensorrt')}, TensorRT-LLM {fp.get('tensorrt_llm')}, "
            f"L4T {fp.get('l4t_release')}")


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.read_meta(engine_dir)
    if meta.backend == BACKEND:  # another backend's engine: `compare` names both sides
        meta = edir.check_meta(engine_dir, BACKEND)  # every engine file present
    compare(meta.model_dump(mode="json"), device_fingerprint())


def check_build_environment(plan: dict[str, Any], device: dict[str, Any]) -> None:
    """Refuse to build (before running anything) unless this host is the profile's target with its TensorRT-LLM."""
    bp = plan["build_profile"]
    target, want = bp["target"], bp["tensorrt_llm_version"]
    name = plan["build_profile_name"]
    have = device.get("tensorrt_llm")  # from the installed distribution's metadata (device_fingerprint)
    if have is None:
        raise RuntimeError(
            f"build profile {name!r} needs TensorRT-LLM {want} ({bp['tensorrt_llm_branch']}); tensorrt_llm is not "
            f"importable here. Fix: build on the {target} target with TensorRT-LLM {want} installed"
        )
    if not device.get("cuda_available"):
        raise EngineIncompatibleError(
            f"build profile {name!r} targets {target}; this host has no CUDA GPU ({device.get('reason')}). "
            f"Fix: build on the {target} device itself (engines only run on the architecture that built them)"
        )
    if device["sm"] != target:
        raise EngineIncompatibleError(
            f"build profile {name!r} targets {target} with TensorRT-LLM {want}; this device is {device['sm']} with {have}: "
            "an engine built here would only run on this architecture. Fix: build on the target device, or pick the "
            f"profile for {device['sm']}"
        )
    have_api = api_generation_of(have)
    if have_api is not None and have_api != bp.get("api", BACKEND_API):
        gen = API_GENERATIONS[bp.get("api", BACKEND_API)]
        raise EngineIncompatibleError(
            f"build profile {name!r} drives API {gen.name} (TensorRT-LLM {gen.range()}, pinned {want}); this device has "
            f"TensorRT-LLM {have} (API {have_api}): {gen.removed_in} removed convert_checkpoint.py, trtllm-build and "
            f"ModelRunnerCpp. Fix: install TensorRT-LLM {want}, or serve the checkpoint with the vllm backend"
        )
    if _mmp(have) is None or _mmp(have)[:2] != _mmp(want)[:2]:
        raise EngineIncompatibleError(
            f"build profile {name!r} was written for TensorRT-LLM {want} ({bp['tensorrt_llm_branch']}); this device "
            f"has {have}: its converter and trtllm-build flags differ. Fix: install {want} or use a profile for {have}"
        )
    if bp.get("jetpack") and device.get("jetpack") and device["jetpack"] != bp["jetpack"]:
        raise EngineIncompatibleError(
            f"build profile {name!r} needs JetPack {bp['jetpack']}; this device runs JetPack {device['jetpack']} "
            f"(L4T {device.get('l4t_release')}). Fix: flash JetPack {bp['jetpack']} or use a matching profile"
        )
    script = Path(plan["commands"]["convert"][1])
    if not script.exists():
        raise RuntimeError(
            f"{script} not found: convert_checkpoint.py ships in the TensorRT-LLM source tree, not the wheel. Fix: "
            f"check out {bp['tensorrt_llm_branch']} and set profile tensorrt_llm_src or ${TRTLLM_SRC_ENV}"
        )
