"""Quantization with llm-compressor `oneshot`: one recipe file per variant, passed through unchanged.

Tiny CPU run: python -m edgeflow.pipeline.quantize --profile configs/test-tiny.yaml
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import yaml

from edgeflow.model.architecture import transformers_kwargs
from edgeflow.tracking.artifacts import write_manifest
from edgeflow.engines.checkpoint import load_dequantized  # the checkpoint as its exactly dequantized model (owned there)
from edgeflow.quantize.recipe import modifiers


def _cpu_pin_memory_workaround() -> None:
    """Make llm-compressor's AWQ cache pinning a no-op when there is no CUDA device.

    llm-compressor 0.14's AWQ pins cached activations (`IntermediatesCache.pin_memory`) to speed up
    host-to-GPU copies during its grid search. On a CPU-only torch build `Tensor.pin_memory()` raises
    (no accelerator to pin for), so AWQ cannot run at all. Pinning only ever helps H2D copies, so on a
    machine without CUDA skipping it changes nothing but the crash. This is the only place that patches
    llm-compressor; tests/quantize/test_quantize.py runs AWQ on the CPU and fails if it is removed.
    """
    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def _matches(name: str, module: torch.nn.Module, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == type(module).__name__ or name == p or name.endswith("." + p):
            return True
    return False


def check_group_sizes(model: torch.nn.Module, recipe: dict) -> None:
    """Fail before calibration if a group size does not divide a targeted layer's input width.

    Group quantization needs in_features % group_size == 0 (SmolLM2's 576-wide projections rule out 128).
    """
    for modifier, fields in modifiers(recipe):
        ignore = fields.get("ignore", [])
        for gname, group in (fields.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            gs = w.get("group_size")
            if w.get("strategy") != "group" or not gs:
                continue
            targets = group.get("targets", ["Linear"])
            for name, mod in model.named_modules():
                if not isinstance(mod, torch.nn.Linear) or _matches(name, mod, ignore) or not _matches(name, mod, targets):
                    continue
                width = mod.in_features
                if width % gs:
                    valid = [g for g in (16, 32, 64, 128, 256) if width % g == 0]
                    raise ValueError(
                        f"{modifier}.config_groups.{gname}.weights.group_size={gs} does not divide layer "
                        f"{name!r} (input width {width}); valid group sizes for this model: {valid}. "
                        f"Set group_size to one of them in the recipe, or add the layer to `ignore`."
                    )


def recipe_scheme(recipe: dict) -> dict:
    """The weight scheme a recipe applies (bits, group size, symmetry, act-order), for reports and engines."""
    for _, fields in modifiers(recipe):
        for group in (fields.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            return {
                "bits": w.get("num_bits"),
                "group_size": w.get("group_size"),
                "symmetric": w.get("symmetric"),
                "actorder": w.get("actorder"),
            }
        if fields.get("scheme"):
            return {"scheme": fields["scheme"]}
    return {}


def recipe_schemes(recipe: dict) -> list[dict]:
    """Every weight scheme a recipe applies, with its targets (a mixed recipe has several)."""
    out = []
    for _, fields in modifiers(recipe):
        for group in (fields.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            out.append({"targets": group.get("targets", ["Linear"]), "bits": w.get("num_bits"),
                        "strategy": w.get("strategy"), "group_size": w.get("group_size"),
                        "symmetric": w.get("symmetric"), "actorder": w.get("actorder")})
        if fields.get("scheme"):
            out.append({"targets": fields.get("targets", ["Linear"]), "scheme": fields["scheme"]})
    return out


@torch.no_grad()
def weight_errors(reference: torch.nn.Module, quantized: torch.nn.Module) -> dict[str, float]:
    """Relative weight error ‖W − Ŵ‖/‖W‖ of every Linear layer whose weights changed (the quantized ones).

    Meaningful for GPTQ/RTN; for AWQ it also counts the per-channel rescaling AWQ folds into
    neighbouring layers (exact in function, not in weights). The gate's per-layer plot therefore uses
    block output errors (edgeflow.evaluation.metrics.LayerError).
    """
    ref = dict(reference.named_modules())
    out = {}
    for name, mod in quantized.named_modules():
        if isinstance(mod, torch.nn.Linear) and name in ref:
            w, wq = ref[name].weight.float(), mod.weight.float()
            if w.shape == wq.shape and not torch.equal(w, wq):
                out[name] = float((w - wq).norm() / w.norm().clamp_min(1e-12))
    return out


def _device_for(slot: int) -> str:
    """Mapped variants on a multi-GPU node take one GPU each (slot mod device count); CPU otherwise."""
    if torch.cuda.is_available():
        return f"cuda:{slot % torch.cuda.device_count()}"
    return "cpu"


def quantize(
    student_dir: Path, recipe: dict, calibration_ids: list[list[int]], out_dir: Path, slot: int = 0,
    device: str | None = None,
) -> dict:
    """Setup → oneshot → save compressed. Returns facts about the produced checkpoint. `device`: where to run it
    (default: the slot's GPU when there is one, else the CPU; `edgeflow doctor` runs the same recipe on both)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.core import create_session
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _cpu_pin_memory_workaround()
    tokenizer = AutoTokenizer.from_pretrained(student_dir)  # oneshot needs a processor even for pre-tokenized data
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32,
                                                 **transformers_kwargs(student_dir)).to(device or _device_for(slot))
    check_group_sizes(model, recipe)

    ds = Dataset.from_dict(
        {"input_ids": calibration_ids, "attention_mask": [[1] * len(x) for x in calibration_ids]}
    )
    max_len = max(len(x) for x in calibration_ids)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # llm-compressor keeps its compression session in a thread-local that falls back to one global
    # session; a fresh session per call keeps mapped variants running in threads of one worker apart.
    # The save stays inside it: save_pretrained writes the session's recipe as recipe.yaml (what the
    # TensorRT-LLM and Edge-LLM plans read the algorithm from); outside, that was the empty global
    # session's, or none at all in a thread that did not import llm-compressor.
    with create_session():
        oneshot(
            model=model,
            tokenizer=tokenizer,
            dataset=ds,
            recipe=yaml.safe_dump(recipe),  # llm-compressor takes a path or a YAML string, not a dict
            num_calibration_samples=len(calibration_ids),
            max_seq_length=max_len,
            shuffle_calibration_samples=False,
        )
        model = model.to("cpu")
        model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)  # the engine build copies it next to the engine
    return _saved(student_dir, tmp, out_dir) | {"scheme": recipe_scheme(recipe), "schemes": recipe_schemes(recipe)}


def _saved(student_dir: Path, tmp: Path, out_dir: Path) -> dict:
    """Finish a variant's checkpoint: manifest, `tmp` moved to `out_dir`; its size and its weight error against the
    student."""
    from transformers import AutoModelForCausalLM

    write_manifest(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    size = sum(p.stat().st_size for p in out_dir.rglob("*.safetensors"))
    errors = weight_errors(AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32, **transformers_kwargs(student_dir)),
                           load_dequantized(out_dir))
    return {"size_mb": size / 2**20, "weight_error": errors}


def adopt(student_dir: Path, src: Path, out_dir: Path) -> dict:
    """A checkpoint quantized elsewhere as this variant's, instead of quantizing: setup (read and check it against the
    student, the model's FP weights) → import (AutoAWQ / GPTQ through checkpoint.import_prequantized, bit-exactly;
    compressed-tensors copied) → save. Returns the same facts `quantize` does, the weight error measured against the
    student. ValueError naming the field that differs when the checkpoint is not the student's architecture."""
    from edgeflow.model.architecture import describe
    from edgeflow.engines.checkpoint import copy_tokenizer_files, import_prequantized, prequantized, read_config, weight_schemes

    student_dir, src, out_dir = Path(student_dir), Path(src), Path(out_dir)
    config, student = read_config(src), read_config(student_dir)
    theirs, ours = describe(config, f"{src}/config.json").model_dump(), describe(student, f"{student_dir}/config.json").model_dump()
    differ = {k: {"checkpoint": theirs[k], "student": ours[k]} for k in ours if theirs[k] != ours[k]}
    if differ:
        raise ValueError(f"{src}: a pre-quantized variant must be the student's model quantized; its config.json differs "
                         f"in {differ}. Fix: start the student from the checkpoint's FP model (distill.student_from), "
                         "or drop the variant")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if prequantized(config):
        scheme = import_prequantized(src, tmp)
        schemes = [scheme]
    else:
        found = weight_schemes(config, f"{src}/config.json")
        if not found:
            raise ValueError(f"{src}/config.json has no quantization_config: a pre-quantized variant names an AutoAWQ, "
                             "GPTQ or compressed-tensors checkpoint; a dense model is the student (distill.student_from)")
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("edgeflow-manifest.json"))
        schemes = list(found.values())
    if not (tmp / "tokenizer.json").exists():
        copy_tokenizer_files(student_dir, tmp)
    first = schemes[0]
    return _saved(student_dir, tmp, out_dir) | {
        "scheme": {"bits": first.bits, "group_size": first.group_size, "symmetric": first.symmetric,
                   "actorder": first.actorder},
        "schemes": [s.summary() | {"strategy": s.strategy, "actorder": s.actorder} for s in schemes],
        "prequantized_from": prequantized(config) or "compressed-tensors"}
