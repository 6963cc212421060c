"""Facts about the CPU this process runs on, shared by the CPU backends: ISA flags, fingerprint, threads.

    python -c "from edgeflow.engines.cpu_host import device_fingerprint; print(device_fingerprint())"
"""
from __future__ import annotations

import contextlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

THREADS_ENV = "EDGEFLOW_ENGINE_THREADS"
TORCH_THREADS_ENV = "EDGEFLOW_TORCH_THREADS"

# ISA extensions the CPU kernels are picked by (ORT's MLAS at session creation, the native kernel's
# AVX2/FMA requirement); recorded in engine.json for provenance.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")


def cpu_flags() -> set[str]:
    """The `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def device_fingerprint() -> dict[str, Any]:
    """CPU model, relevant ISA flags, OS and arch of this machine."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    flags = cpu_flags()
    return {
        "cpu_model": model or platform.processor(),
        "isa": sorted(f for f in ISA_FLAGS if f in flags),
        "cores": os.cpu_count(),
        "os": platform.system().lower(),
        "arch": platform.machine(),
    }


def int_from_env(name: str, *, lo: int, hi: int | None = None, meaning: str) -> int | None:
    """An integer setting from the environment: None when unset or empty, else its value within [lo, hi]; anything
    else is refused naming the variable, its value, the range and what the number means."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < lo or (hi is not None and number > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise ValueError(f"{name}={value!r}: must be an integer {bound} ({meaning})")
    return number


def threads_from_env() -> int:
    """Engine threads: $EDGEFLOW_ENGINE_THREADS, else every CPU this process may run on.

    Left unset, onnxruntime-genai's session ran decode on one thread here (2-core EPYC: 41 tok/s
    unset, 40 with 1 thread, 71 with 2 on the 10-layer int4 student), so the count is always set.
    """
    threads = int_from_env(THREADS_ENV, lo=1, meaning="engine threads")
    if threads is not None:
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_torch_threads() -> int | None:
    """torch's intra-op threads in this process from $EDGEFLOW_TORCH_THREADS, over any OMP_NUM_THREADS (prefect.yaml
    gives the cpu pool's runs 2): for a host that runs several stage processes at once on few cores, where each
    one's threads defaulting to every core makes them wait on each other. Two test-tiny distillations at once on the
    2-core AMD EPYC took 44 s each with 2 threads apiece, 19 s each with 1 (16 s for one alone with 2;
    benchmarks/concurrent_distill.py, BENCHMARKS.md#torch-threads). Unset: nothing changes.
    Called before torch loads (edgeflow/pipeline/__init__.py, tests/conftest.py); if torch is already loaded it is told too.
    Returns the count set, or None."""
    threads = int_from_env(TORCH_THREADS_ENV, lo=1, meaning="torch intra-op threads of each edgeflow process")
    if threads is None:
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads
