"""The stage processes' CPU memory allocator: glibc malloc keeps torch's large blocks instead of unmapping them.

    EDGEFLOW_MALLOC=off python -m edgeflow.pipeline.release --profile configs/demo-cpu.yaml   # glibc's defaults instead

Why. A training step on the CPU allocates and frees hundreds of activation and gradient tensors of a few MB to
a few hundred MB. glibc serves every block above its mmap threshold (128 KiB, rising to at most 32 MiB) with a
fresh mmap and unmaps it on free, so the kernel zeroes and faults in every page again on the next step. Measured
on the demo's distillation step (4 × 128 tokens, SmolLM2 teacher and its 24-layer student, 2-core AMD EPYC,
AVX-512): about 470,000 page faults and 1.5–1.8 s of kernel time a step, 4.4–4.9 s a step. With the settings
below: about 700 page faults and 0.2–0.3 s of kernel time, 3.4–3.8 s a step (benchmarks/distill_step.py;
BENCHMARKS.md#distill-step).

What. `tune()` raises the mmap threshold to 1 GiB (blocks below it come from the heap and are reused), keeps up to
2 GiB of freed heap instead of trimming it, grows the heap 512 MiB at a time, and asks torch to back its large
CPU blocks with transparent huge pages (THP_MEM_ALLOC_ENABLE, read by torch at its first allocation, so `tune()`
runs before torch is imported: edgeflow/pipeline/__init__.py and tests/conftest.py). The cost is resident memory that stays
with the process after a peak, which a stage process (one release, then exit) does not need back; the edge server
does not call it. Only glibc on Linux has these knobs; elsewhere `tune()` changes nothing and says so.
"""
from __future__ import annotations

import ctypes
import os
import platform

ENV = "EDGEFLOW_MALLOC"
# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    _M_MMAP_THRESHOLD: 1 << 30,   # below 1 GiB from the heap: reused, not unmapped and faulted in again
    _M_TRIM_THRESHOLD: 2**31 - 1,  # freed heap kept up to 2 GiB (mallopt takes a C int)
    _M_TOP_PAD: 512 << 20,        # heap grown in 512 MiB steps
}

_state: dict[str, object] | None = None


def tune() -> dict[str, object]:
    """Apply the settings once per process; returns what was done ({"applied": bool, "reason": str})."""
    global _state
    if _state is not None:
        return _state
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{ENV}={value!r}: must be 'on' (the default: keep torch's large blocks, see "
                         f"edgeflow/ops/allocator.py) or 'off' (glibc's defaults)")
    if value == "off":
        _state = {"applied": False, "reason": f"{ENV}=off"}
        return _state
    libc_name, _ = platform.libc_ver()
    if platform.system() != "Linux" or libc_name != "glibc":
        _state = {"applied": False, "reason": f"not glibc on Linux ({platform.system()}, {libc_name or 'unknown libc'})"}
        return _state
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [param for param, v in SETTINGS.items() if mallopt(param, v) != 1]
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    _state = {"applied": not refused, "reason": f"mallopt refused {refused}" if refused else "glibc mallopt"}
    return _state
