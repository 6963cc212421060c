"""Round-to-nearest int4 with llm-compressor: no calibration data, seconds on a small model. What `edgeflow doctor`
quantizes its tiny model with to build an int4 engine, and what the engine tests quantize theirs with; the release
quantizes with its recipes (edgeflow/quantize/run.py)."""
from __future__ import annotations

from pathlib import Path


def rtn_int4(dense: Path, out: Path, symmetric: bool = False, group_size: int = 64) -> Path:
    """An llm-compressor RTN int4 checkpoint of `dense` (every decoder Linear, lm_head kept)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}
    recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, output_dir=str(out), save_compressed=True)
    return out
