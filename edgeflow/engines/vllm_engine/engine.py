"""The vllm build: plan (refusals first) -> link the checkpoint's model files -> copy tokenizer files -> engine.json.

    python -c "from pathlib import Path; from edgeflow.engines.vllm_engine import build; build(Path('ckpt'), Path('eng'), {})"

vLLM compiles nothing ahead of time: it reads compressed-tensors checkpoints as they are (repacking them for
Marlin when it loads). The engine directory is therefore the checkpoint's config.json and safetensors,
hard-linked (copied across filesystems), its tokenizer files, and engine.json. Runs on any CPU.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import engine_dir as edir
from edgeflow.engines.checkpoint import copy_tokenizer_files
from edgeflow.engines.gpu_host import dist_version
from edgeflow.engines.vllm_engine import device as dev
from edgeflow.engines.vllm_engine.plan import BACKEND, FORMAT_VERSION, plan_build


def link_or_copy(src: Path, dst: Path) -> str:
    """Hard-link src to dst (a new name for the same immutable bytes), copying where a link cannot be made."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
        return "link"
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)
        return "copy"


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """An engine directory vLLM loads: the checkpoint's model files, its tokenizer files and engine.json."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    plan = plan_build(checkpoint_dir, profile)  # every refusal, before anything is written
    device = dev.device_fingerprint()
    dev.check_build_host(plan["profile"]["vllm_version"], device.get("vllm"))
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    for stale in out_dir.glob("*.safetensors*"):  # vLLM reads every *.safetensors in the directory
        stale.unlink()
    how = {name: link_or_copy(checkpoint_dir / name, out_dir / name) for name in plan["model_files"]}
    tokenizer = copy_tokenizer_files(checkpoint_dir, out_dir)
    meta = engine_meta(plan, device, checkpoint_dir, sha256_tree(checkpoint_dir), tokenizer, how)
    return edir.write_meta(out_dir, meta)


def engine_meta(plan: dict[str, Any], device: dict[str, Any], checkpoint_dir: Path, checkpoint_sha256: str,
                tokenizer_files: list[str], how: dict[str, str]) -> edir.EngineMeta:
    """engine.json: the checkpoint it is, the vLLM release and GPU it needs, and how load builds vLLM's engine."""
    from edgeflow.engines.vllm_engine.runtime import SAMPLING_SUPPORT

    return edir.EngineMeta(**{
        "backend": BACKEND,
        "format": f"vllm engine dir v{FORMAT_VERSION} (checkpoint as stored; vLLM {plan['profile']['vllm_version']})",
        "precision": plan["precision"],
        "checkpoint_sha256": checkpoint_sha256,
        "files": plan["model_files"],
        "tokenizer_files": tokenizer_files,
        "build_identity": dev.build_identity_of(device),
        # what check_compatible compares with the device
        "vllm_version": plan["profile"]["vllm_version"],
        "min_sm": plan["min_sm"],
        "profile": plan["profile"],
        "engine_args": plan["engine_args"],
        "quantization": plan["quantization"],
        "vocab_size": plan["vocab_size"],
        "checkpoint": str(checkpoint_dir.resolve()),
        "file_transfer": how,
        "build_host": {k: device.get(k) for k in ("sm", "device_name", "vllm")},
        "sampling": {"method": "vLLM's sampler on the GPU (vllm.SamplingParams); logprobs are raw_logprobs",
                     "parameters": sorted(SAMPLING_SUPPORT)},
    })
