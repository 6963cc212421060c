"""The edge_llm build: one build() call per phase (export on the x86 pool, engine on the Orin) -> engine.json.

    python -c "from pathlib import Path; from edgeflow.engines.edge_llm import build; build(Path('export'), Path('eng'), {})"

Edge-LLM splits the work across two machines: its exporter (Python, CPU is enough) turns a checkpoint into
ONNX + sidecars, and llm_build compiles that on the device the engine will run on. build() keeps the
Backend API's single call by choosing the phase from its input (profile `phase`, default "auto"):

* a checkpoint -> export phase (export.run_export): out_dir becomes an export directory, engine.json
  stage "export" (refused by check_compatible/load);
* an export directory -> engine phase (here): refuse unless this host is the profile's target (sm87,
  JetPack 7.2 / its L4T release, TensorRT, Edge-LLM release), then llm_build, check, engine.json stage
  "engine".

`phase: export` / `phase: engine` force one and refuse the other kind of input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeflow.engines import engine_dir as edir
from edgeflow.engines.checkpoint import copy_tokenizer_files
from edgeflow.engines.edge_llm import device as dev
from edgeflow.engines.edge_llm.export import run_export, run_step
from edgeflow.engines.edge_llm.plan import API_GENERATION, BACKEND, check_engine_config, plan_build
from edgeflow.engines.edge_llm.runtime import SAMPLING_SUPPORT, special_token_ids

# What llm_build writes for a plain LLM (cpp/builder/llmBuilder.cpp: engine file, copyConfig,
# copyTokenizerFiles / embedding copy).
ENGINE_FILES = ("llm.engine", "config.json", "embedding.safetensors")


def build(checkpoint_dir: Path, out_dir: Path, profile: dict) -> dict:
    """Export a checkpoint (x86 export pool) or build an export into an Edge-LLM engine (on the target)."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    plan = plan_build(checkpoint_dir, profile, out_dir)  # ValueError for profile/scheme problems, before any work
    if plan["phase"] == "export":
        return run_export(checkpoint_dir, out_dir, plan)
    device = dev.device_fingerprint(Path(plan["paths"]["edge_llm_src"]))
    dev.check_build_environment(plan, device)  # refuses before anything runs
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    log = out_dir / "build.log"
    log.write_text("")
    run_step("llm_build", plan["commands"]["build"], log)
    missing = [f for f in ENGINE_FILES if not (out_dir / f).exists()]
    if missing:
        raise RuntimeError(f"llm_build wrote no {missing} in {out_dir}; see {log}")
    engine_config = json.loads((out_dir / "config.json").read_text())
    check_engine_config(engine_config, plan["build_profile"])
    export_dir = Path(plan["paths"]["export"])
    copied = copy_tokenizer_files(export_dir, out_dir)  # generation_config.json etc. next to llm_build's copies
    end_id, pad_id = special_token_ids(out_dir)
    meta = engine_meta(plan, device, engine_config, copied, end_id, pad_id)
    return edir.write_meta(out_dir, meta)


def engine_meta(plan: dict[str, Any], device: dict[str, Any], engine_config: dict[str, Any],
                tokenizer_files: list[str], end_id: int | None, pad_id: int | None) -> edir.EngineMeta:
    """engine.json of an engine: what was built, how, on what, from which checkpoint (via its export)."""
    export = plan["export_meta"]
    bp = plan["build_profile"]
    return edir.EngineMeta(**{
        "backend": BACKEND,
        "stage": "engine",
        "api_generation": API_GENERATION,
        "format": f"tensorrt engine (Edge-LLM {device.get('edge_llm')}, TensorRT {device.get('tensorrt')})",
        "precision": export["precision"],  # int4_gptq or fp16 (the report's engine column)
        "dequantized": export.get("dequantized"),
        "build_identity": dev.build_identity_of(device),
        # what the engine is bound to (compared by check_compatible)
        "edge_llm": device.get("edge_llm"),
        "edge_llm_exporter": export.get("edge_llm_exporter"),
        "tensorrt": device.get("tensorrt"),
        "cuda": device.get("cuda_version"),
        "sm": device.get("sm"),
        "device_name": device.get("device_name"),
        "l4t_release": device.get("l4t_release"),
        "jetpack": device.get("jetpack"),
        "device": device,
        "engine_builder_config": engine_config.get("builder_config"),
        "build_profile_name": plan["build_profile_name"],
        "build_profile": bp,
        "commands": {"export": export.get("commands", {}).get("export"), "build": plan["commands"]["build"]},
        "quantization": export.get("quantization"),
        "staging": export.get("staging"),
        "export": plan["paths"]["export"],
        "export_cache_key": export.get("cache_key"),
        "checkpoint": export.get("checkpoint"),
        "checkpoint_sha256": export["checkpoint_sha256"],
        "cache_key": dev.cache_key(export["checkpoint_sha256"], bp, device, "engine"),
        "files": list(ENGINE_FILES),
        "tokenizer_files": tokenizer_files,
        "end_id": end_id,
        "pad_id": pad_id,
        "score": "not available: Edge-LLM's runtime returns at most top-50 logprobs of generated tokens, no prompt logits",
        "sampling": {"method": "Edge-LLM's sampler (temperature, top-k, top-p) on the engine's logits",
                     "parameters": sorted(SAMPLING_SUPPORT)},
    })

