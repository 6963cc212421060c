"""edgeflow/ops/allocator.py: the stage processes' malloc settings, observed in fresh interpreters (they are per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import ctypes, json, os, sys
# glibc's mallinfo2 tells where a freed 64 MiB block went: kept in the heap (arena) or unmapped (hblkhd)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None); libc.mallinfo2.restype = MI
libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = [ctypes.c_size_t]; libc.free.argtypes = [ctypes.c_void_p]
import edgeflow.pipeline  # what every stage process imports first
from edgeflow.ops.allocator import tune
before = libc.mallinfo2(); p = libc.malloc(64 << 20); live = libc.mallinfo2(); libc.free(p); after = libc.mallinfo2()
print(json.dumps({"state": tune(), "mmapped_live": live.hblkhd - before.hblkhd, "heap_free_after": after.fordblks,
                  "thp": os.environ.get("THP_MEM_ALLOC_ENABLE")}))
"""


def _probe(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEFLOW_MALLOC", "THP_MEM_ALLOC_ENABLE")}
    if value is not None:
        env["EDGEFLOW_MALLOC"] = value
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt exists on Linux only")
def test_stage_process_keeps_large_blocks_in_the_heap():
    tuned = json.loads(_probe(None).stdout)
    assert tuned["state"] == {"applied": True, "reason": "glibc mallopt"}
    assert tuned["mmapped_live"] == 0, "a 64 MiB block must come from the heap, not a fresh mmap"
    assert tuned["heap_free_after"] >= 64 << 20, "the freed block must stay in the heap for reuse"
    assert tuned["thp"] == "1"

    default = json.loads(_probe("off").stdout)
    assert default["state"] == {"applied": False, "reason": "EDGEFLOW_MALLOC=off"}
    assert default["mmapped_live"] >= 64 << 20, "with glibc's defaults a 64 MiB block is its own mmap"
    assert default["thp"] is None


def test_bad_setting_names_the_variable_and_values():
    out = _probe("fast")
    assert out.returncode != 0
    assert "EDGEFLOW_MALLOC='fast'" in out.stderr and "'on'" in out.stderr and "'off'" in out.stderr
