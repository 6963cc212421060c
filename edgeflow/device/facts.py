"""What this device is, as a fleet inventory shows it: detected from the machine, never guessed.

    python -m edgeflow.device.facts          # one `key: value` line per detected fact

One rule for every key: a fact is present only when it was detected; nothing is ever filled in with a
placeholder such as "unknown". An inventory (and a rollout matching on tags) therefore never confuses a
fact that is missing with a value. Every value is a string (facts become device tags at registration).

| key            | source                                                                                      |
|----------------|---------------------------------------------------------------------------------------------|
| `sku`          | Jetson: /proc/device-tree/model + MemTotal (`jetson_sku`: `agx-orin-64gb` ...); else the CPU model |
| `l4t`          | /etc/nv_tegra_release (`36.3.0`)                                                              |
| `jetpack`      | `dpkg-query` of the nvidia-jetpack package, else the L4T release's JetPack                   |
| `sm`           | compute capability of the first GPU (`87`), only where an NVIDIA driver is present           |
| `tensorrt`     | the installed TensorRT distribution's version                                               |
| `tensorrt_llm` | the installed TensorRT-LLM distribution's version                                           |
| `cpu_model`    | /proc/cpuinfo `model name`                                                                   |
| `isa`          | the CPU kernels' ISA flags this CPU has, comma-separated (edgeflow/engines/cpu_host.py)         |
| `mem_total_mb` | /proc/meminfo MemTotal, MiB                                                                  |
| `mem_free_mb`  | /proc/meminfo MemAvailable, MiB                                                              |
| `hostname`     | the host name                                                                               |
| `edgeflow`     | the code version (edgeflow/tracking/codeversion.py: `0.1.0+3f2a9c1d0b4e`)                                |

The GPU is queried (through edgeflow/engines/tensorrt_llm/device.py, the owner of GPU fingerprints) only on a
host with an NVIDIA driver or a Jetson L4T release; a CPU host never imports torch or touches CUDA here.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import re
import shutil
import socket
import subprocess
from pathlib import Path

# Documented Jetson families: the substring of /proc/device-tree/model that names it, its SKU prefix, and the
# memory sizes (GB) it ships with. Orin NX and Orin Nano modules on a developer kit report e.g. "NVIDIA Jetson
# Orin NX Engineering Reference Developer Kit"; AGX Orin reports "NVIDIA Jetson AGX Orin Developer Kit".
JETSON_FAMILIES: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    ("agx orin", "agx-orin", (32, 64)),
    ("orin nx", "orin-nx", (8, 16)),
    ("orin nano", "orin-nano", (4, 8)),
)
JETSON_FACTS = ("l4t", "jetpack")
TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu12", "tensorrt_cu12")
TENSORRT_LLM_DISTRIBUTIONS = ("tensorrt_llm", "tensorrt-llm")


def jetson_sku(model: str, mem_total_mb: int) -> str | None:
    """The SKU of a documented Jetson from its device-tree model and MemTotal (MiB), or None when undocumented.

    The kernel reports a little less than the module's memory (carve-outs): a 64 GB AGX Orin shows about
    62.8 GiB. The SKU's size is the smallest size its family ships with that holds MemTotal.
    """
    name = " ".join(model.lower().split())
    for needle, prefix, sizes in JETSON_FAMILIES:
        if needle in name:
            for size in sizes:
                if mem_total_mb <= size * 1024:
                    return f"{prefix}-{size}gb"
            return None  # more memory than any module of the family: not a documented SKU
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _read(path: Path) -> str | None:
    """A file's text, or None when it is absent or unreadable."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def meminfo_mb(root: Path = Path("/")) -> dict[str, int]:
    """{MemTotal, MemAvailable} of /proc/meminfo in MiB (keys it does not have are absent)."""
    out: dict[str, int] = {}
    for line in (_read(root / "proc" / "meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
            out[key] = int(parts[0]) // 1024  # /proc/meminfo counts kB (KiB)
    return out


def jetson_model(root: Path = Path("/")) -> str | None:
    """/proc/device-tree/model when it names a Jetson (any device-tree board has the file; only a Jetson names one)."""
    text = _read(root / "proc" / "device-tree" / "model")
    if text is None:
        return None
    model = text.replace("\x00", "").strip()
    return model if model and ("jetson" in model.lower() or "orin" in model.lower()) else None


def _dpkg_version(package: str) -> str | None:
    exe = shutil.which("dpkg-query")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "-W", "-f=${Version}", package], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def nvidia_driver_present(root: Path = Path("/")) -> bool:
    """An NVIDIA GPU driver is loaded (discrete: /proc/driver/nvidia or /dev/nvidia0; Jetson: an L4T release)."""
    return any((root / p).exists() for p in ("proc/driver/nvidia", "dev/nvidia0", "dev/nvhost-ctrl-gpu",
                                             "etc/nv_tegra_release"))


def detect_facts(root: Path = Path("/")) -> dict[str, str]:
    """This device's facts (module docstring: keys and sources); a key is present only when detected.

    `root`: the filesystem root the Jetson, GPU-driver and memory files are read under (the CPU's facts
    always come from this machine's /proc/cpuinfo, through edgeflow/engines/cpu_host.py).
    """
    from edgeflow.tracking.codeversion import code_identity
    from edgeflow.engines.cpu_host import device_fingerprint
    from edgeflow.engines.gpu_host import parse_nv_tegra_release

    facts: dict[str, str] = {}
    cpu = device_fingerprint()
    if cpu["cpu_model"]:
        facts["cpu_model"] = cpu["cpu_model"]
    if cpu["isa"]:
        facts["isa"] = ",".join(cpu["isa"])
    mem = meminfo_mb(root)
    if "MemTotal" in mem:
        facts["mem_total_mb"] = str(mem["MemTotal"])
    if "MemAvailable" in mem:
        facts["mem_free_mb"] = str(mem["MemAvailable"])

    l4t = parse_nv_tegra_release(_read(root / "etc" / "nv_tegra_release") or "")
    if l4t:
        facts["l4t"] = l4t
    model = jetson_model(root)
    if model:
        sku = jetson_sku(model, mem["MemTotal"]) if "MemTotal" in mem else None
        facts["sku"] = sku or _slug(model)  # an undocumented Jetson: its own model name, as the board reports it
    elif "cpu_model" in facts:
        facts["sku"] = facts["cpu_model"]

    gpu: dict = {}
    if nvidia_driver_present(root):
        from edgeflow.engines.gpu_host import gpu_fingerprint

        gpu = gpu_fingerprint()
    if gpu.get("sm"):
        facts["sm"] = str(gpu["sm"]).removeprefix("sm")
    jetpack = _dpkg_version("nvidia-jetpack") if (l4t or model) else None
    jetpack = jetpack or (gpu.get("jetpack") if l4t and gpu.get("l4t_release") == l4t else None)
    if jetpack:
        facts["jetpack"] = jetpack
    tensorrt = gpu.get("tensorrt") or _dist_version(TENSORRT_DISTRIBUTIONS)
    if tensorrt:
        facts["tensorrt"] = tensorrt
    tensorrt_llm = gpu.get("tensorrt_llm") or _dist_version(TENSORRT_LLM_DISTRIBUTIONS)
    if tensorrt_llm:
        facts["tensorrt_llm"] = tensorrt_llm

    facts["hostname"] = socket.gethostname()
    facts["edgeflow"] = code_identity()
    return facts


if __name__ == "__main__":
    for key, value in sorted(detect_facts().items()):
        print(f"{key}: {value}")
