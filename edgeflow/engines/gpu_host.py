"""What NVIDIA GPU and software stack this machine has: the fingerprint every GPU backend and `edgeflow.ops.envcheck` read.

    python -c "from edgeflow.engines.gpu_host import gpu_fingerprint; print(gpu_fingerprint())"

One owner for the device facts the GPU backends bind their engines to (SM, GPU name, driver, CUDA, TensorRT,
Jetson L4T and JetPack), as `cpu_host` is for the CPU backends. Each backend adds its own runtime's version
(`tensorrt_llm`, `vllm`, Edge-LLM) to this dict and decides compatibility itself; nothing here imports a GPU
runtime unless it is installed, and a broken CUDA install reads as "no CUDA" with the reason, never as a crash.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

# L4T release (/etc/nv_tegra_release) -> JetPack. TensorRT on Jetson comes with JetPack, so the L4T release names
# the TensorRT an on-device engine was built with. JetPack 6.x is L4T r36 (Orin); 7.0 is r38.2 and 7.1 r38.4 (Thor;
# developer.nvidia.com/embedded/jetpack/downloads/archive-7.1). AGX Orin joins at JetPack 7.2, whose L4T release is
# not recorded here (NVIDIA's JetPack page links a Jetson Linux r39.2 guide): an unknown release leaves `jetpack`
# None, and engines still bind to the L4T release itself.
JETPACK_BY_L4T = {"36.3.0": "6.0", "36.4.0": "6.1", "36.4.3": "6.2", "38.2.0": "7.0", "38.4.0": "7.1"}


def dist_version(*names: str) -> str | None:
    """Version of the first of these installed distributions (pip metadata), or None."""
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def parse_nv_tegra_release(text: str) -> str | None:
    """'# R36 (release), REVISION: 4.0, ...' -> '36.4.0' (the L4T release of a Jetson)."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def nvidia_smi() -> dict[str, str] | None:
    """compute_cap, name, driver_version of the first visible GPU, or None (no nvidia-smi / N/A fields)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    # nvidia-smi ignores CUDA_VISIBLE_DEVICES; -i takes the same index or UUID
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = [exe, "--query-gpu=compute_cap,name,driver_version", "--format=csv,noheader"] + (["-i", visible] if visible else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if not lines:
        return None
    parts = [p.strip() for p in lines[0].split(",")]
    if len(parts) < 3 or not re.fullmatch(r"\d+\.\d+", parts[0]):
        return None  # Jetson's nvidia-smi answers [N/A] for some fields
    return {"compute_cap": parts[0], "name": parts[1], "driver_version": parts[2]}


def cuda_toolkit_version() -> str | None:
    """The CUDA toolkit under /usr/local/cuda (its version.json), or None."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return json.loads(Path("/usr/local/cuda/version.json").read_text())["cuda"]["version"]
    return None


def gpu_fingerprint() -> dict[str, Any]:
    """SM, GPU name, driver, CUDA and TensorRT versions and Jetson L4T/JetPack of this machine.

    `cuda_available` False comes with `reason` saying why (no nvidia-smi, no torch, torch sees no device, ...).
    """
    fp: dict[str, Any] = {
        "cuda_available": False, "sm": None, "device_name": None, "driver_version": None,
        "cuda_version": cuda_toolkit_version(),
        "tensorrt": dist_version("tensorrt", "tensorrt-cu12", "tensorrt_cu12", "tensorrt-cu13", "tensorrt_cu13"),
        "l4t_release": None, "jetpack": None, "reason": None,
    }
    with contextlib.suppress(OSError):
        fp["l4t_release"] = parse_nv_tegra_release(Path("/etc/nv_tegra_release").read_text())
        fp["jetpack"] = JETPACK_BY_L4T.get(fp["l4t_release"] or "")
    if fp["tensorrt"] is None and importlib.util.find_spec("tensorrt") is not None:
        # JetPack installs TensorRT's Python bindings from apt, without pip metadata
        with contextlib.suppress(Exception):
            import tensorrt

            fp["tensorrt"] = tensorrt.__version__
    smi = nvidia_smi()
    if smi is not None:
        fp.update(cuda_available=True, sm="sm" + smi["compute_cap"].replace(".", ""), device_name=smi["name"],
                  driver_version=smi["driver_version"])
        return fp
    if importlib.util.find_spec("torch") is None:
        fp["reason"] = "no nvidia-smi answer and no torch to query CUDA"
        return fp
    try:
        import torch

        if not torch.cuda.is_available():
            fp["reason"] = "torch.cuda.is_available() is False"
            return fp
        major, minor = torch.cuda.get_device_capability(0)
        fp.update(cuda_available=True, sm=f"sm{major}{minor}", device_name=torch.cuda.get_device_name(0),
                  cuda_version=fp["cuda_version"] or torch.version.cuda)
    except Exception as e:  # a broken CUDA install must read as "no CUDA", never crash the caller
        fp["reason"] = f"CUDA query failed: {type(e).__name__}: {e}"
    return fp


def mmp(version: str | None) -> tuple[int, ...] | None:
    """'1.2.1rc3' -> (1, 2, 1); None when the version has no major.minor.patch."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return tuple(int(x) for x in m.groups()) if m else None
