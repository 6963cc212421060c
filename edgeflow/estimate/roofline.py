"""The estimate: how fast and how big a variant can be on a device class, before anything is built.

Each figure is the slower of two limits, the memory's and the arithmetic's, times the runtime's efficiency
(edgeflow/estimate/runtimes.py):
- decode, per stream with `concurrency` streams: one step reads every weight once for all streams and each stream's
  KV cache at its mean context (prompt + half the new tokens), and computes 2 FLOPs per weight per stream;
- TTFT p99: the prompts of `concurrency` sessions arriving together, prefilled one after another (the last one waits
  for the others), each the slower of its FLOPs at the compute peak and one read of the weights;
- memory: the resident weights, `concurrency` KV caches of prompt + new tokens, and the runtime's own workspace.
The counts are edgeflow/estimate/counts.py's; a device's figures edgeflow/profile/devices.py's, or the probe's on an
x86 host (edgeflow/estimate/probe.py).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.estimate.counts import TokenCost
from edgeflow.estimate.runtimes import RuntimeEfficiency


class Limits(BaseModel):
    """What the hardware allows: bandwidth and compute peak (from the device table or the probe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(description="The device class (or the probed host).")
    bandwidth_gb_s: float = Field(gt=0, description="Memory bandwidth, GB/s.")
    peak_tflops: float = Field(gt=0, description="The compute peak the runtime's matmuls use, TFLOP/s.")
    memory_gb: float | None = Field(description="The device's memory, GB; None: not known.")
    source: str = Field(description="Where the figures come from.")


class Estimate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    decode_tok_s: float = Field(description="Decode speed per stream at the stated concurrency, tokens/s.")
    decode_bound: str = Field(description="'memory' or 'compute': the limit decode meets first.")
    decode_roofline_tok_s: float = Field(description="The same with every efficiency 1: what no engine can beat.")
    ttft_p99_ms: float = Field(description="Time to the first token of the last of `concurrency` prompts arriving together, ms.")
    ttft_bound: str = Field(description="'compute' or 'memory': the limit a prefill meets first.")
    memory_mb: float = Field(description="Resident footprint: weights, KV caches and the runtime's workspace, MB.")
    step_bytes: float = Field(description="Bytes one decode step reads (weights + every stream's KV cache).")
    prefill_flops: float = Field(description="FLOPs of one prefill of the stated prompt.")

    def misses(self, target: Any) -> list[str]:
        """Which of an slo target's objectives this estimate cannot meet, each with the figure and the limit."""
        out = []
        if target.decode_tok_s is not None and self.decode_tok_s < target.decode_tok_s:
            out.append(f"decode {self.decode_tok_s:.1f} tok/s < {target.decode_tok_s:g} tok/s per stream at concurrency "
                       f"{target.concurrency} (bound by {self.decode_bound}; no engine beats {self.decode_roofline_tok_s:.1f})")
        if target.ttft_p99_ms is not None and self.ttft_p99_ms > target.ttft_p99_ms:
            out.append(f"TTFT p99 {self.ttft_p99_ms:.0f} ms > {target.ttft_p99_ms:g} ms at {target.prompt_tokens} prompt "
                       f"tokens (bound by {self.ttft_bound})")
        if target.max_memory_mb is not None and self.memory_mb > target.max_memory_mb:
            out.append(f"memory {self.memory_mb:.0f} MB > {target.max_memory_mb:g} MB")
        return out


def estimate(cost: TokenCost, limits: Limits, runtime: RuntimeEfficiency, prompt_tokens: int, concurrency: int,
             max_new_tokens: int) -> Estimate:
    """The estimate of one variant (its `cost`) on one device (`limits`) with one runtime (see the module doc)."""
    bw = limits.bandwidth_gb_s * 1e9
    peak = limits.peak_tflops * 1e12
    context = prompt_tokens + max_new_tokens // 2
    step_bytes = cost.step_weight_bytes + concurrency * cost.kv_read_bytes(context)
    mem_s, flop_s = step_bytes / bw, concurrency * cost.decode_flops(context) / peak  # the roofline's
    bandwidth, compute = runtime.factors(cost.weight_bits)
    mem_t, flop_t = mem_s / bandwidth, flop_s / compute  # the runtime's
    flops = cost.prefill_flops(prompt_tokens)
    p_flop_s, p_mem_s = flops / (peak * compute), cost.step_weight_bytes / (bw * bandwidth)
    resident = (cost.resident_weight_bytes + concurrency * cost.kv_resident_bytes(prompt_tokens + max_new_tokens)) / 1e6
    return Estimate(
        decode_tok_s=1 / max(mem_t, flop_t), decode_bound="memory" if mem_t >= flop_t else "compute",
        decode_roofline_tok_s=1 / max(mem_s, flop_s),
        ttft_p99_ms=1000 * concurrency * max(p_flop_s, p_mem_s), ttft_bound="compute" if p_flop_s >= p_mem_s else "memory",
        memory_mb=resident + runtime.overhead_mb, step_bytes=step_bytes, prefill_flops=flops,
    )
