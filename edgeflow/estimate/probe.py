"""An x86 host's limits, measured as its engine meets them: the bandwidth of a read-only stream over a buffer far
larger than the last-level cache, and the fp32 FMA peak, each on the engine's threads (native/probe.c, built like
cpu_native's kernels: AVX2 loads, AVX2 FMAs).

    python -m edgeflow.estimate.probe [--threads N] [--mib 1024]

The stream reads 1 GiB by default: at least 4x the last-level cache of every box measured (32 MiB L3 on the 2-core
VMs), so what it reads comes from memory. A probe takes about a second.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SOURCE = Path(__file__).resolve().parent / "native" / "probe.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-pthread", "-shared", "-fPIC")
DEFAULT_MIB = 1024
FMA_ITERS = 20_000_000  # ~0.1 s a thread at 3 GHz


class HostLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    read_gb_s: float = Field(description="Read-only stream bandwidth, GB/s, on `threads` threads.")
    fma_gflops: float = Field(description="fp32 FMA peak, GFLOP/s, on `threads` threads (AVX2, 8 lanes, 2 FLOPs a lane).")
    threads: int = Field(description="Threads the probe ran on.")
    buffer_mib: int = Field(description="The stream's buffer, MiB.")
    cpu: str = Field(description="The CPU's model name.")
    isa: list[str] = Field(description="The CPU's vector ISA flags that matter here.")


def _library() -> ctypes.CDLL:
    from edgeflow.engines.cpu_native.kernels import compile_c

    path, _ = compile_c(SOURCE, FLAGS, "libedgeflow_probe.so")
    lib = ctypes.CDLL(str(path))
    lib.probe_read_bytes_s.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    lib.probe_read_bytes_s.restype = ctypes.c_double
    lib.probe_fma_flops_s.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    lib.probe_fma_flops_s.restype = ctypes.c_double
    return lib


def probe(threads: int | None = None, mib: int = DEFAULT_MIB, repeats: int = 3) -> HostLimits:
    """Measure this host (see the module doc). `threads` defaults to the engine's (EDGEFLOW_ENGINE_THREADS, else the
    CPUs this process may run on)."""
    from edgeflow.engines.cpu_host import cpu_flags, threads_from_env

    threads = threads_from_env() if threads is None else threads
    if not 1 <= threads <= 256:
        raise ValueError(f"threads: {threads} is outside 1-256")
    if mib < 1:
        raise ValueError(f"mib: {mib} must be at least 1")
    lib = _library()
    read = lib.probe_read_bytes_s(mib * 2**20, threads, repeats)
    if read <= 0:
        raise MemoryError(f"the probe could not allocate {mib} MiB; give a smaller --mib")
    fma = lib.probe_fma_flops_s(FMA_ITERS, threads, repeats)
    flags = cpu_flags()
    return HostLimits(read_gb_s=round(read / 1e9, 2), fma_gflops=round(fma / 1e9, 1), threads=threads, buffer_mib=mib,
                      cpu=_cpu_name(), isa=sorted(f for f in flags if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16",
                                                                            "avx512_vnni", "amx_bf16")))


def cached_probe(max_age_s: float = 86400.0) -> HostLimits:
    """probe() on the engine's threads, kept a day under ~/.cache/edgeflow/probe/ per CPU model, thread count and probe
    source: `edgeflow plan` asks for it every run, and a probe is a second of both cores."""
    import hashlib
    import time

    from edgeflow.engines.cpu_host import threads_from_env
    from edgeflow.paths import user_cache

    threads = threads_from_env()
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    key = hashlib.sha256(f"{_cpu_name()}|{threads}|{source}".encode()).hexdigest()[:16]
    path = user_cache() / "probe" / f"{key}.json"
    try:
        if time.time() - path.stat().st_mtime < max_age_s:
            return HostLimits.model_validate_json(path.read_text())
    except (OSError, ValueError):
        pass
    limits = probe(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(limits.model_dump_json())
    os.replace(tmp, path)
    return limits


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m edgeflow.estimate.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads (default: the engine's)")
    p.add_argument("--mib", type=int, default=DEFAULT_MIB, help=f"the stream's buffer, MiB (default {DEFAULT_MIB})")
    a = p.parse_args(argv)
    print(json.dumps(probe(a.threads, a.mib).model_dump(), indent=1))


if __name__ == "__main__":
    main()
