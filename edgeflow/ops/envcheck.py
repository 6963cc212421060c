"""Does this image fit this device? The fingerprint, the versions the image target needs, and a verdict.

    python -m edgeflow.ops.envcheck --target cpu --json
    python -m edgeflow.ops.envcheck --exec -- prefect worker start --pool cpu      # check, then become the worker

Each image in infra/images/ sets EDGEFLOW_IMAGE_TARGET (cpu, a100, jetson-jp6, jetson-jp7) and runs this module as
its ENTRYPOINT: it prints the device fingerprint (CPU: edgeflow.engines.cpu_host.device_fingerprint; GPU:
edgeflow.engines.gpu_host.gpu_fingerprint) and the versions of the runtimes the target uses, then refuses to start
(exit 1) when image and device do not match, naming what the image expects, what the device has, and the fix.
With `--exec -- CMD...` a passing check replaces this process with CMD (the worker or the server), so the
container's main process is the command itself and receives its signals.

`decide(target, fingerprint)` is pure: every branch is tested on made-up fingerprints
(tests/ops/test_envcheck.py). Gathering the fingerprint imports torch only where it is installed (its CUDA build
is part of the a100 decision), never a GPU runtime.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.engines import cpu_native
from edgeflow.engines.cpu_host import device_fingerprint
from edgeflow.engines.gpu_host import dist_version, gpu_fingerprint

TARGET_ENV = "EDGEFLOW_IMAGE_TARGET"
TARGETS = ("cpu", "a100", "jetson-jp6", "jetson-jp7")

# The a100 image trains in bf16 and runs llm-compressor/vLLM's Marlin kernels: Ampere (sm80) or newer.
# (vLLM's docs list compute capability 7.0+ for the engine, but bf16 and the Marlin W4A16 kernels need 8.0.)
MIN_A100_SM = 80
# Jetson AGX Orin. TensorRT engines are bound to the architecture that built them (FIELD-NOTES: A100 sm80, Orin sm87).
ORIN_SM = "sm87"
# TensorRT-LLM's Jetson branch v0.12.0-jetson is written for JetPack 6.1 (README4Jetson.md "1.1 Install Jetpack 6.1"),
# i.e. L4T r36 (gpu_host.JETPACK_BY_L4T: 36.4.0 -> 6.1). Another r36 release is accepted with a note: same major
# L4T, TensorRT 10.3 and CUDA 12.6 on 6.1 and 6.2 (Torch-TensorRT's JetPack notes), but not what the branch tested.
JP6_L4T_MAJOR = "36"
JP6_JETPACK = "6.1"
JP6_TRTLLM = "0.12.0"
# TensorRT Edge-LLM supports AGX Orin officially on JetPack 7.2 from 0.10 (FIELD-NOTES, Edge-LLM support matrix).
JP7_JETPACK = "7.2"

# Distribution names whose versions are reported (first installed name wins; gpu_host.dist_version).
VERSIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "llmcompressor": ("llmcompressor",),
    "compressed_tensors": ("compressed-tensors",),
    "deepspeed": ("deepspeed",),
    "vllm": ("vllm",),
    "tensorrt": ("tensorrt", "tensorrt-cu12", "tensorrt_cu12", "tensorrt-cu13", "tensorrt_cu13"),
    "tensorrt_llm": ("tensorrt-llm", "tensorrt_llm"),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "onnxruntime_genai": ("onnxruntime-genai", "onnxruntime-genai-cuda"),
    "llama_cpp_python": ("llama-cpp-python", "llama_cpp_python"),
    "numpy": ("numpy",),
    "prefect": ("prefect",),
}


class Problem(BaseModel):
    """One way the image and the device do not fit."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(description="The fingerprint field that decided it (e.g. gpu.sm, cpu.isa, versions.torch_cuda).")
    expected: str = Field(description="What the image target needs there.")
    found: str = Field(description="What this device or image has.")
    fix: str = Field(description="What to do: run another image here, or this image on another device.")

    def message(self, target: str) -> str:
        return f"{target} image: {self.field} must be {self.expected}, this machine has {self.found}. Fix: {self.fix}"


class Verdict(BaseModel):
    """decide()'s answer: the target, whether it may start, and why not."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="The image target checked (one of TARGETS).")
    ok: bool = Field(description="True when nothing below refuses the start.")
    problems: list[Problem] = Field(default_factory=list, description="Every mismatch found (empty when ok).")
    notes: list[str] = Field(default_factory=list, description="Facts worth knowing that do not refuse the start.")


def versions() -> dict[str, Any]:
    """Python and the installed runtimes' versions; torch's CUDA build when torch is installed; Edge-LLM's release."""
    out: dict[str, Any] = {"python": platform.python_version()}
    out |= {key: dist_version(*names) for key, names in VERSIONS.items()}
    out["torch_cuda"] = None
    if out["torch"] is not None:
        try:
            import torch

            out["torch_cuda"] = torch.version.cuda
        except Exception as e:  # a broken torch reads as "no CUDA build", with the reason
            out["torch_cuda_error"] = f"{type(e).__name__}: {e}"
    # Edge-LLM: its installed package, else its source tree's version file ($EDGEFLOW_EDGELLM_SRC), as the backend reads it
    from edgeflow.engines.edge_llm.device import edge_llm_version

    out["edge_llm"] = edge_llm_version()
    return out


def fingerprint() -> dict[str, Any]:
    """What decide() reads: CPU, GPU, the C compiler cpu_native compiles its kernels with, and the versions."""
    return {"cpu": device_fingerprint(), "gpu": gpu_fingerprint(), "cc": shutil.which(os.environ.get("CC", "cc")),
            "versions": versions()}


def _sm_number(sm: str | None) -> int | None:
    digits = "".join(ch for ch in str(sm or "") if ch.isdigit())
    return int(digits) if digits else None


def _check_cpu(fp: dict[str, Any]) -> list[Problem]:
    cpu = fp.get("cpu") or {}
    problems = []
    if cpu.get("arch") not in ("x86_64", "AMD64"):
        problems.append(Problem(field="cpu.arch", expected="x86_64", found=str(cpu.get("arch")),
                                fix="the cpu image is built for x86 CPU hosts; on a Jetson run the jetson image"))
        return problems
    # cpu_native's own requirement and advice (REQUIRED_ISA, FIX), read from the engine itself
    missing = [f for f in cpu_native.REQUIRED_ISA if f not in (cpu.get("isa") or [])]
    if missing:
        problems.append(Problem(
            field="cpu.isa", expected=f"to include {list(cpu_native.REQUIRED_ISA)} (cpu_native kernels)",
            found=f"{cpu.get('cpu_model') or 'unknown CPU'} without {missing} (has {cpu.get('isa')})",
            fix=f"run on an AVX2/FMA/F16C host, or {cpu_native.FIX}"))
    if not fp.get("cc"):
        problems.append(Problem(field="cc", expected="a C compiler on PATH (cpu_native compiles its kernels at first load)",
                                found="none", fix="install gcc in the image (the cpu Dockerfile does), or set $CC"))
    return problems


def _check_a100(fp: dict[str, Any]) -> list[Problem]:
    gpu, v = fp.get("gpu") or {}, fp.get("versions") or {}
    problems = []
    if not gpu.get("cuda_available"):
        return [Problem(field="gpu.cuda_available", expected="a CUDA GPU (sm80+)", found=f"no CUDA ({gpu.get('reason')})",
                        fix="schedule on a GPU node with the NVIDIA runtime (a100 pool), or use the cpu image")]
    if gpu.get("l4t_release"):
        problems.append(Problem(field="gpu.l4t_release", expected="none (a datacenter GPU host)",
                                found=f"a Jetson (L4T {gpu['l4t_release']}, {gpu.get('sm')})",
                                fix="run the jetson image on Jetson devices"))
    sm = _sm_number(gpu.get("sm"))
    if sm is None or sm < MIN_A100_SM:
        problems.append(Problem(field="gpu.sm", expected=f"sm{MIN_A100_SM} or newer (bf16, Marlin W4A16)",
                                found=f"{gpu.get('sm')} ({gpu.get('device_name')})",
                                fix="schedule on an Ampere-or-newer GPU (the a100 pool's node selector names the product)"))
    if v.get("torch") is None:
        problems.append(Problem(field="versions.torch", expected="torch with a CUDA build", found="no torch",
                                fix="rebuild the a100 image (its venv lost torch)"))
    elif not v.get("torch_cuda"):
        problems.append(Problem(field="versions.torch_cuda", expected="a CUDA build of torch", found=f"torch {v['torch']} CPU-only",
                                fix="rebuild the a100 image with TORCH_INDEX pointing at a CUDA wheel index"))
    return problems


def _check_jetson(fp: dict[str, Any], target: str) -> tuple[list[Problem], list[str]]:
    gpu, v = fp.get("gpu") or {}, fp.get("versions") or {}
    problems: list[Problem] = []
    notes: list[str] = []
    l4t, jetpack = gpu.get("l4t_release"), gpu.get("jetpack")
    if not l4t:
        return [Problem(field="gpu.l4t_release", expected="a Jetson (/etc/nv_tegra_release)", found="not a Jetson",
                        fix="run the a100 or cpu image on this host; the jetson image runs on Jetson AGX Orin")], notes
    if target == "jetson-jp6":
        if l4t.split(".")[0] != JP6_L4T_MAJOR:
            problems.append(Problem(field="gpu.l4t_release", expected=f"r{JP6_L4T_MAJOR}.x (JetPack 6)",
                                    found=f"L4T {l4t} (JetPack {jetpack or 'unknown'})",
                                    fix=f"flash JetPack {JP6_JETPACK}, or run the jetson-jp7 image on JetPack {JP7_JETPACK}"))
        elif jetpack != JP6_JETPACK:
            notes.append(f"L4T {l4t} is JetPack {jetpack or 'unknown'}; TensorRT-LLM v0.12.0-jetson was written for "
                         f"JetPack {JP6_JETPACK}")
        have = v.get("tensorrt_llm")
        if not str(have or "").startswith(JP6_TRTLLM.rsplit(".", 1)[0] + "."):
            problems.append(Problem(field="versions.tensorrt_llm", expected=f"{JP6_TRTLLM} (v0.12.0-jetson)", found=str(have),
                                    fix="rebuild the jetson image's jp6 target (it builds the v0.12.0-jetson wheel)"))
        if v.get("tensorrt") is None:
            problems.append(Problem(field="versions.tensorrt", expected="JetPack's TensorRT Python bindings", found="none",
                                    fix="run the image with the NVIDIA container runtime on a JetPack 6 device"))
    else:
        if jetpack != JP7_JETPACK:
            known = "" if jetpack else " (gpu_host.JETPACK_BY_L4T does not map this L4T release)"
            problems.append(Problem(field="gpu.jetpack", expected=JP7_JETPACK, found=f"{jetpack or 'unknown'}, L4T {l4t}{known}",
                                    fix=f"flash JetPack {JP7_JETPACK}, or run the jetson-jp6 image on JetPack {JP6_JETPACK}"))
        if not v.get("edge_llm"):
            problems.append(Problem(field="versions.edge_llm", expected="a TensorRT Edge-LLM build ($EDGEFLOW_EDGELLM_SRC)",
                                    found="neither the tensorrt-edgellm package nor a source tree with its version",
                                    fix="rebuild the jetson image's jp7 target (it builds Edge-LLM's C++ runtime)"))
    if not gpu.get("cuda_available"):
        problems.append(Problem(field="gpu.cuda_available", expected="the Orin GPU visible", found=f"no CUDA ({gpu.get('reason')})",
                                fix="run the container with --runtime nvidia (the L4T GPU is passed by the NVIDIA runtime)"))
    elif gpu.get("sm") != ORIN_SM:
        problems.append(Problem(field="gpu.sm", expected=f"{ORIN_SM} (Jetson AGX Orin)", found=f"{gpu.get('sm')} ({gpu.get('device_name')})",
                                fix="engines built here only run on this architecture: run this image on an AGX Orin"))
    return problems, notes


def decide(target: str, fp: dict[str, Any]) -> Verdict:
    """May an image built for `target` start on the machine `fp` (a fingerprint()) describes? Pure."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not an image target; choose one of {list(TARGETS)} "
                         f"(--target or ${TARGET_ENV})")
    notes: list[str] = []
    if target == "cpu":
        problems = _check_cpu(fp)
    elif target == "a100":
        problems = _check_a100(fp)
    else:
        problems, notes = _check_jetson(fp, target)
    return Verdict(target=target, ok=not problems, problems=problems, notes=notes)


def _report(fp: dict[str, Any], verdict: Verdict) -> str:
    cpu, gpu, v = fp["cpu"], fp["gpu"], fp["versions"]
    lines = [f"image target: {verdict.target}",
             f"cpu: {cpu.get('cpu_model')} ({cpu.get('arch')}, {cpu.get('cores')} cores), isa {' '.join(cpu.get('isa') or [])}",
             "gpu: " + (f"{gpu.get('device_name')} {gpu.get('sm')}, driver {gpu.get('driver_version')}, CUDA {gpu.get('cuda_version')}"
                        if gpu.get("cuda_available") else f"none ({gpu.get('reason')})")
             + (f", L4T {gpu['l4t_release']} (JetPack {gpu.get('jetpack')})" if gpu.get("l4t_release") else ""),
             "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)]
    lines += [f"note: {n}" for n in verdict.notes]
    lines += [f"REFUSED: {p.message(verdict.target)}" for p in verdict.problems]
    lines.append("ok: image and device match" if verdict.ok else f"{len(verdict.problems)} mismatch(es): not starting")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog=os.environ.pop("EDGEFLOW_PROG", "python -m edgeflow.ops.envcheck"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=TARGETS, default=os.environ.get(TARGET_ENV) or None,
                    help=f"image target (default ${TARGET_ENV})")
    ap.add_argument("--json", action="store_true", help="print one JSON object: target, ok, problems, notes, fingerprint")
    ap.add_argument("--exec", dest="exec_", action="store_true", help="after a passing check, exec the command after `--`")
    args = ap.parse_args(argv)
    if args.target is None:
        ap.error(f"no image target: pass --target or set {TARGET_ENV} (one of {', '.join(TARGETS)})")
    if args.exec_ and not command:
        ap.error("--exec needs a command after `--`")
    fp = fingerprint()
    verdict = decide(args.target, fp)
    out = sys.stdout if not (args.exec_ and verdict.ok) else sys.stderr  # the command owns stdout after exec
    if args.json:
        print(json.dumps(verdict.model_dump() | {"fingerprint": fp}, default=str), file=out, flush=True)
    else:
        print(_report(fp, verdict), file=out, flush=True)
    if not verdict.ok:
        return 1
    if args.exec_:
        os.execvp(command[0], command)  # replaces this process; returns only by raising
    return 0


if __name__ == "__main__":
    sys.exit(main())
