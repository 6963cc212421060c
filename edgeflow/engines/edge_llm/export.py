"""The export phase of the edge_llm build: checkpoint -> staged HF checkpoint -> ONNX + sidecars (x86 export pool).

    python -c "from pathlib import Path; from edgeflow.engines.edge_llm import build; build(Path('ckpt'), Path('export'), {'phase': 'export'})"

Runs where tensorrt-edgellm is installed (a CPU host is enough: "Unquantized and supported pre-quantized
checkpoints export on CPU", quick-start-guide.md). The output directory holds onnx/llm/ (the exporter's
files), the tokenizer files and an engine.json with stage "export": check_compatible and load refuse it
until the engine phase has run on the target.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from edgeflow.tracking.artifacts import sha256_tree
from edgeflow.engines import engine_dir as edir
from edgeflow.engines.checkpoint import copy_tokenizer_files, read_config
from edgeflow.engines.edge_llm import device as dev
from edgeflow.engines.edge_llm.plan import API_GENERATION, BACKEND, EXPORT_REQUIRED, ONNX_SUBDIR, check_export_config
from edgeflow.engines.edge_llm.staging import stage_checkpoint


def run_step(name: str, cmd: list[str], log: Path) -> None:
    """Run one build step, appending its output to `log`; RuntimeError with the log tail on failure."""
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise RuntimeError(f"{name} failed (exit {rc}); last lines of {log}:\n{tail}")


def export_files(out_dir: Path) -> list[str]:
    """Every file under onnx/ (model.onnx, its external data, config.json, embedding and tokenizer sidecars)."""
    root = Path(out_dir) / ONNX_SUBDIR
    return sorted(str(p.relative_to(out_dir)) for p in root.rglob("*") if p.is_file())


def run_export(checkpoint_dir: Path, out_dir: Path, plan: dict[str, Any]) -> dict:
    """Stage, export, check the exporter's config.json, write engine.json (stage export). Returns engine.json."""
    # the exporter runs in its own interpreter (plan.exporter_python): its release is what that one has installed
    device = dev.gpu_fingerprint() | {"edge_llm": dev.exporter_version(plan["commands"]["export"][0])}
    dev.check_export_environment(plan, device)  # refuses before anything runs
    quant = plan["quantization"]
    work = Path(plan["paths"]["work"])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:  # tensor-level refusals (off-centre asymmetric groups, zero point 0) come before out_dir is touched
        staging = stage_checkpoint(checkpoint_dir, Path(plan["paths"]["staging"]), quant)
    except Exception:
        shutil.rmtree(work, ignore_errors=True)
        raise
    out_dir.mkdir(parents=True, exist_ok=True)
    edir.clear_meta(out_dir)
    shutil.rmtree(out_dir / ONNX_SUBDIR, ignore_errors=True)
    log = out_dir / "export.log"
    log.write_text("")
    run_step("tensorrt-edgellm-export", plan["commands"]["export"], log)
    llm = Path(plan["paths"]["llm_onnx"])
    missing = [f for f in EXPORT_REQUIRED if not (llm / f).exists()]
    if missing:
        raise RuntimeError(f"the exporter wrote no {missing} under {llm}; see {log}")
    export_config = json.loads((llm / "config.json").read_text())
    check_export_config(export_config, plan, read_config(checkpoint_dir))
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    sha = sha256_tree(checkpoint_dir)
    meta = {
        "backend": BACKEND,
        "stage": "export",
        "api_generation": API_GENERATION,
        "format": f"Edge-LLM ONNX export ({export_config.get('edgellm_version')})",
        "precision": quant["precision"],
        "dequantized": ({"reason": quant["dequantized"], "checkpoint_quantization": read_config(checkpoint_dir)
                         .get("quantization_config") or {}} if quant.get("dequantized") else None),
        "edge_llm_exporter": export_config.get("edgellm_version"),
        "export_host": {k: device.get(k) for k in ("edge_llm", "sm", "device_name")},
        "build_identity": dev.build_identity_of(device),
        "build_profile_name": plan["build_profile_name"],
        "build_profile": plan["build_profile"],
        "commands": plan["commands"],
        "quantization": quant,
        "staging": staging,
        "export_config": export_config,
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "checkpoint_sha256": sha,
        "cache_key": dev.cache_key(sha, plan["build_profile"], device, "export"),
        "files": export_files(out_dir),
        "tokenizer_files": copied,
    }
    written = edir.write_meta(out_dir, meta)
    shutil.rmtree(work, ignore_errors=True)  # kept on failure, for the log's paths
    return written
