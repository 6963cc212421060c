"""`edgeflow plan` (edgeflow/pipeline/plan.py) without servers: what changed, named; a profile that does not load is exit 2; and
servers that do not answer are named (exit 1). The plan against a real release is in tests/pipeline/test_release_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeflow.pipeline.plan import differences

REPO = Path(__file__).resolve().parents[2]


def test_differences_name_a_changed_profile_file_by_its_path_and_a_changed_setting_by_its_values() -> None:
    before = {"cfg": {"steps": 60, "lr": 0.0005}, "held_out": {"chat": {"kind": "input", "sha256": "a" * 64}},
              "teacher": {"kind": "teacher", "sha256": "t" * 64}}
    now = {"cfg": {"steps": 80, "lr": 0.0005}, "held_out": {"chat": {"kind": "input", "sha256": "b" * 64}},
           "teacher": {"kind": "teacher", "sha256": "t" * 64}}
    lines = differences(before, now, {"b" * 64: "data/eval/chat.jsonl"})
    assert lines == ["cfg.steps: 60 → 80",
                     f"held_out.chat: data/eval/chat.jsonl (the profile's file) changed (sha256 {'a' * 12} → {'b' * 12})"]
    assert differences(now, now, {}) == []
    assert differences({}, {"student": {"kind": "student", "sha256": "c" * 64}}, {}) == [
        f"student: its student changed (absent → {'c' * 12})"]


def _plan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeflow.cli", "plan", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=os.environ | env)


def test_a_profile_that_does_not_load_is_exit_2_naming_the_field(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "test-tiny.yaml").read_text().replace("distill:", "distill:\n  stepz: 3", 1))
    out = _plan(str(bad))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "stepz" in out.stderr and "Traceback" not in out.stderr


def test_servers_that_do_not_answer_are_named_and_the_plan_still_keys_what_it_can(tmp_path) -> None:
    from tests.helpers.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    out = _plan("configs/test-tiny.yaml", "--json", PREFECT_API_URL=f"{dead}/api", MLFLOW_TRACKING_URI=dead,
                PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / "results"))
    assert out.returncode == 1, out.stdout + out.stderr
    plan = json.loads(out.stdout)
    assert plan["services"]["prefect"].startswith(f"PREFECT_API_URL={dead}/api does not answer")
    assert plan["services"]["mlflow"].startswith(f"MLFLOW_TRACKING_URI={dead} does not answer")
    assert [s["stage"] for s in plan["stages"]] == ["distill", "calibrate", "quantize", "build_engine", "gate_reference",
                                                     "consistency", "register"]
    [distill] = plan["stages"][0]["calls"]
    if distill["status"] != "unknown":  # the teacher is on this host (tests/conftest.py converts it): keyed, not cached
        assert distill["status"] == "compute" and distill["key"].startswith("train_student-v2-")
        assert distill["why"] == ["MLflow does not answer: what changed is unknown"]
    assert {c["status"] for s in plan["stages"][1:] for c in s["calls"]} == {"after distill"}


def _slo_profile(tmp_path, slo: dict):
    """test-tiny with a local teacher whose config.json is SmolLM2-135M's (no weights: the estimate reads the config
    only), and `slo`."""
    from edgeflow.preflight import load_profile
    from tests.helpers.model_configs import SMOLLM2_135M

    teacher = tmp_path / "teacher"
    teacher.mkdir(parents=True)
    (teacher / "config.json").write_text(json.dumps(SMOLLM2_135M))
    profile = load_profile("configs/test-tiny.yaml")
    return profile.model_validate(profile.settings() | {"teacher": {"source": "local", "path": str(teacher)}, "slo": slo})


def test_the_plan_estimates_each_variant_on_each_slo_target_and_names_what_it_cannot_meet(tmp_path) -> None:
    from edgeflow.pipeline.plan import Plan, render, slo_plan

    profile = _slo_profile(tmp_path, {"targets": [
        {"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 2, "decode_tok_s": 1000,
         "ttft_p99_ms": 500}]})
    plan = Plan(profile="p", model="m", services={})
    slo_plan(plan, profile, teacher_here=True)
    [target] = plan.estimates
    assert target["student"] == "3 layers"  # keep_every_k 15 of 30
    assert target["runtime"]["name"] == "tensorrt_llm"  # the target's runtime, not the release's cpu_native
    rows = {r["variant"]: r for r in target["variants"]}
    assert list(rows) == ["fp16", "awq-w4a16", "gptq-w4a16"]  # a GPU runtime's reference row is fp16
    # the fp16 3-layer student reads its 21.2 MB of layers (3 x 3,538,944 weights) and the 56.6 MB fp16 head
    # (49,152 x 576) every step, plus the two sessions' KV caches (2.9 MB): at 68 GB/s about 840 tok/s at the roofline,
    # which is TensorRT-LLM's estimate too (no fitted decode factor)
    assert rows["fp16"]["misses"] and rows["fp16"]["misses"][0].startswith("decode 8")
    assert rows["fp16"]["estimate"]["decode_roofline_tok_s"] == pytest.approx(68e9 / (21.2e6 + 56.6e6 + 2.9e6), rel=0.02)
    # the int4 ones read 5.3 MB of layers with their scales and the same fp16 head: about 1,040 tok/s
    assert rows["gptq-w4a16"]["misses"] == [] and rows["awq-w4a16"]["misses"] == []
    assert plan.problems == []  # some variant can meet it
    text = "\n".join(render(plan).splitlines())
    assert "orin-nano-8gb: TTFT p99 <= 500 ms, decode >= 1000 tok/s at 512 prompt tokens, concurrency 2" in text
    assert "runtime tensorrt_llm" in text
    assert "gptq-w4a16" in text and "cannot meet (estimate): decode" in text


def test_a_slo_no_variant_can_meet_is_a_problem_unless_built_anyway(tmp_path) -> None:
    from edgeflow.pipeline.plan import Plan, slo_plan

    slo = {"targets": [{"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 1, "decode_tok_s": 100_000}]}
    plan = Plan(profile="p", model="m", services={})
    slo_plan(plan, _slo_profile(tmp_path / "a", slo), teacher_here=True)
    [problem] = plan.problems
    assert problem.startswith("slo: no variant can meet the objectives on orin-nano-8gb, whatever the engine (awq-w4a16: decode ")
    assert "set slo.build_anyway" in problem
    anyway = Plan(profile="p", model="m", services={})
    slo_plan(anyway, _slo_profile(tmp_path / "b", slo | {"build_anyway": True}), teacher_here=True)
    assert anyway.problems == [] and anyway.estimates[0]["variants"]
    away = Plan(profile="p", model="m", services={})
    slo_plan(away, _slo_profile(tmp_path / "c", slo), teacher_here=False)
    assert away.estimates[0]["not_estimated"].startswith("the teacher is not on this host yet")


def test_the_release_refuses_only_the_variants_no_engine_could_serve_and_builds_them_with_build_anyway(tmp_path) -> None:
    """unservable (what a release does not quantize or build) judges at the roofline, not with the runtime's fitted
    efficiency: between the two variants' best decode speeds, only the slower one is refused; the FP student never is."""
    from edgeflow.estimate.variants import slo_estimates, unservable
    from edgeflow.pipeline.plan import teacher_architecture

    probe = _slo_profile(tmp_path / "p", {"targets": [
        {"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 1, "decode_tok_s": 1}]})
    teacher = teacher_architecture(probe)
    best = {r["variant"]: r["estimate"]["decode_roofline_tok_s"] for r in slo_estimates(probe, teacher)[0]["variants"]}
    slow, fast = sorted(["awq-w4a16", "gptq-w4a16"], key=best.get)  # awq keeps a zero point per group: more bytes
    assert best[slow] < best[fast]
    between = (best[slow] + best[fast]) / 2
    slo = {"targets": [{"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 1, "decode_tok_s": between}]}
    profile = _slo_profile(tmp_path / "a", slo)
    refused = unservable(profile, teacher_architecture(profile).model_copy(
        update={"num_hidden_layers": 3, "layer_types": teacher.layer_types[:3]}))
    assert list(refused) == [slow]
    [why] = refused[slow]
    assert why.startswith(f"orin-nano-8gb: decode {best[slow]:.1f} tok/s < {between:g} tok/s per stream")
    assert unservable(_slo_profile(tmp_path / "b", slo | {"build_anyway": True}), teacher) == {}


def test_a_measured_target_is_put_against_the_roofline_of_the_same_workload(tmp_path) -> None:
    from edgeflow.estimate import limits_for
    from edgeflow.estimate.counts import token_cost
    from edgeflow.estimate.roofline import estimate
    from edgeflow.estimate.runtimes import ROOFLINE
    from edgeflow.estimate.variants import roofline_fractions, variant_schemes
    from edgeflow.pipeline.plan import teacher_architecture

    target = {"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 2, "decode_tok_s": 1}
    profile = _slo_profile(tmp_path, {"targets": [target]})
    teacher = teacher_architecture(profile)
    student = teacher.model_copy(update={"num_hidden_layers": 3, "layer_types": teacher.layer_types[:3]})
    # the roofline of the same workload, from the parts the module doc names: the device table's limits, the counts
    best = estimate(token_cost(student, variant_schemes(profile)["gptq-w4a16"]), limits_for("orin-nano-8gb"), ROOFLINE,
                    512, 2, 256)
    objectives = {k: v for k, v in target.items() if k != "device"} | {"max_new_tokens": 256}
    measured = {"device": "orin-nano-8gb", "objectives": objectives,
                "measured": {"decode_tok_s": best.decode_roofline_tok_s / 2, "ttft_p99_ms": 4 * best.ttft_p99_ms}}
    r = roofline_fractions(profile, student, "gptq-w4a16", measured)
    assert r["decode_fraction"] == 0.5 and r["prefill_fraction"] == 0.25 and r["bandwidth_gb_s"] == 68
    assert roofline_fractions(profile, student, "nope", measured) == {"not_estimated": "nope is not a variant of this profile"}


def test_the_release_judges_its_variants_on_the_student_config_the_distill_stage_published(tmp_path) -> None:
    from types import SimpleNamespace

    from edgeflow.estimate.variants import CONFIG_META_KEY
    from edgeflow.pipeline.chain import unservable_variants
    from edgeflow.tracking.artifacts import ArtifactRef
    from tests.helpers.model_configs import SMOLLM2_135M

    slo = {"targets": [{"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 512, "concurrency": 1, "decode_tok_s": 100_000}]}
    profile = _slo_profile(tmp_path, slo)
    ctx = SimpleNamespace(resolved=lambda: profile)
    student = ArtifactRef(kind="student", uri="mlflow-artifacts:/1/r/artifacts/student", sha256="a" * 64,
                          meta={CONFIG_META_KEY: SMOLLM2_135M})
    refused = unservable_variants(ctx, student)
    assert sorted(refused) == ["awq-w4a16", "gptq-w4a16"]
    assert refused["gptq-w4a16"][0].startswith("orin-nano-8gb: decode ")
    # a student published before its config rode along: nothing is refused, the gate still measures what is built
    assert unservable_variants(ctx, student.model_copy(update={"meta": {}})) == {}
