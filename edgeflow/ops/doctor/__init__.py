"""`edgeflow doctor`: does this host do what its role in a profile needs? A few minutes on a tiny model, a report to
attach to a bug report.

    edgeflow doctor --role cpu --out doctor-out
    edgeflow doctor --profile configs/production-a100-orin.yaml --role a100

Roles and their checks (checks.py holds each one and what it measures):
    cpu   versions, device (with the measured memory bandwidth), dtypes, the profile's engine backend importable,
          the tiny model (dense and RTN int4), then build/load/score/decode of the CPU engines: cpu_native on both
          weights, llama_cpp on int4, and the profile's backend if it is another CPU one
    a100  versions, device, a CUDA GPU of sm80+, dtypes on it (bf16 included), the backend importable, the tiny
          model, 20 distillation steps on the GPU(s), GPTQ W4A16 on the GPU against the same recipe on the CPU,
          the gate's torch half (FP reference and fake-quantized twins) on the GPU against the CPU,
          build/load/score/decode of the profile's backend
    orin  versions, device, a CUDA GPU of sm87, dtypes on it, the backend importable, the tiny model, the backend's
          build/load/score/decode
A check that needs one that failed is skipped, naming it; one failing never stops the next. The run writes
doctor.json and doctor.md (report.py) whatever happens, and its exit status is 1 when any check failed.
"""
from __future__ import annotations

import datetime as dt
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

from edgeflow.ops.doctor import checks
from edgeflow.ops.doctor.report import CheckResult, DoctorReport, write_report
from edgeflow.profile import Profile

ROLES = ("cpu", "a100", "orin")
# Backends that build and run on a CPU host (the others need a GPU and run in the GPU roles).
CPU_BACKENDS = ("cpu_native", "llama_cpp", "cpu")

Check = tuple[str, Callable[[checks.Host], dict]]


def default_role() -> str:
    """The role this host most likely plays: orin on a Jetson (L4T release file), a100 with a CUDA GPU, else cpu."""
    from edgeflow.engines.gpu_host import gpu_fingerprint

    fp = gpu_fingerprint()
    if fp["l4t_release"]:
        return "orin"
    return "a100" if fp["cuda_available"] else "cpu"


def plan(role: str, profile: Profile) -> list[Check]:
    """The role's checks, in order, as (name, function of the Host)."""
    if role not in ROLES:
        raise ValueError(f"--role {role!r} is not a role; choose one of {', '.join(ROLES)}")
    backend = profile.engine.backend
    out: list[Check] = [("versions", checks.versions), ("device", checks.device)]
    if role != "cpu":
        out.append(("cuda", checks.cuda))
    out.append(("dtypes", checks.dtypes if role == "cpu" else _on_gpu(checks.dtypes)))
    if role == "cpu":
        backends = ["cpu_native", "llama_cpp"] + ([backend] if backend in CPU_BACKENDS and backend not in ("cpu_native", "llama_cpp") else [])
        out += [(f"backend:{b}", partial(checks.backend_import, name=b)) for b in backends]
        out.append(("model", checks.model))
        out += [("engine:cpu_native:dense", partial(checks.engine, name="cpu_native", weights="dense")),
                ("engine:cpu_native:int4", partial(checks.engine, name="cpu_native", weights="int4")),
                ("engine:llama_cpp:int4", partial(checks.engine, name="llama_cpp", weights="int4"))]
        out += [(f"engine:{b}:int4", partial(checks.engine, name=b, weights="int4")) for b in backends[2:]]
        return out
    out += [(f"backend:{backend}", partial(checks.backend_import, name=backend)), ("model", _on_gpu(checks.model))]
    if role == "a100":
        out += [("distill", _on_gpu(checks.distill)), ("gptq", _on_gpu(checks.gptq)),
                ("gate-reference", _on_gpu(checks.gate_reference))]
    out.append((f"engine:{backend}:int4", _on_gpu(partial(checks.engine, name=backend, weights="int4",
                                                           profile=profile.engine.profile))))
    return out


def _on_gpu(fn: Callable[[checks.Host], dict]) -> Callable[[checks.Host], dict]:
    """A GPU role's check: skipped, naming the reason, unless the cuda check passed."""
    def run(host: checks.Host) -> dict:
        host.need("cuda")
        return fn(host)
    return run


def run_doctor(profile: Profile, profile_name: str, role: str, out_dir: Path,
               log: Callable[[str], None] = print) -> DoctorReport:
    """Every check of `role`, each timed and recorded, then doctor.json and doctor.md in out_dir."""
    steps = plan(role, profile)
    host = checks.Host(role=role, profile=profile, work=out_dir / "work", device="cpu" if role == "cpu" else "cuda")
    host.work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    t_run = time.perf_counter()
    results: list[CheckResult] = []
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            result = CheckResult(name=name, status="pass", numbers=fn(host))
        except checks.Skipped as e:
            result = CheckResult(name=name, status="skip", reason=str(e))
        except checks.Failed as e:
            result = CheckResult(name=name, status="fail", reason=str(e))
        except Exception as e:  # a check that crashes is a failed check, reported with where it broke
            where = traceback.extract_tb(e.__traceback__)[-1]
            result = CheckResult(name=name, status="fail", reason=f"{type(e).__name__}: {e} "
                                 f"(at {Path(where.filename).name}:{where.lineno})")
        result.seconds = round(time.perf_counter() - t0, 2)
        host.results[name] = result.status
        results.append(result)
        log(f"{name:<26} {result.status:<4} {result.seconds:7.1f} s  {result.reason or ''}".rstrip())
    report = DoctorReport(role=role, profile=profile_name, started=started.isoformat(timespec="seconds"),
                          seconds=round(time.perf_counter() - t_run, 1), checks=results)
    write_report(report, out_dir)
    return report
