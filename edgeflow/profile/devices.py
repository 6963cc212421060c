"""The device classes an SLO may name (`slo.targets[].device`) and the estimate reads (edgeflow/estimate/): memory,
memory bandwidth and dense tensor peak, each with its source. Values only; an x86 CPU's bandwidth and peak are not in
the table but measured on the host by a short probe (edgeflow/estimate/probe.py).

Peaks are dense (no 2:4 sparsity) FP16 tensor FLOP/s and INT8 tensor op/s of the GPU alone (not the DLAs). Where a
datasheet gives only the sparse INT8 figure of the GPU, the dense FP16 figure is a quarter of it (Ampere's tensor
cores: sparse doubles, INT8 doubles FP16), and the entry says `derived`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DeviceClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The name profiles and `edgeflow estimate --device` use.")
    kind: Literal["jetson", "datacenter-gpu", "cpu"] = Field(description="What runs the engine.")
    memory_gb: float | None = Field(description="Memory the engine shares with everything else on the device (GB, 1e9 "
                                    "bytes); None for a CPU host, whose memory the host reports.")
    bandwidth_gb_s: float | None = Field(description="Peak memory bandwidth, GB/s; None: measured by the probe.")
    fp16_tflops: float | None = Field(description="Dense FP16 tensor peak, TFLOP/s; None: measured by the probe (fp32 FMA).")
    int8_tops: float | None = Field(description="Dense INT8 tensor peak, TOP/s; None where the runtimes do not use it.")
    source: str = Field(description="Where the figures come from, and what was derived.")


_ORIN_BRIEF = ("NVIDIA Jetson AGX Orin Series technical brief and Jetson Orin modules datasheet "
               "(https://www.nvidia.com/en-us/autonomous-machines/embedded-systems/jetson-orin/, module comparison table)")

DEVICES: dict[str, DeviceClass] = {d.name: d for d in (
    DeviceClass(name="agx-orin-64gb", kind="jetson", memory_gb=64, bandwidth_gb_s=204.8, fp16_tflops=42.5, int8_tops=85,
                source=f"{_ORIN_BRIEF}: 64 GB LPDDR5, 204.8 GB/s, GPU 170 sparse INT8 TOPS (2048 CUDA cores, 64 tensor "
                "cores, 1.3 GHz); dense INT8 and FP16 derived"),
    DeviceClass(name="agx-orin-32gb", kind="jetson", memory_gb=32, bandwidth_gb_s=204.8, fp16_tflops=26.7, int8_tops=53.3,
                source=f"{_ORIN_BRIEF}: 32 GB LPDDR5, 204.8 GB/s, GPU 1792 CUDA cores, 56 tensor cores, 930 MHz "
                "(~107 sparse INT8 TOPS); dense INT8 and FP16 derived"),
    DeviceClass(name="orin-nx-16gb", kind="jetson", memory_gb=16, bandwidth_gb_s=102.4, fp16_tflops=15.0, int8_tops=30,
                source=f"{_ORIN_BRIEF}: 16 GB LPDDR5, 102.4 GB/s, GPU 1024 CUDA cores, 32 tensor cores, 918 MHz "
                "(~60 sparse INT8 TOPS); dense INT8 and FP16 derived"),
    DeviceClass(name="orin-nano-8gb", kind="jetson", memory_gb=8, bandwidth_gb_s=68, fp16_tflops=10.2, int8_tops=20.5,
                source=f"{_ORIN_BRIEF}: 8 GB LPDDR5, 68 GB/s, GPU 1024 CUDA cores, 32 tensor cores, 625 MHz, 40 sparse "
                "INT8 TOPS; dense INT8 and FP16 derived"),
    DeviceClass(name="orin-nano-super-8gb", kind="jetson", memory_gb=8, bandwidth_gb_s=102, fp16_tflops=16.7,
                int8_tops=33.5, source="NVIDIA Jetson Orin Nano Super Developer Kit (JetPack 6.2 'super' power mode, "
                "https://developer.nvidia.com/blog/nvidia-jetson-orin-nano-developer-kit-gets-a-super-boost/): 102 GB/s, "
                "GPU 1020 MHz, 67 sparse INT8 TOPS; dense INT8 and FP16 derived"),
    DeviceClass(name="agx-thor", kind="jetson", memory_gb=128, bandwidth_gb_s=273, fp16_tflops=259, int8_tops=None,
                source="NVIDIA Jetson AGX Thor (T5000) datasheet (https://www.nvidia.com/en-us/autonomous-machines/"
                "embedded-systems/jetson-thor/): 128 GB LPDDR5X, 273 GB/s, 2070 sparse FP4 TFLOPS; dense FP16 derived "
                "(Blackwell: FP4 = 2 x FP8 = 4 x FP16, sparse = 2 x dense)"),
    DeviceClass(name="a100-40gb", kind="datacenter-gpu", memory_gb=40, bandwidth_gb_s=1555, fp16_tflops=312, int8_tops=624,
                source="NVIDIA A100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/a100/), SXM 40 GB: "
                "1,555 GB/s HBM2, 312 dense FP16 tensor TFLOPS, 624 dense INT8 TOPS"),
    DeviceClass(name="a100-80gb", kind="datacenter-gpu", memory_gb=80, bandwidth_gb_s=2039, fp16_tflops=312, int8_tops=624,
                source="NVIDIA A100 datasheet, SXM 80 GB: 2,039 GB/s HBM2e, 312 dense FP16 tensor TFLOPS, 624 dense INT8 TOPS"),
    DeviceClass(name="h100-sxm", kind="datacenter-gpu", memory_gb=80, bandwidth_gb_s=3350, fp16_tflops=989, int8_tops=1979,
                source="NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/), SXM: "
                "3.35 TB/s HBM3, 1,979 sparse FP16 TFLOPS (989 dense), 3,958 sparse INT8 TOPS (1,979 dense)"),
    DeviceClass(name="h100-pcie", kind="datacenter-gpu", memory_gb=80, bandwidth_gb_s=2000, fp16_tflops=756, int8_tops=1513,
                source="NVIDIA H100 Tensor Core GPU datasheet, PCIe: 2 TB/s HBM2e, 1,513 sparse FP16 TFLOPS (756 dense), "
                "3,026 sparse INT8 TOPS (1,513 dense)"),
    DeviceClass(name="x86-cpu", kind="cpu", memory_gb=None, bandwidth_gb_s=None, fp16_tflops=None, int8_tops=None,
                source="this host: its read bandwidth and fp32 FMA peak measured by edgeflow/estimate/probe.py on the "
                "engine's threads"),
)}


def device_class(name: str, field: str = "device") -> DeviceClass:
    """The device class called `name`; ValueError naming the field and every known name otherwise."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"{field}: unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None
