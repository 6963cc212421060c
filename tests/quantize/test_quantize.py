import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from edgeflow.paths import REPO_ROOT
from edgeflow.quantize.run import check_group_sizes, load_dequantized, quantize, recipe_scheme, recipe_schemes, weight_errors
from edgeflow.quantize.recipe import load_recipe

RECIPES = REPO_ROOT / "deployments" / "recipes"


def test_shipped_recipes_parse_and_name_their_scheme():
    awq = recipe_scheme(load_recipe(RECIPES / "awq-w4a16-asym.yaml"))
    gptq = recipe_scheme(load_recipe(RECIPES / "gptq-w4a16-sym.yaml"))
    assert awq == {"bits": 4, "group_size": 64, "symmetric": False, "actorder": None}
    assert gptq == {"bits": 4, "group_size": 64, "symmetric": True, "actorder": None}


def quantizes_lm_head(modifier: dict) -> bool:
    """Does this recipe modifier quantize weights (config_groups or a preset scheme) without ignoring lm_head?"""
    return ("config_groups" in modifier or "scheme" in modifier) and "lm_head" not in (modifier.get("ignore") or [])


def test_the_lm_head_check_catches_a_quantizing_modifier_without_ignore():
    gptq = load_recipe(RECIPES / "gptq-w4a16-sym.yaml")["quant_stage"]["quant_modifiers"]["GPTQModifier"]
    assert not quantizes_lm_head(gptq)
    assert quantizes_lm_head({k: v for k, v in gptq.items() if k != "ignore"})
    assert quantizes_lm_head(gptq | {"ignore": ["embed_tokens"]})
    assert quantizes_lm_head({"scheme": "W4A16", "targets": ["Linear"]})
    assert not quantizes_lm_head({"smoothing_strength": 0.8})  # a modifier that quantizes nothing needs no ignore


def test_every_shipped_recipe_is_accepted_by_llm_compressor():
    """Recipes are passed through unchanged, so each must validate against llm-compressor's own modifiers."""
    from llmcompressor.recipe import Recipe

    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert {"awq-w4a16-asym.yaml", "gptq-w4a16-sym.yaml", "gptq-w4a16-sym-actorder.yaml", "gptq-w8a16-sym.yaml",
            "mixed-w8attn-w4mlp.yaml", "rtn-w4a16-asym.yaml"} <= set(names)
    for name in names:
        recipe = load_recipe(RECIPES / name)
        assert Recipe.from_dict(recipe).modifiers, name
        for mod in recipe["quant_stage"]["quant_modifiers"].values():
            assert not quantizes_lm_head(mod), f"{name} quantizes lm_head (a quantizing modifier without ignore: [lm_head])"
    mixed = {tuple(s["targets"]): s["bits"] for s in recipe_schemes(load_recipe(RECIPES / "mixed-w8attn-w4mlp.yaml"))}
    assert mixed == {("re:.*self_attn\\.(q|k|v|o)_proj$",): 8, ("re:.*mlp\\.(gate|up|down)_proj$",): 4}
    assert recipe_scheme(load_recipe(RECIPES / "gptq-w4a16-sym-actorder.yaml"))["actorder"] == "weight"


def test_mixed_recipe_keeps_attention_at_8_bits_and_mlp_at_4(tiny_llama, tmp_path):
    ids = [[(7 * i + j) % 500 + 1 for j in range(32)] for i in range(4)]
    info = quantize(tiny_llama, load_recipe(RECIPES / "mixed-w8attn-w4mlp.yaml"), ids, tmp_path / "mixed")
    err = info["weight_error"]
    attn = [v for k, v in err.items() if "self_attn" in k]
    mlp = [v for k, v in err.items() if ".mlp." in k]
    assert len(attn) == 8 and len(mlp) == 6, sorted(err)  # 2 layers x (q, k, v, o) and x (gate, up, down)
    assert max(attn) < min(mlp) / 4, (attn, mlp)  # 8-bit error is ~16x smaller than 4-bit
    # weight_errors agrees with an independent reload of the saved checkpoint
    again = weight_errors(AutoModelForCausalLM.from_pretrained(tiny_llama), load_dequantized(tmp_path / "mixed"))
    assert again == pytest.approx(err)


def test_the_checkpoint_records_its_recipe_whichever_thread_quantizes(tiny_llama, tmp_path):
    """recipe.yaml next to the weights names the modifier that ran (the TensorRT-LLM and Edge-LLM plans read the
    algorithm from it), in the thread that imported llm-compressor and in another (a mapped task's)."""
    import concurrent.futures

    import llmcompressor  # noqa: F401  imported in this thread before the run in another

    from edgeflow.engines.checkpoint import recipe_algorithm

    ids = [[(7 * i + j) % 500 + 1 for j in range(32)] for i in range(4)]
    quantize(tiny_llama, load_recipe(RECIPES / "rtn-w4a16-asym.yaml"), ids, tmp_path / "here")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(quantize, tiny_llama, load_recipe(RECIPES / "gptq-w4a16-sym.yaml"), ids, tmp_path / "there").result()
    assert recipe_algorithm(tmp_path / "here") == "rtn"
    assert recipe_algorithm(tmp_path / "there") == "gptq"
    assert "QuantizationModifier" in (tmp_path / "here" / "recipe.yaml").read_text()


def test_overrides_patch_only_the_named_modifier():
    r = load_recipe(RECIPES / "awq-w4a16-asym.yaml", {"AWQModifier": {"n_grid": 3}})
    mods = r["quant_stage"]["quant_modifiers"]
    assert mods["AWQModifier"]["n_grid"] == 3
    assert load_recipe(RECIPES / "awq-w4a16-asym.yaml")["quant_stage"]["quant_modifiers"]["AWQModifier"]["n_grid"] == 20


def test_group_size_128_on_smollm2_fails_naming_layer_width_and_valid_sizes(teacher_dir):
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    recipe = load_recipe(RECIPES / "gptq-w4a16-sym.yaml")
    recipe["quant_stage"]["quant_modifiers"]["GPTQModifier"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    with pytest.raises(ValueError) as e:
        check_group_sizes(model, recipe)
    msg = str(e.value)
    assert "group_size=128" in msg and "model.layers.0.self_attn.q_proj" in msg and "input width 576" in msg
    assert "[16, 32, 64]" in msg
    check_group_sizes(model, load_recipe(RECIPES / "gptq-w4a16-sym.yaml"))  # 64 divides every width


def test_awq_runs_on_a_cpu_only_torch(tiny_llama, tmp_path):
    """Fails if the pin_memory workaround in edgeflow/quantize/run.py is removed (CPU torch cannot pin)."""
    assert not torch.cuda.is_available()
    recipe = load_recipe(RECIPES / "awq-w4a16-asym.yaml", {"AWQModifier": {"n_grid": 3}})
    ids = [[(7 * i + j) % 500 + 1 for j in range(32)] for i in range(4)]
    info = quantize(tiny_llama, recipe, ids, tmp_path / "awq")
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"]) == (4, 64, False)
    assert info["scheme"]["bits"] == 4
    # the compressed checkpoint reloads and runs
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "awq")
    assert model(input_ids=torch.tensor([ids[0]])).logits.shape == (1, 32, 512)
    assert (tmp_path / "awq" / "edgeflow-manifest.json").exists()
