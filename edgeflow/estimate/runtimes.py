"""How close each runtime gets to its hardware's limits: the fraction of the memory bandwidth a decode step reaches,
the fraction of the compute peak a prefill reaches, and the memory it holds besides weights and KV caches.

A factor of 1 is the roofline itself: what no engine beats. Each entry says where its figures come from: fitted to
measured or published decode and prefill speeds (`benchmarks/estimate_fit.py`, BENCHMARKS.md#estimate), or, where
nothing was measured, the roofline (the estimate is then a bound, and `edgeflow estimate` says so).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile.devices import device_class
from edgeflow.profile.slo import SLOTarget


class RuntimeEfficiency(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The runtime (an edgeflow engine backend, or a runtime a published figure used).")
    bandwidth: float = Field(gt=0, le=1, description="Fraction of the memory bandwidth a batch-1 decode step reaches.")
    compute: float = Field(gt=0, le=1, description="Fraction of the compute peak a prefill reaches.")
    overhead_mb: float = Field(ge=0, description="Resident memory besides weights and KV caches (context, workspace), MB.")
    fitted: bool = Field(description="The bandwidth factor is fitted to measured decode speeds; False: 1, the roofline "
                         "(decode estimates are then a bound, not a prediction).")
    by_weight_bits: dict[int, tuple[float, float]] = Field(
        default_factory=dict, description="(bandwidth, compute) for a weight width whose kernels differ from the "
        "others' (cpu_native: fp32 layers run fp32 FMAs, 4- and 8-bit ones int16 multiply-adds after an unpack); a "
        "width not listed takes `bandwidth` and `compute`.")
    compute_fitted: bool = Field(default=False, description="The compute factor is fitted to measured prefill speeds.")
    source: str = Field(description="The figures behind the factors.")
    engine_backend: bool = Field(default=True, description="An edgeflow engine backend (edgeflow.engines.BACKENDS); "
                                 "False: a runtime that published figures used, kept for comparison.")
    device_kinds: tuple[Literal["jetson", "datacenter-gpu", "cpu"], ...] = Field(
        description="The kinds of device (edgeflow/profile/devices.py DeviceClass.kind) it serves on: an SLO target of "
        "another kind is refused for it, never estimated with its factors.")

    def factors(self, weight_bits: int) -> tuple[float, float]:
        """(bandwidth, compute) for layers of `weight_bits`-bit weights."""
        return self.by_weight_bits.get(weight_bits, (self.bandwidth, self.compute))


_GPU = ("jetson", "datacenter-gpu")
ROOFLINE = RuntimeEfficiency(name="roofline", bandwidth=1.0, compute=1.0, overhead_mb=0, fitted=False, device_kinds=(*_GPU, "cpu"),
                             source="none: the hardware's limits themselves")
_FIT = "benchmarks/estimate_fit.py over benchmarks/data/published_speeds.json (BENCHMARKS.md#estimate): "

# Factors: the geometric mean of published / roofline speed over each runtime's figures, with the leave-one-out error
# (the error of predicting each figure from the others). A runtime with no figure of a kind keeps 1 for it.
RUNTIMES: dict[str, RuntimeEfficiency] = {r.name: r for r in (
    RuntimeEfficiency(name="tensorrt_llm", device_kinds=_GPU, bandwidth=1.0, compute=0.52, overhead_mb=0, fitted=False, compute_fitted=True,
                      source=_FIT + "prefill 0.52 from 2 A100 fp16 figures (TensorRT-LLM 0.5; leave-one-out 64 %); no "
                      "batch-1 decode figure found, so decode is the roofline"),
    RuntimeEfficiency(name="edge_llm", device_kinds=("jetson",), bandwidth=0.73, compute=0.093, overhead_mb=0, fitted=True, compute_fitted=True,
                      source=_FIT + "decode 0.73 and prefill 0.093 from 3 INT4 AWQ figures on AGX Thor (Edge-LLM's own "
                      "tables; leave-one-out 24 % and 5 %); none on Orin"),
    RuntimeEfficiency(name="vllm", device_kinds=_GPU, bandwidth=0.26, compute=1.0, overhead_mb=0, fitted=True,
                      source=_FIT + "decode 0.26 from 1 figure (Qwen3-14B AWQ on an A100 80 GB after a 16,000-token "
                      "prompt): one figure, no leave-one-out"),
    RuntimeEfficiency(name="llama_cpp", device_kinds=(*_GPU, "cpu"), bandwidth=0.35, compute=1.0, overhead_mb=0, fitted=True,
                      source=_FIT + "decode 0.35 from 7 figures (A100, H100, AGX/IGX Orin; Q4 and F16; leave-one-out "
                      "median 39 %, the H100 Q4_0 figure 168 %)"),
    RuntimeEfficiency(name="mlc", engine_backend=False, device_kinds=_GPU, bandwidth=0.66, compute=1.0, overhead_mb=0, fitted=True,
                      source=_FIT + "decode 0.66 from 14 INT4 figures on Orin Nano, Orin Nano Super and AGX Orin "
                      "(leave-one-out median 20 %); not an edgeflow backend: for comparison"),
    RuntimeEfficiency(name="tinychat", engine_backend=False, device_kinds=_GPU, bandwidth=0.69, compute=1.0, overhead_mb=0, fitted=True,
                      source=_FIT + "decode 0.69 from 4 figures on AGX Orin (AWQ INT4 and fp16; leave-one-out median "
                      "13 %); not an edgeflow backend: for comparison"),
    RuntimeEfficiency(name="cpu_native", device_kinds=("cpu",), bandwidth=0.60, compute=0.74, overhead_mb=0, fitted=True,
                      compute_fitted=True, by_weight_bits={32: (0.79, 0.42)},
                      source="benchmarks/estimate_cpu_native.py (BENCHMARKS.md#estimate-cpu-native): fractions of the "
                      "probed read stream and fp32 FMA peak, fitted per kernel family over 6 engines measured 3 times "
                      "each on a 2-core AMD EPYC: 4- and 8-bit layers (int16 multiply-adds; the demo student's awq, "
                      "gptq, rtn and gptq-w8a16) decode 0.60, prefill 0.74, leave-one-out at most 3 % and 11 %; fp32 "
                      "layers (fp32 FMAs; the student and the teacher) decode 0.79, prefill 0.42, at most 8 % and 0 %"),
    ROOFLINE.model_copy(update={"name": "cpu", "source": "not fitted yet: the roofline", "device_kinds": ("cpu",)}),
)}


def runtime_efficiency(name: str) -> RuntimeEfficiency:
    """The runtime called `name`; ValueError naming the known ones otherwise."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; known runtimes: {', '.join(RUNTIMES)}") from None


def target_runtime(backend: str, target: SLOTarget, where: str = "slo.targets[]") -> RuntimeEfficiency:
    """The runtime that serves `target`: its own `runtime`, else the profile's engine backend. ValueError, naming the
    field and the runtimes that do serve there, when that runtime does not run on the target's kind of device (a CPU
    engine's factors say nothing of an Orin's GPU)."""
    name = target.runtime or backend
    kind = device_class(target.device, f"{where}.device").kind
    serving = ", ".join(n for n, r in RUNTIMES.items() if r.engine_backend and kind in r.device_kinds)
    rt = RUNTIMES.get(name)
    if rt is None or not rt.engine_backend:
        raise ValueError(f"{where}.runtime={name!r} is not an engine backend edgeflow estimates; the ones that serve on "
                         f"{target.device}: {serving}")
    if kind not in rt.device_kinds:
        field = f"{where}.runtime={name!r}" if target.runtime else f"{where}.runtime (unset: engine.backend={backend!r})"
        raise ValueError(f"{field}: {name} serves on {' and '.join(rt.device_kinds)} devices and {target.device} is a "
                         f"{kind} device; name the runtime that serves on {target.device} in {where}.runtime "
                         f"({serving})")
    return rt
