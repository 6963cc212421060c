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
