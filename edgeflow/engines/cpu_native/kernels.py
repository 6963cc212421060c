"""q4.c compiled for this machine (cached by the source's and the compiler's hash) and loaded once per process.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from edgeflow.engines import EngineIncompatibleError
from edgeflow.engines.cpu_host import ISA_FLAGS, cpu_flags as _cpu_flags

from edgeflow.paths import user_cache
from edgeflow.engines.cpu_native.settings import CACHE_ENV, CC_FLAGS, FIX, REQUIRED_ISA, SOURCE, STEP_ROWS


def kernel_sha256() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def _compiler() -> tuple[str, str]:
    """(path, first line of --version) of the C compiler ($CC or cc); EngineIncompatibleError if none."""
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise EngineIncompatibleError(
            f"cpu_native needs a C compiler to build its kernels, but {name!r} is not on PATH on this machine "
            f"(install gcc, or set $CC); or {FIX}"
        )
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return path, (out.stdout.splitlines() or [""])[0].strip()


def _require_isa() -> None:
    have = _cpu_flags()
    missing = [f for f in REQUIRED_ISA if f not in have]
    if missing:
        raise EngineIncompatibleError(
            f"cpu_native kernels need CPU flags {list(REQUIRED_ISA)}; this CPU lacks {missing} "
            f"(has {sorted(f for f in ISA_FLAGS if f in have)}); {FIX}"
        )


_LIBS: dict[str, ctypes.CDLL] = {}


_LIB_LOCK = threading.Lock()


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or user_cache() / "native")


def compile_c(source: Path, flags: tuple[str, ...], name: str) -> tuple[Path, dict[str, Any]]:
    """Compile one C source into a shared library `name` (once per source, compiler and flags; cached under
    $EDGEFLOW_NATIVE_CACHE or ~/.cache/edgeflow/native) and return (library path, build facts)."""
    _require_isa()
    cc, version = _compiler()
    src_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    key = hashlib.sha256("\n".join([src_sha, cc, version, *flags]).encode()).hexdigest()[:20]
    lib = _cache_root() / key / name
    facts = {"kernel_sha256": src_sha, "compiler": version, "compiler_path": cc, "compile_flags": list(flags)}
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, str(source), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            Path(tmp).unlink(missing_ok=True)
            raise EngineIncompatibleError(
                f"compiling {source.name} failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}\n{FIX}"
            )
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written library
    return lib, facts


def compile_kernels() -> tuple[Path, dict[str, Any]]:
    """Compile native/q4.c (once per source/compiler/flags) and return (library path, build facts)."""
    return compile_c(SOURCE, CC_FLAGS, "libedgeflow_q4.so")


def _library() -> ctypes.CDLL:
    path, _ = compile_kernels()
    with _LIB_LOCK:
        if str(path) not in _LIBS:
            lib = ctypes.CDLL(str(path))
            P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
            L = ctypes.c_long
            # every kernel's last argument is the session's team (team_create), or None for one thread
            lib.q4i_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.q8w_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.f32_gemm.argtypes = [P, I, I, I, P, P, P]
            lib.head_argmax.argtypes = [P, I, I, I, I, P, P, P, P, P, P, P, I, P, P, P]
            lib.q8i_gemm.argtypes = [P, I, I, I, P, P, P, P, P]
            lib.head_bounds.argtypes = [P, I, I, I, P, P, P, P, P, P, P, P]
            lib.head_rows.argtypes = [P, I, P, P, I, P, P]
            lib.head_envelope.argtypes = [P, I, ctypes.c_double, ctypes.c_double, P, P, P, P]
            lib.head_envelope.restype = I
            D = ctypes.c_double
            lib.sample_bounded.argtypes = [P, I, P, P, P, I, D, D, I, P, P, P, I, D, D, I, I, I, L, P, I, P, P, P, P, P, P,
                                           P]
            lib.sample_bounded.restype = I
            lib.llama_scratch_floats.argtypes = [I, I, I, I, I, I, I]
            lib.llama_scratch_floats.restype = L
            lib.llama_step.argtypes = [I, P, P, P, P, I, I, I, I, I, I, F, P, P, P, I, I, P, P, P, P]
            for name in ("q4i_gemm", "q8w_gemm", "f32_gemm", "head_argmax", "head_bounds", "head_rows", "q8i_gemm", "llama_step",
                         "team_destroy"):
                getattr(lib, name).restype = None
            lib.team_create.argtypes, lib.team_create.restype = [I, L], P
            lib.team_destroy.argtypes = [P]
            for name in ("team_threads", "team_spinning", "team_regions", "team_sleeps", "team_probes", "team_probes_spin"):
                getattr(lib, name).argtypes = [P]
                getattr(lib, name).restype = I if name in ("team_threads", "team_spinning") else L
            lib.llama_step_rows.argtypes = []
            if lib.llama_step_rows() != STEP_ROWS:  # the scratch buffers are sized by it
                raise RuntimeError(f"{path}: q4.c carries {lib.llama_step_rows()} rows per step, this module {STEP_ROWS}")
            _LIBS[str(path)] = lib
        return _LIBS[str(path)]
