"""slo: the service objectives a variant must meet on each target device class, and what the estimate reads before
any build (edgeflow/estimate/). Values only: the device table is edgeflow/profile/devices.py.

    slo:
      targets:
        - device: agx-orin-64gb
          runtime: tensorrt_llm   # what serves there; default: engine.backend
          prompt_tokens: 512      # the TTFT objective's prompt length
          ttft_p99_ms: 500
          concurrency: 2          # sessions decoding at once
          decode_tok_s: 20        # p50 per stream, at that concurrency
          max_memory_mb: 48000    # the engine's resident footprint
"""
from __future__ import annotations

from pydantic import Field, model_validator

from edgeflow.profile.base import _Strict
from edgeflow.profile.devices import device_class


class SLOTarget(_Strict):
    device: str = Field(description="The device class (edgeflow/profile/devices.py DEVICES: agx-orin-64gb, "
                        "orin-nano-8gb, a100-80gb, x86-cpu, ...) the objectives hold on.")
    pool: str | None = Field(default=None, description="The Prefect pool whose devices are of this class (e.g. orin); "
                             "None: every pool the release deploys to.")
    runtime: str | None = Field(default=None, description="The engine backend that serves on this device class "
                                "(a key of edgeflow.engines.BACKENDS, e.g. tensorrt_llm on an Orin while the release "
                                "gates cpu_native engines): the estimate takes its factors (edgeflow/estimate/runtimes.py). "
                                "None: engine.backend, which must then run on this kind of device (checked at load).")
    prompt_tokens: int = Field(gt=0, le=1_048_576, description="The prompt length, in tokens, the TTFT objective and the "
                               "memory estimate are stated at.")
    concurrency: int = Field(gt=0, le=1024, description="Sessions decoding at once: the decode objective is per stream at "
                             "this concurrency, and the memory objective holds this many KV caches.")
    max_new_tokens: int = Field(default=256, gt=0, le=1_048_576, description="Tokens a session generates after its prompt: "
                                "the KV cache the memory estimate holds per session is prompt_tokens + this.")
    ttft_p99_ms: float | None = Field(default=None, gt=0, description="Time to the first token, 99th percentile, ms, for "
                                      "a prompt of prompt_tokens arriving with concurrency - 1 others; None: no objective.")
    decode_tok_s: float | None = Field(default=None, gt=0, description="Decode speed per stream, p50, tokens/s, with "
                                       "`concurrency` streams; None: no objective.")
    max_memory_mb: float | None = Field(default=None, gt=0, description="The engine's resident footprint on the device, "
                                        "MB (1e6 bytes): weights, KV caches and the runtime's workspace; None: no objective.")

    @model_validator(mode="after")
    def _device_and_memory(self):
        cls = device_class(self.device, "slo.targets[].device")
        if self.max_memory_mb is not None and cls.memory_gb is not None and self.max_memory_mb > cls.memory_gb * 1000:
            raise ValueError(f"slo.targets[].max_memory_mb: {self.max_memory_mb:g} MB is above the {cls.memory_gb:g} GB "
                             f"{self.device} has; give at most {cls.memory_gb * 1000:g}, and less: the OS and the other "
                             "processes share it")
        if self.ttft_p99_ms is None and self.decode_tok_s is None and self.max_memory_mb is None:
            raise ValueError(f"slo.targets[] for {self.device}: no objective; set ttft_p99_ms, decode_tok_s or "
                             "max_memory_mb, or remove the target")
        return self


class SLOConfig(_Strict):
    targets: list[SLOTarget] = Field(default_factory=list, description="One entry per device class the model is served "
                                     "on. Empty (the default): no service objective, variants are chosen by quality and "
                                     "size alone.")
    build_anyway: bool = Field(default=False, description="Build and gate a variant x target the estimate says no engine "
                               "could serve within its objectives (the estimate is a bound, and a bound can be wrong); "
                               "false: the plan flags it and the release refuses it before building.")
