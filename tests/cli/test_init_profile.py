"""`edgeflow init MODEL`: a commented profile that loads, with choices that fit the model, or a refusal naming why."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgeflow.paths import REPO_ROOT
from edgeflow.preflight import load_profile
from edgeflow.cli.init_profile import InitRefused, write

EDGEFLOW = Path(sys.executable).parent / "edgeflow"


def test_init_on_the_converted_smollm2_teacher_writes_a_profile_that_loads(teacher_dir, tmp_path):
    out = tmp_path / "smol.yaml"
    r = subprocess.run([str(EDGEFLOW), "init", str(teacher_dir), "--out", str(out), "--hosts", "a100,orin,cpu"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    p = load_profile(out)
    text = out.read_text()
    assert p.teacher.source == "local" and Path(p.teacher.path) == Path(teacher_dir).resolve()
    assert "Llama (llama), 30 layers, hidden 576" in text and "about 135 M parameters" in text
    assert p.distill.keep_every_k == 2 and "Every other layer (15 of 30)" in text
    assert "Worth knowing" not in text  # 15 of 30 layers: 40 % smaller
    assert "Group size 64" in text and all("deployments/recipes/" in v.recipe for v in p.quantize.variants)  # 576: not 128
    assert p.engine.backend == "tensorrt_llm"  # an orin pool: the Jetson engine that runs Llama
    assert p.engine.profile == {"build_profile": "orin-agx"}  # at the Jetson branch's build profile, not the A100's
    assert p.placement.where("distill") == "a100" and p.placement.where("build_engine") == "orin"
    assert p.placement.where("register") == "cpu"
    assert p.calibration.ratios == {"chat": 5, "wiki": 3, "math": 2}
    assert sum(line.lstrip().startswith("#") for line in text.splitlines()) >= 10  # every choice explained

    # `edgeflow plan` takes it: every stage planned, distill keyed on the local teacher (no servers here: exit 1, named)
    from tests.helpers.ports import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run([str(EDGEFLOW), "plan", str(out), "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                       env=os.environ | {"PREFECT_API_URL": f"{dead}/api", "MLFLOW_TRACKING_URI": dead,
                                         "PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results")})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert [s["where"] for s in plan["stages"]] == ["a100", "cpu", "a100", "orin", "a100", "orin", "cpu"]
    [distill] = plan["stages"][0]["calls"]
    assert distill["status"] == "compute" and distill["key"].startswith("train_student-v2-")
    assert plan["advice"] == []


def _tiny_qwen(root: Path, hidden: int, intermediate: int, model_type: str = "qwen2", vocab: int = 512) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": ["Qwen2ForCausalLM"] if model_type == "qwen2" else ["X"],
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 5, "num_attention_heads": 3,
        "num_key_value_heads": 1, "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu"}))
    return root


def test_widths_that_64_does_not_divide_get_recipes_with_a_group_size_that_does(tmp_path):
    model = _tiny_qwen(tmp_path / "qwen", hidden=96, intermediate=224)  # 96 = 3 x 32: 64 divides neither
    out = write(str(model), tmp_path / "profiles" / "q.yaml", hosts=[])
    p = load_profile(out)
    for v in p.quantize.variants:
        recipe = yaml.safe_load(Path(v.recipe).read_text())
        sizes = {g["weights"]["group_size"] for m in recipe.values() for mod in m.values() for spec in mod.values()
                 for g in (spec.get("config_groups") or {}).values()}
        assert sizes == {32}, (v.recipe, sizes)
        assert Path(v.recipe).parent == out.parent
    assert p.engine.backend == "cpu_native" and p.placement.pooled() == {}  # no pools named: everything inline
    assert "Qwen2 (qwen2)" in out.read_text()


def test_a_model_whose_embedding_no_cut_removes_gets_a_profile_that_says_so_and_the_plan_too(tmp_path):
    model = _tiny_qwen(tmp_path / "qwen", hidden=96, intermediate=224, vocab=65536)  # the embedding: 6.3 of 6.7 M
    out = write(str(model), tmp_path / "profiles" / "q.yaml", hosts=[])
    text = " ".join(line.strip().lstrip("# ") for line in out.read_text().splitlines())
    assert "Worth knowing: the student keeps 3 of the teacher's 5 layers: about 6.6 M of its 6.7 M parameters, 3% smaller" in text
    assert "65,536 x 96 embedding (tied with the head) is 93% of the model" in text and "vocabulary" in text

    from edgeflow.pipeline.plan import student_advice  # `edgeflow plan` says the same, from the teacher on its host

    [advice] = student_advice(load_profile(out))
    assert advice.startswith("the student keeps 3 of the teacher's 5 layers: about 6.6 M of its 6.7 M parameters")


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "m.gguf", "a GGUF file"),
    (lambda d: d, "no config.json there"),
    (lambda d: _tiny_qwen(d / "gpt", 64, 128, model_type="gpt2"), "model_type='gpt2' is not a supported family"),
    (lambda d: "nobody/nothing-cached", "not in the offline hub cache"),
])
def test_a_model_it_cannot_handle_is_refused_naming_why(tmp_path, make, message):
    with pytest.raises(InitRefused, match=message):
        write(str(make(tmp_path)), tmp_path / "out.yaml")
    assert not (tmp_path / "out.yaml").exists()


def test_bad_arguments_are_exit_2(tmp_path, teacher_dir):
    out = tmp_path / "p.yaml"
    out.write_text("keep me")
    r = subprocess.run([str(EDGEFLOW), "init", str(teacher_dir), "--out", str(out)], capture_output=True, text=True,
                       cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr and out.read_text() == "keep me"
    r = subprocess.run([str(EDGEFLOW), "init", str(teacher_dir), "--out", str(tmp_path / "q.yaml"), "--hosts", "tpu"],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 2 and "['tpu'] are not pools" in r.stderr


@pytest.mark.parametrize("family, backend, profile, says", [
    ("gemma2", "llama_cpp", {}, ["llama_cpp, built with CUDA there", "tensorrt_llm (orin-agx) refuses it",
                                 "converts from TensorRT-LLM 0.13.0", "TensorRT Edge-LLM supports no Gemma 2"]),
    ("qwen3", "edge_llm", {"build_profile": "orin-jp7"}, ["edge_llm with build profile orin-jp7 runs Qwen3"]),
    ("qwen2", "tensorrt_llm", {"build_profile": "orin-agx"}, ["tensorrt_llm with build profile orin-agx runs Qwen2"]),
])
def test_an_orin_host_gets_the_engine_that_runs_the_family_there_and_why(tmp_path, family, backend, profile, says):
    """Gemma 2, the 9B users put on an AGX Orin: TensorRT-LLM's Jetson branch (0.12) lacks it and Edge-LLM has none,
    so init picks llama.cpp built with CUDA on the device and names both refusals; a family the Jetson branch does
    not convert but Edge-LLM does (Qwen3) gets Edge-LLM; one it converts gets it, at the Orin's build profile."""
    from edgeflow.model.tiny import build_tiny

    model = build_tiny(family, tmp_path / family, hidden_size=128, intermediate_size=256, head_dim=32)
    out = write(str(model), tmp_path / f"{family}.yaml", hosts=["a100", "orin", "cpu"])
    p = load_profile(out)
    assert (p.engine.backend, p.engine.profile) == (backend, profile)
    text = " ".join(line.strip().lstrip("# ") for line in out.read_text().splitlines())
    for phrase in says:
        assert phrase in text, (phrase, text[text.index("engine:"):][:800])

