"""A quantization recipe file as a variant names it: read, with the profile's per-modifier overrides applied.

    python -c "from tasks.recipe import load_recipe; print(load_recipe('deployments/recipes/gptq-w4a16-sym.yaml'))"

Apart from tasks/quantize.py, which runs the recipe, so that whoever only keys a variant (the release's stage look-up,
`edgeflow plan`) reads its recipe without importing torch and llm-compressor (1.9 s of a release's start here).
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml


def load_recipe(path: Path, overrides: dict[str, dict] | None = None) -> dict:
    """Read a recipe YAML; `overrides` patches fields of named modifiers (e.g. AWQ n_grid for tiny profiles)."""
    recipe = yaml.safe_load(Path(path).read_text())
    if not overrides:
        return recipe
    recipe = copy.deepcopy(recipe)
    for stage in recipe.values():
        for group in stage.values():
            for name, fields in group.items():
                if name in overrides:
                    fields.update(overrides[name])
    return recipe
