"""A quantization recipe file as a variant names it: read, with the profile's per-modifier overrides applied.

    python -c "from edgeflow.quantize.recipe import load_recipe; print(load_recipe('deployments/recipes/gptq-w4a16-sym.yaml'))"

Apart from edgeflow/quantize/run.py, which runs the recipe, so that whoever only keys a variant (the release's stage look-up,
`edgeflow plan`) reads its recipe without importing torch and llm-compressor (1.9 s of a release's start here).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml


def modifiers(recipe: dict) -> Iterator[tuple[str, dict]]:
    """(modifier name, its fields) of every modifier of every stage and group of a recipe."""
    for stage in recipe.values():
        for group in stage.values():
            yield from group.items()


def load_recipe(path: Path, overrides: dict[str, dict] | None = None) -> dict:
    """Read a recipe YAML; `overrides` patches fields of named modifiers (e.g. AWQ n_grid for tiny profiles)."""
    recipe = yaml.safe_load(Path(path).read_text())  # parsed here: patched in place, no one else holds it
    if not overrides:
        return recipe
    for name, fields in modifiers(recipe):
        if name in overrides:
            fields.update(overrides[name])
    return recipe


def weight_spec(recipe: dict) -> tuple[int, int | None, bool]:
    """(bits, group size or None for one scale per row, symmetric) of a recipe whose every config group quantizes its
    weights the same way; ValueError naming what differs, or that no group says (a preset `scheme:` is not read here)."""
    specs = set()
    for _, fields in modifiers(recipe):
        for name, group in (fields.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("type", "int") != "int" or "num_bits" not in w:
                raise ValueError(f"config group {name}: weights {w} are not integers of a stated width")
            specs.add((int(w["num_bits"]), w.get("group_size") if w.get("strategy") == "group" else None,
                       bool(w.get("symmetric", True))))
    if not specs:
        raise ValueError("no config_groups with weights (a preset scheme is not read here)")
    if len(specs) > 1:
        raise ValueError(f"its config groups quantize differently ({sorted(specs, key=str)}): a mixed scheme")
    return specs.pop()
