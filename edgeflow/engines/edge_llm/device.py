"""What Edge-LLM stack this machine has, whether it may export or build, and whether an engine runs here.

    python -c "from edgeflow.engines.edge_llm.device import device_fingerprint; print(device_fingerprint())"

An Edge-LLM engine is a TensorRT plan plus Edge-LLM's plugin library: it runs only on the GPU architecture
(sm87 for AGX Orin), the JetPack (its L4T release and TensorRT) and the Edge-LLM release that built it
(support matrix: docs/source/user_guide/getting_started/support-matrix.md, "Build location: Device";
the JetPack 7.2 deployment guide: "rebuild the engine on the target JetPack 7.2 system"). `compare` refuses
anything else naming both sides; `check_build_environment` refuses to build the engine anywhere but on the
profile's target; `check_export_environment` needs only the exporter at the profile's version.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import sha256_json
from edgeflow.engines import EngineIncompatibleError, engine_dir as edir
from edgeflow.engines.edge_llm.plan import API_GENERATION, BACKEND, EDGE_LLM_SRC_ENV, EXPORTER_PYTHON_ENV, edge_llm_src_dir
from edgeflow.engines.gpu_host import dist_version, gpu_fingerprint, mmp

_VERSION_FILES = ("tensorrt_edgellm/_version.py", "tensorrt_edgellm/version.py")  # 0.10 / <= 0.7 spelling


def parse_version_file(text: str) -> str | None:
    """'__version__ = "0.10.0"' (or '__version__: str = "0.6.1"') -> '0.10.0'."""
    m = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", text, re.MULTILINE)
    return m.group(1) if m else None


def edge_llm_version(src: Path | None = None) -> str | None:
    """The installed tensorrt-edgellm distribution's version, else the source tree's _version.py, else None."""
    have = dist_version("tensorrt-edgellm", "tensorrt_edgellm")
    if have is not None:
        return have
    if os.environ.get(EXPORTER_PYTHON_ENV):  # an export host: the exporter's own venv
        return exporter_version(os.environ[EXPORTER_PYTHON_ENV])
    src = Path(src) if src is not None else edge_llm_src_dir({})
    for rel in _VERSION_FILES:
        path = src / rel
        if path.exists():
            return parse_version_file(path.read_text())
    return None


def exporter_version(python: str) -> str | None:
    """The tensorrt-edgellm release installed for `python` (the exporter's interpreter: its own venv, or this one)."""
    import subprocess
    import sys

    if Path(python) == Path(sys.executable):
        return edge_llm_version()
    try:
        out = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('tensorrt-edgellm'))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_fingerprint(src: Path | None = None) -> dict[str, Any]:
    """The GPU fingerprint (edgeflow.engines.gpu_host) plus the Edge-LLM release found here."""
    return gpu_fingerprint() | {"edge_llm": edge_llm_version(src)}


def _mm(version: str | None) -> tuple[int, ...] | None:
    """'10.16.1.11' -> (10, 16); None without major.minor."""
    m = re.match(r"^(\d+)\.(\d+)", str(version or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _jetpack(d: dict[str, Any]) -> str:
    return f"JetPack {d.get('jetpack') or '?'} (L4T {d.get('l4t_release') or 'none'})"


def compare(engine_meta: dict[str, Any], device: dict[str, Any]) -> None:
    """Raise EngineIncompatibleError naming both sides if `device` cannot run the engine engine_meta describes."""
    backend = engine_meta.get("backend")
    if backend != BACKEND:
        raise EngineIncompatibleError(
            f"engine backend is {backend!r}; this backend runs {BACKEND!r} engines (load it with the {backend!r} backend)")
    if engine_meta.get("stage") != "engine":
        raise EngineIncompatibleError(
            f"this directory is an Edge-LLM export (stage {engine_meta.get('stage')!r}: ONNX + sidecars), not an engine. "
            f"Fix: build the engine on the {engine_meta.get('build_profile', {}).get('target', 'target')} device: "
            "build(<this export dir>, <engine dir>, {'phase': 'engine'})")
    if engine_meta.get("api_generation") != API_GENERATION:
        raise EngineIncompatibleError(
            f"engine layout generation {engine_meta.get('api_generation')}; this edgeflow reads generation "
            f"{API_GENERATION}. Fix: rebuild the engine with this edgeflow")
    e_sm, e_trt, e_llm = engine_meta.get("sm"), engine_meta.get("tensorrt"), engine_meta.get("edge_llm")
    built = f"engine built for {e_sm} on {_jetpack(engine_meta)} with TensorRT {e_trt} and Edge-LLM {e_llm}"
    fix = "Fix: rebuild the engine on this device (export once, then build(export_dir, engine_dir) here)"
    if not device.get("cuda_available") or not device.get("sm"):
        raise EngineIncompatibleError(
            f"{built}; this device has no CUDA GPU ({device.get('reason') or 'none found'}). Fix: serve it on the "
            f"{e_sm} Jetson it was built on, or serve the cpu backend here")
    d_sm, d_trt, d_llm = device["sm"], device.get("tensorrt"), device.get("edge_llm")
    if d_sm != e_sm:
        raise EngineIncompatibleError(
            f"{built}; this device is {d_sm} ({device.get('device_name')}): a TensorRT engine holds kernels for the "
            f"GPU architecture that built it. {fix}")
    if device.get("l4t_release") != engine_meta.get("l4t_release"):
        raise EngineIncompatibleError(
            f"{built}; this device runs {_jetpack(device)}: Edge-LLM engines are bound to the JetPack (its TensorRT "
            f"and CUDA) they were built on. {fix}, or flash {_jetpack(engine_meta)}")
    if d_trt is None or mmp(d_trt) != mmp(e_trt) or mmp(e_trt) is None:
        raise EngineIncompatibleError(
            f"{built}; this device ({d_sm}, {_jetpack(device)}) has TensorRT {d_trt or 'not found'}: a serialized "
            f"TensorRT plan only deserializes with the TensorRT version that built it. {fix}")
    if d_llm is None:
        raise EngineIncompatibleError(
            f"{built}; this device has no Edge-LLM (no tensorrt-edgellm distribution and no _version.py under "
            f"${EDGE_LLM_SRC_ENV}). Fix: install Edge-LLM {e_llm} (CMake build with BUILD_PYTHON_BINDINGS=ON)")
    if mmp(d_llm) != mmp(e_llm) or mmp(e_llm) is None:
        raise EngineIncompatibleError(
            f"{built}; this device has Edge-LLM {d_llm}: its plugin library and runtime must be the release that "
            f"built the engine (cpp/common/version.cpp checkVersion). {fix}, or install Edge-LLM {e_llm}")


# Fingerprint fields an engine depends on (the driver is left out: engines do not depend on it).
DEVICE_KEY_FIELDS = ("sm", "device_name", "cuda_version", "tensorrt", "edge_llm", "l4t_release", "jetpack")


def cache_key(source_sha256: str, build_profile: dict, device: dict, phase: str) -> str:
    """Build cache key: same input + build profile + phase + (for engines) device fingerprint -> same key."""
    fp = {k: device.get(k) for k in DEVICE_KEY_FIELDS} if phase == "engine" else {"edge_llm": device.get("edge_llm")}
    return sha256_json({"backend": BACKEND, "api_generation": API_GENERATION, "phase": phase,
                        "source_sha256": source_sha256, "build_profile": build_profile, "device": fp})


def build_identity() -> str:
    """What decides whether an export or engine built earlier still loads here: the exporter's release, and for
    engines the GPU architecture, TensorRT, JetPack's L4T release and the Edge-LLM runtime."""
    return build_identity_of(device_fingerprint())


def build_identity_of(fp: dict[str, Any]) -> str:
    """build_identity() of the machine `fp` (a device_fingerprint()) describes."""
    return (f"{BACKEND} gen {API_GENERATION}, Edge-LLM {fp.get('edge_llm')}, {fp.get('sm') or 'no GPU'}, "
            f"TensorRT {fp.get('tensorrt')}, L4T {fp.get('l4t_release')}")


def check_compatible(engine_dir: Path) -> None:
    """Raise EngineIncompatibleError (naming both sides) if this machine cannot run the engine."""
    meta = edir.read_meta(engine_dir)
    if meta.backend == BACKEND and meta.extra("stage") == "engine":
        meta = edir.check_meta(engine_dir, BACKEND)  # every engine file present
    compare(meta.model_dump(mode="json"), device_fingerprint())


def check_export_environment(plan: dict[str, Any], device: dict[str, Any]) -> None:
    """Refuse to export unless the exporter (tensorrt-edgellm) is installed here at the profile's release."""
    want, have = plan["build_profile"]["edge_llm_version"], device.get("edge_llm")
    python = (plan.get("commands", {}).get("export") or ["this interpreter"])[0]
    if have is None:
        raise RuntimeError(
            f"build profile {plan['build_profile_name']!r} exports with Edge-LLM {want}; tensorrt-edgellm is not "
            f"installed for {python}. Fix: `make edgellm-venv` (a venv of its own with tensorrt-edgellm[export]=={want}; "
            f"its pins differ from edgeflow's) and set {EXPORTER_PYTHON_ENV} to its bin/python; export runs on a CPU host")
    if mmp(have) != mmp(want):
        raise RuntimeError(
            f"build profile {plan['build_profile_name']!r} exports with Edge-LLM {want}; this host has {have}: the "
            f"engine must be built by the same release (llm_build checkVersion). Fix: install {want} or use a profile "
            f"for {have}")


def check_build_environment(plan: dict[str, Any], device: dict[str, Any]) -> None:
    """Refuse to build the engine (before running anything) unless this host is the profile's target device."""
    bp, name = plan["build_profile"], plan["build_profile_name"]
    target = f"{bp['target']} on JetPack {bp['jetpack']}" + (f" (L4T {bp['l4t_release']})" if bp.get("l4t_release") else "")
    here = f"{device.get('sm') or 'no CUDA GPU'} on {_jetpack(device)}"
    fix = f"Fix: build the engine on the {target} device itself (copy the export directory there)"
    if not device.get("cuda_available") or device.get("sm") != bp["target"]:
        raise EngineIncompatibleError(
            f"build profile {name!r} targets {target}; this host is {here}"
            f"{' (' + device['reason'] + ')' if device.get('reason') else ''}: an engine built here would not run "
            f"on the target. {fix}")
    have_l4t, have_jp = device.get("l4t_release"), device.get("jetpack")
    if have_l4t is None:
        raise EngineIncompatibleError(f"build profile {name!r} targets {target}; this host is {here}: no "
                                      f"/etc/nv_tegra_release, so not a Jetson. {fix}")
    if bp.get("l4t_release"):
        ok = have_l4t == bp["l4t_release"]
    else:
        ok = have_jp == bp["jetpack"]
        if have_jp is None:
            raise EngineIncompatibleError(
                f"build profile {name!r} targets {target}; this host runs L4T {have_l4t}, whose JetPack "
                "edgeflow.engines.gpu_host.JETPACK_BY_L4T does not know. Fix: if it is JetPack "
                f"{bp['jetpack']}, set l4t_release: {have_l4t} in the build profile; else flash JetPack {bp['jetpack']}")
    if not ok:
        raise EngineIncompatibleError(f"build profile {name!r} targets {target}; this host is {here}. Fix: flash "
                                      f"JetPack {bp['jetpack']}, or use a profile for {_jetpack(device)}")
    want_trt, have_trt = bp.get("tensorrt_version"), device.get("tensorrt")
    if have_trt is None:
        raise RuntimeError(f"build profile {name!r}: this {here} has no TensorRT Python bindings (JetPack's "
                           "python3-libnvinfer); needed to record the TensorRT version the engine binds to. Fix: "
                           "apt install the JetPack TensorRT Python package")
    if want_trt and _mm(have_trt) != _mm(want_trt):
        raise EngineIncompatibleError(f"build profile {name!r} needs TensorRT {want_trt}; this {here} has TensorRT "
                                      f"{have_trt}. Fix: install JetPack {bp['jetpack']}'s TensorRT or update the profile")
    want_llm, have_llm = bp["edge_llm_version"], device.get("edge_llm")
    if mmp(have_llm) != mmp(want_llm):
        raise RuntimeError(f"build profile {name!r} builds with Edge-LLM {want_llm}; this device has "
                           f"{have_llm or 'none'}. Fix: build Edge-LLM {want_llm} here (CMake -DEMBEDDED_TARGET="
                           f"{bp['embedded_target']} -DCUDA_CTK_VERSION={bp['cuda_version']} -DBUILD_PYTHON_BINDINGS=ON)"
                           f" and set ${EDGE_LLM_SRC_ENV}")
    tool = Path(plan["commands"]["build"][0])
    if not tool.exists():
        raise RuntimeError(f"{tool} not found: llm_build is a CMake build output of the Edge-LLM source tree. Fix: "
                           f"build Edge-LLM {want_llm} and set profile edge_llm_src or ${EDGE_LLM_SRC_ENV}")
