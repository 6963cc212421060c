"""Estimates before any build: what a model stored in a scheme costs per token (counts.py), what a device allows
(the device table, edgeflow/profile/devices.py, or the probe on an x86 host, probe.py), how close each runtime gets
(runtimes.py), and the estimate of decode speed, TTFT and memory that follows (roofline.py).

    edgeflow estimate --model DIR --bits 4 --device agx-orin-64gb --runtime tensorrt_llm --prompt 512
"""
from __future__ import annotations

from functools import lru_cache

from edgeflow.estimate.roofline import Limits
from edgeflow.profile.devices import device_class


@lru_cache(maxsize=None)
def limits_for(device: str) -> Limits:
    """The limits of a device class: from the device table, or measured on this host for x86-cpu (probe.cached_probe: kept a day)."""
    cls = device_class(device, "device")
    if cls.bandwidth_gb_s is not None and cls.fp16_tflops is not None:
        return Limits(device=device, bandwidth_gb_s=cls.bandwidth_gb_s, peak_tflops=cls.fp16_tflops,
                      memory_gb=cls.memory_gb, source=cls.source)
    from edgeflow.estimate.probe import cached_probe

    host = cached_probe()
    return Limits(device=device, bandwidth_gb_s=host.read_gb_s, peak_tflops=host.fma_gflops / 1e3, memory_gb=None,
                  source=f"probed on this host: {host.cpu} ({', '.join(host.isa)}), {host.threads} threads, read stream "
                  f"over {host.buffer_mib} MiB, fp32 FMA peak")
