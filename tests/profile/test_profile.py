from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")))
def test_shipped_profiles_validate(name):
    p = load_profile(REPO_ROOT / "configs" / name)
    assert p.quantize.variants and p.name


def _profile(tmp_path: Path, patch) -> Path:
    data = yaml.safe_load((REPO_ROOT / "configs" / "demo-cpu.yaml").read_text())
    patch(data)
    out = tmp_path / "p.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(ValidationError, match="distill.stpes"):
        load_profile(_profile(tmp_path, lambda d: d["distill"].update(stpes=3)))


def test_missing_recipe_file_is_named(tmp_path):
    def patch(d):
        d["quantize"]["variants"][0]["recipe"] = "deployments/recipes/nope.yaml"

    with pytest.raises(ValidationError, match=r"quantize.variants\[0\].recipe=deployments/recipes/nope.yaml"):
        load_profile(_profile(tmp_path, patch))


def test_out_of_range_values_name_the_limit(tmp_path):
    with pytest.raises(ValidationError, match="alpha"):
        load_profile(_profile(tmp_path, lambda d: d["distill"].update(alpha=1.5)))
    with pytest.raises(ValidationError, match="calibration.total=8 is below calibration.min_total=64"):
        load_profile(_profile(tmp_path, lambda d: d["calibration"].update(total=8)))


def test_a_gate_asking_more_prompts_than_the_eval_sources_hold_fails_at_load(tmp_path):
    """The gate spreads num_prompts evenly over the sources; a short source is named with what it holds and the
    largest num_prompts the sources can serve, and that number loads."""
    small = tmp_path / "small-chat.jsonl"
    rows = (REPO_ROOT / "data" / "eval" / "chat.jsonl").read_text().splitlines()[:5]
    small.write_text("\n".join(rows) + "\n")

    def patch(num):
        return lambda d: d["gate"].update(num_prompts=num, eval_sources={
            "chat": str(small), "wiki": "data/eval/wiki.jsonl", "math": "data/eval/math.jsonl"})

    with pytest.raises(ValidationError, match=rf"gate.num_prompts=30 .* chat needs 10 but {small} holds 5 .*at most 15"):
        load_profile(_profile(tmp_path, patch(30)))
    assert load_profile(_profile(tmp_path, patch(15))).gate.num_prompts == 15  # 5 per source
    with pytest.raises(ValidationError, match="at most 15"):
        load_profile(_profile(tmp_path, patch(16)))  # the 16th would go to chat


def test_the_shipped_eval_sets_serve_the_production_gate():
    p = load_profile(REPO_ROOT / "configs" / "production-a100-orin.yaml")
    assert p.gate.num_prompts >= 1000


def test_missing_profile_says_where_profiles_live():
    with pytest.raises(FileNotFoundError, match="configs"):
        load_profile("configs/does-not-exist.yaml")


def test_recalibration_attempts_double_samples_and_change_seed():
    cfg = load_profile(REPO_ROOT / "configs" / "demo-cpu.yaml").calibration
    assert cfg.for_attempt(0) is cfg
    assert (cfg.for_attempt(2).total, cfg.for_attempt(2).seed) == (cfg.total * 4, cfg.seed + 2)
    assert cfg.for_attempt(1).ratios == cfg.ratios


def test_fallback_variant_names_and_recipes_are_checked(tmp_path):
    def two_fallbacks(d):  # the demo profile runs every recipe as a variant and keeps no fallbacks
        d["quantize"]["fallback_variants"] = [{"name": "w8-a", "recipe": "deployments/recipes/gptq-w8a16-sym.yaml"},
                                              {"name": "w8-b", "recipe": "deployments/recipes/gptq-w8a16-sym.yaml"}]

    def clash(d):
        two_fallbacks(d)
        d["quantize"]["fallback_variants"][0]["name"] = d["quantize"]["variants"][0]["name"]

    with pytest.raises(ValidationError, match="names must be unique"):
        load_profile(_profile(tmp_path, clash))

    def missing(d):
        two_fallbacks(d)
        d["quantize"]["fallback_variants"][1]["recipe"] = "deployments/recipes/w3.yaml"

    with pytest.raises(ValidationError, match=r"quantize.fallback_variants\[1\].recipe=deployments/recipes/w3.yaml"):
        load_profile(_profile(tmp_path, missing))


def test_placement_does_not_change_a_stage_cache_key():
    from types import SimpleNamespace

    from edgeflow.tracking.runs import content_key

    ctx = SimpleNamespace(task=SimpleNamespace(name="quantize_variant"))
    assert content_key(ctx, {"recipe": {"a": 1}, "slot": 0}) == content_key(ctx, {"recipe": {"a": 1}, "slot": 3})
    assert content_key(ctx, {"recipe": {"a": 1}, "slot": 0}) != content_key(ctx, {"recipe": {"a": 2}, "slot": 0})


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")))
def test_a_release_s_resolved_profile_is_the_same_profile_on_another_host(name, monkeypatch):
    """ReleaseContext.settings validated again where the profile's files do not exist gives the same profile: the
    profile's models read no disk. The preflight, which does, refuses it there, naming the files."""
    import edgeflow.profile.profile as schema
    from edgeflow.preflight import preflight
    from edgeflow.profile import Profile

    p = load_profile(REPO_ROOT / "configs" / name)
    monkeypatch.setattr(schema, "REPO_ROOT", Path("/nonexistent-checkout"))
    again = Profile.model_validate(p.settings())
    assert again == p
    with pytest.raises(ValidationError, match="files named by the profile do not exist"):
        preflight(again)


def test_placement_names_every_stage_and_refuses_what_is_not_a_pool(tmp_path):
    from edgeflow.profile import STAGES

    p = load_profile(REPO_ROOT / "configs" / "production-a100-orin.yaml")
    assert set(p.placement.pooled()) == set(STAGES)  # production places every stage on a pool
    assert p.placement.where("build_engine") == p.placement.where("consistency") == "orin"  # the gate runs where the engine runs
    assert load_profile(REPO_ROOT / "configs" / "demo-cpu.yaml").placement.pooled() == {}
    with pytest.raises(ValidationError, match="placement.distill='a100 pool' is not `inline` or a work-pool name"):
        load_profile(_profile(tmp_path, lambda d: d.update(placement={"distill": "a100 pool"})))
    with pytest.raises(ValidationError, match="placement.gate_refrence"):
        load_profile(_profile(tmp_path, lambda d: d.update(placement={"gate_refrence": "a100"})))


def test_cache_keys_hold_what_a_stage_reads_not_where_its_files_lie():
    from types import SimpleNamespace

    from edgeflow.tracking.artifacts import ArtifactRef
    from edgeflow.profile import DistillConfig, GateConfig, VariantConfig
    from edgeflow.tracking.runs import content_key

    ctx = SimpleNamespace(task=SimpleNamespace(name="quantize_variant"))
    ref = ArtifactRef(kind="input", uri="mlflow-artifacts:/1/r/artifacts/inputs/x/chat.jsonl", sha256="a" * 64)

    def key(**params):
        return content_key(ctx, params)

    here, there = VariantConfig(name="gptq", recipe="deployments/recipes/a.yaml"), VariantConfig(name="gptq", recipe="/tmp/a.yaml")
    assert key(variant=here, recipe={"a": 1}) == key(variant=there, recipe={"a": 1})
    assert key(variant=here, recipe={"a": 1}) != key(variant=here, recipe={"a": 2})  # the recipe's content is
    assert key(cfg=DistillConfig(corpora=["x.jsonl"]), corpora=[ref]) == key(cfg=DistillConfig(corpora=["/y/x.jsonl"]), corpora=[ref])
    edited = ref.model_copy(update={"sha256": "b" * 64})  # the same file, edited in place
    assert key(cfg=DistillConfig(), corpora=[ref]) != key(cfg=DistillConfig(), corpora=[edited])
    assert key(gate=GateConfig(eval_sources={"chat": "a.jsonl"})) == key(gate=GateConfig(eval_sources={"chat": "b.jsonl"}))
    assert key(gate=GateConfig(max_mean_kl=0.1)) != key(gate=GateConfig(max_mean_kl=0.2))


def test_a_variant_is_a_recipe_or_a_checkpoint_quantized_elsewhere(tmp_path):
    """quantize.variants[].prequantized: a directory the release publishes like any input file; one of recipe and
    prequantized, never both or neither."""
    ckpt = tmp_path / "Qwen2.5-0.5B-Instruct-AWQ"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    p = load_profile(_profile(tmp_path, lambda d: d["quantize"]["variants"].append(
        {"name": "official-awq", "prequantized": str(ckpt)})))
    assert p.input_files()[f"quantize.variants[{len(p.quantize.variants) - 1}].prequantized"] == str(ckpt)
    with pytest.raises(ValidationError, match=r"variant 'both': give exactly one of recipe .* and prequantized"):
        load_profile(_profile(tmp_path, lambda d: d["quantize"]["variants"].append(
            {"name": "both", "prequantized": str(ckpt), "recipe": "deployments/recipes/awq-w4a16-asym.yaml"})))
    with pytest.raises(ValidationError, match=r"variant 'neither': give exactly one of recipe"):
        load_profile(_profile(tmp_path, lambda d: d["quantize"]["variants"].append({"name": "neither"})))
    with pytest.raises(ValidationError, match=r"files named by the profile do not exist .*prequantized=/nowhere"):
        load_profile(_profile(tmp_path, lambda d: d["quantize"]["variants"].append(
            {"name": "gone", "prequantized": "/nowhere"})))


@pytest.mark.parametrize("edit, names", [
    (("receiver: edgeflow-ticket", "receiver: edgeflow-tickets"), ("route receiver 'edgeflow-tickets'", "add a receiver")),
    (("  group_wait: 30s", "  group_wait: 30s\n x: ["), ("does not parse as YAML", "correct the YAML")),
], ids=["undefined-receiver", "broken-yaml"])
def test_an_alertmanager_config_that_routes_nowhere_fails_the_profile_load_with_file_line_and_fix(tmp_path, edit, names):
    am = tmp_path / "alertmanager.yml"
    text = (REPO_ROOT / "infra" / "alertmanager" / "alertmanager.yml").read_text().replace(*edit, 1)
    am.write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if edit[1].splitlines()[-1] in t)
    data = yaml.safe_load((REPO_ROOT / "configs" / "test-tiny.yaml").read_text()) | {"monitoring": {"alertmanager_config": str(am)}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValidationError) as e:
        load_profile(path)
    msg = str(e.value)
    assert f"{am}:" in msg and all(n in msg for n in names), msg
    assert f"{am}:{line}:" in msg or f"{am}:{line + 1}:" in msg, msg  # the edited line (YAML's parser: where it noticed)
