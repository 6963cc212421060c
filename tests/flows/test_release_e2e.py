"""The whole release on the tiny profile, against a real Prefect server, workers and MLflow server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def services(tmp_path_factory, teacher_dir):
    """Real Prefect server + process workers for a100/orin/cpu + MLflow server, on test ports."""
    home = REPO / ".edgeflow" / "test-services"
    env = {
        "EDGEFLOW_HOME": str(home),
        "EDGEFLOW_PREFECT_PORT": os.environ.get("EDGEFLOW_TEST_PREFECT_PORT", "4310"),
        "EDGEFLOW_MLFLOW_PORT": os.environ.get("EDGEFLOW_TEST_MLFLOW_PORT", "5065"),
    }
    # a fresh store per session: assertions count versions and aliases
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | env, check=False)
    subprocess.run(["rm", "-rf", str(home)], check=True)
    subprocess.run([sys.executable, "scripts/services.py", "up"], cwd=REPO, env=os.environ | env, check=True)
    sys.path.insert(0, str(REPO / "scripts"))
    from services import service_env

    svc = service_env({"home": str(home), "prefect_port": env["EDGEFLOW_PREFECT_PORT"], "mlflow_port": env["EDGEFLOW_MLFLOW_PORT"], "pools": ""})
    saved = {k: os.environ.get(k) for k in svc}
    os.environ.update(svc)
    yield svc
    from tasks.config import load_profile
    from tasks.deploy import stop_server

    stop_server(load_profile(REPO / "configs" / "test-tiny.yaml"))
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | env, check=False)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_release_deployment_registers_stages_and_serves(services):
    from mlflow import MlflowClient
    from openai import OpenAI
    from prefect.deployments import run_deployment

    from tasks.config import load_profile

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    fr = run_deployment("release/release", parameters={"profile": "configs/test-tiny.yaml", "deploy": "pool"}, timeout=1800)
    assert fr.state.is_completed(), f"release ended {fr.state.type}: {fr.state.message}"
    report = fr.state.result()

    # the report: one row per variant with the agreed fields, saved as JSON and markdown
    names = [v["name"] for v in report["variants"]]
    assert names == ["fp32", "awq-w4a16", "gptq-w4a16"]
    for row in report["variants"]:
        assert set(("name", "size_mb", "decode_tok_s", "ttft_ms", "top1_agreement", "kl", "ppl", "passed")) <= set(row)
        assert 0 <= row["top1_agreement"] <= 1 and row["kl"] >= 0 and row["ppl"] > 1 and row["decode_tok_s"] > 0
        assert row["engine_parity"] >= profile.gate.min_engine_parity, row
    fp32 = report["variants"][0]
    assert fp32["top1_agreement"] > 0.99 and fp32["kl"] < 1e-3  # the dense engine reproduces the HF student
    assert fp32["greedy_exact"] >= 0.8 and all(0 <= r["greedy_exact"] <= 1 for r in report["variants"])  # greedy continuations
    assert [r["engine_precision"] for r in report["variants"]] == ["fp32", "int4", "int4"]
    # plots: three PNGs next to the report, linked from the markdown
    md = (REPO / "reports" / f"{report['release_id']}.md").read_text()
    assert set(report["plots"]) == {"layer_error", "agreement_histogram", "kl_distribution"}
    for rel in report["plots"].values():
        assert (REPO / "reports" / rel).read_bytes()[:4] == b"\x89PNG" and f"]({rel})" in md
    saved = json.loads((REPO / "reports" / f"{report['release_id']}.json").read_text())
    assert saved["release_id"] == report["release_id"] and saved["staging"] == report["staging"]
    assert (REPO / "reports" / f"{report['release_id']}.md").exists()
    assert report["staging"] in ("awq-w4a16", "gptq-w4a16")
    assert report["smoke_answer"].strip()

    # MLflow: a parent run with a child run per stage, versions with lineage tags, staging alias
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    parent = c.get_run(report["mlflow_parent_run_id"])
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    stages = {r.data.tags["edgeflow.stage"] for r in children}
    assert {"distill", "calibrate", "quantize-awq-w4a16", "quantize-gptq-w4a16", "build-engine-fp32", "consistency", "register"} <= stages
    versions = c.search_model_versions(f"name = '{profile.registry.model_name}'")
    passed = {r["name"] for r in report["variants"] if r["passed"] and r["name"] != "fp32"}
    assert {v.tags["edgeflow.variant"] for v in versions} == passed
    staging = c.get_model_version_by_alias(profile.registry.model_name, "staging")
    assert staging.tags["edgeflow.variant"] == report["staging"]
    for key in ("edgeflow.teacher_sha256", "edgeflow.student_run_id", "edgeflow.calibration_sha256", "edgeflow.recipe"):
        assert staging.tags[key], key
    assert [a.path for a in c.list_artifacts(parent.info.run_id, "report")]

    # the deployed server answers a streamed chat, read with the official client
    client = OpenAI(base_url=f"http://127.0.0.1:{profile.deploy.port}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=profile.registry.model_name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, stream=True
    )
    text = "".join((chunk.choices[0].delta.content or "") for chunk in stream if chunk.choices)
    assert text  # a 3-step student may answer in whitespace; the stream must still carry content


def test_gate_nobody_can_pass_keeps_aliases_recalibrates_and_reports(services, tmp_path):
    import yaml
    from mlflow import MlflowClient
    from prefect.deployments import run_deployment

    from tasks.config import load_profile

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["gate"].update(min_top1_agreement=1.0, max_mean_kl=0.0, recalibration_attempts=1)  # no int4 model can be exact
    path = tmp_path / "impossible.yaml"
    path.write_text(yaml.safe_dump(data))
    profile = load_profile(path)
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    name = profile.registry.model_name
    before = {a: c.get_model_version_by_alias(name, a).version for a in ("staging",)}
    versions_before = len(c.search_model_versions(f"name = '{name}'"))

    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_failed() and "no variant met the bar after 2 attempt(s)" in fr.state.message

    assert {a: c.get_model_version_by_alias(name, a).version for a in ("staging",)} == before
    assert len(c.search_model_versions(f"name = '{name}'")) == versions_before
    report_path = sorted((REPO / "reports").glob("test-tiny-*.json"), key=lambda p: p.stat().st_mtime)[-1]
    report = json.loads(report_path.read_text())
    assert report["staging"] is None and "no variant met the bar" in report["why_no_staging"]
    assert [a["attempt"] for a in report["attempts"]] == [0, 1]
    assert report["attempts"][1]["calibration_samples"] == 2 * report["attempts"][0]["calibration_samples"]
    parent = c.get_run(report["mlflow_parent_run_id"])
    stages = {r.data.tags["edgeflow.stage"] for r in c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert {"calibrate-attempt1", "quantize-awq-w4a16-attempt1", "consistency-attempt1"} <= stages
    # attempt 1 also tried the first, less aggressive fallback variant (built dequantized on the CPU engine)
    assert "quantize-mixed-w8attn-w4mlp-attempt1" in stages and "quantize-mixed-w8attn-w4mlp" not in stages
    rows = {r["name"]: r for r in report["variants"]}
    assert rows["mixed-w8attn-w4mlp"]["engine_precision"] == "fp32 (dequantized)" and not rows["mixed-w8attn-w4mlp"]["passed"]


def test_calibration_overlapping_the_eval_set_fails_before_quantization(services, tmp_path):
    """Point the gate's chat eval set at the chat calibration source: the calibrate stage fails naming examples."""
    import yaml
    from mlflow import MlflowClient
    from prefect.deployments import run_deployment

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data.setdefault("gate", {})["eval_sources"] = {"chat": "data/corpora/chat.jsonl", "math": "data/eval/math.jsonl"}
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(data))

    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_failed()
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    exp = c.get_experiment_by_name("edgeflow-release")
    parent = c.search_runs([exp.experiment_id], f"tags.`edgeflow.prefect_flow_run_id` = '{fr.id}'")[0]
    children = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    stages = {r.data.tags["edgeflow.stage"]: r for r in children}
    assert stages["calibrate"].info.status == "FAILED"
    assert not any(s.startswith("quantize") for s in stages), "quantization must not start on a leaky calibration set"
    # the failure names the overlapping examples (the exception travels up as the release's state message)
    assert "overlap the calibration set" in fr.state.message and "eval[" in fr.state.message, fr.state.message
