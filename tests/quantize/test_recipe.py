"""edgeflow/quantize/recipe.py: what a recipe file says its weights are, read without torch."""
from __future__ import annotations

import pytest

from edgeflow.paths import REPO_ROOT


def test_a_recipes_weight_scheme_is_read_and_a_mixed_one_is_named_not_guessed():
    from edgeflow.quantize.recipe import load_recipe, weight_spec

    assert weight_spec(load_recipe(REPO_ROOT / "deployments/recipes/gptq-w4a16-sym.yaml")) == (4, 64, True)
    assert weight_spec(load_recipe(REPO_ROOT / "deployments/recipes/awq-w4a16-asym.yaml")) == (4, 64, False)
    assert weight_spec(load_recipe(REPO_ROOT / "deployments/recipes/gptq-w8a16-sym.yaml"))[0] == 8
    with pytest.raises(ValueError, match="quantize differently .* a mixed scheme"):
        weight_spec(load_recipe(REPO_ROOT / "deployments/recipes/mixed-w8attn-w4mlp.yaml"))
