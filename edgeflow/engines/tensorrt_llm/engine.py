"""The tensorrt_llm build: plan -> refuse off-target -> stage -> convert -> trtllm-build -> check -> engine.json.

    python -c "from pathlib import Path; from edgeflow.engines.tensorrt_llm import build; build(Path('ckpt'), Path('eng'), {})"
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import engine_dir as edir
from edgeflow.engines.checkpoint import copy_tokenizer_files
from edgeflow.engines.tensorrt_llm import device as dev
from edgeflow.engines.tensorrt_llm.plan import (
    BACKEND,
    SCORE_SUBDIR,
    check_converted_quantization,
    check_engine_config,
    plan_build,
)
from edgeflow.engines.tensorrt_llm.versions import (
    API_GENERATIONS,
)
from edgeflow.engines.tensorrt_llm.runtime import SAMPLING_SUPPORT, special_token_ids
from edgeflow.engines.tensorrt_llm.staging import stage_checkpoint

# Converter precision -> what the engine's layers compute with (dense engines: the profile dtype).
_PRECISION = {"int4_gptq": "int4", "int8": "int8", "int8_gptq": "int8"}


def _run(name: str, cmd: list[str], log: Path) -> None:
    """Run one build step, appending its output to `log`; RuntimeError with the log tail on failure."""
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"{name} failed (exit {rc}); last lines of {log}:\n{tail}")


def _engine_files(engine_dir: Path, rel: str = "") -> list[str]:
    return sorted(f"{rel}{p.name}" for p in Path(engine_dir).iterdir() if p.suffix == ".engine" or p.name == "config.json")


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Convert and compile a dense or compressed-tensors checkpoint into a TensorRT-LLM engine dir on the target GPU."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    plan = plan_build(checkpoint_dir, profile, out_dir)  # ValueError for profile/scheme problems, before any work
    device = dev.device_fingerprint()
    dev.check_build_environment(plan, device)  # refuses before anything runs
    bp, quant = plan["build_profile"], plan["quantization"]
    work = Path(plan["paths"]["work"])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:  # tensor-level ValueErrors (e.g. a zero point GPTQ cannot store) come before out_dir is touched
        staging = stage_checkpoint(checkpoint_dir, Path(plan["paths"]["staging"]), quant, bp["dtype"])
    except Exception:
        shutil.rmtree(work, ignore_errors=True)
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    log = out_dir / "build.log"
    log.write_text("")
    _run("convert_checkpoint.py", plan["commands"]["convert"], log)
    tllm_config = json.loads((Path(plan["paths"]["tllm_checkpoint"]) / "config.json").read_text())
    check_converted_quantization(tllm_config, quant)
    _run("trtllm-build", plan["commands"]["build"], log)
    engine_config = json.loads((out_dir / "config.json").read_text())
    check_engine_config(engine_config, bp, bp["gather_context_logits"] == "serving")
    files = _engine_files(out_dir)
    if plan["commands"]["build_score"]:
        _run("trtllm-build (score engine)", plan["commands"]["build_score"], log)
        check_engine_config(json.loads((out_dir / SCORE_SUBDIR / "config.json").read_text()), bp, True)
        files += _engine_files(out_dir / SCORE_SUBDIR, f"{SCORE_SUBDIR}/")
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    end_id, pad_id = special_token_ids(out_dir)
    checkpoint_sha = sha256_tree(checkpoint_dir)
    meta = engine_meta(plan, device, checkpoint_dir, checkpoint_sha, engine_config, staging, files, copied, end_id, pad_id)
    written = edir.write_meta(out_dir, meta)
    shutil.rmtree(work, ignore_errors=True)  # kept on failure, for the log's paths
    return written


def engine_meta(
    plan: dict[str, Any], device: dict[str, Any], checkpoint_dir: Path, checkpoint_sha256: str,
    engine_config: dict[str, Any], staging: dict[str, Any], engine_files: list[str], tokenizer_files: list[str],
    end_id: int | None, pad_id: int | None,
) -> edir.EngineMeta:
    """engine.json contents: what was built, how (every flag), on what, from which checkpoint."""
    quant = plan["quantization"]
    precision = _PRECISION.get(quant["weight_only_precision"], plan["build_profile"]["dtype"])
    api = API_GENERATIONS[plan["build_profile"]["api"]]
    return edir.EngineMeta(**{
        "backend": BACKEND,
        "format": f"tensorrt engine (TensorRT-LLM {device.get('tensorrt_llm')}, TensorRT {device.get('tensorrt')})",
        # the TensorRT-LLM API generation that built it and can run it (compared by check_compatible)
        "api": api.name,
        "api_tensorrt_llm_range": api.range(),
        "precision": precision,  # what the layers compute with (the report's engine column)
        "build_identity": dev.build_identity_of(device),
        # versions and device the engine is bound to (compared by check_compatible)
        "tensorrt_llm": device.get("tensorrt_llm"),
        "tensorrt": device.get("tensorrt"),
        "cuda": device.get("cuda_version"),
        "sm": device.get("sm"),
        "device_name": device.get("device_name"),
        "l4t_release": device.get("l4t_release"),
        "jetpack": device.get("jetpack"),
        "device": device,
        "engine_config_version": engine_config.get("version"),
        "engine_quantization": (engine_config.get("pretrained_config") or {}).get("quantization"),
        "build_profile_name": plan["build_profile_name"],
        "build_profile": plan["build_profile"],
        "commands": plan["commands"],
        "quantization": plan["quantization"],
        "staging": staging,
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "checkpoint_sha256": checkpoint_sha256,
        "cache_key": dev.cache_key(checkpoint_sha256, plan["build_profile"], device),
        "files": engine_files,
        "score_engine": SCORE_SUBDIR if plan["commands"]["build_score"] else (
            "." if plan["build_profile"]["gather_context_logits"] == "serving" else None),
        "tokenizer_files": tokenizer_files,
        "end_id": end_id,
        "pad_id": pad_id,
        "sampling": {"method": "TensorRT-LLM's own sampler (SamplingConfig) on the engine's logits",
                     "parameters": sorted(SAMPLING_SUPPORT)},
    })
