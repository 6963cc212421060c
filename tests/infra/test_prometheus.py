"""Prometheus config, alert rules (promtool) and a real scrape + deep probe of a live edge server."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from edgeflow.paths import REPO_ROOT
from tests.helpers.live_server import LiveServer
from tests.helpers.ports import free_port

PROM = REPO_ROOT / "infra" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (.ci/run installs Debian's prometheus)")


@needs_promtool
def test_rules_are_valid_and_their_unit_tests_pass():
    check = subprocess.run([PROMTOOL, "check", "rules", "alerts.yml"], cwd=PROM, capture_output=True, text=True)
    assert check.returncode == 0 and "8 rules found" in check.stdout, check.stdout + check.stderr
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], cwd=PROM, capture_output=True, text=True)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    config = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=PROM, capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_a_broken_rule_is_caught(tmp_path):
    """The rule unit tests really constrain the rules: weakening the hang alert makes them fail."""
    rules = (PROM / "alerts.yml").read_text().replace("unless", "and")
    (tmp_path / "alerts.yml").write_text(rules)
    shutil.copy(PROM / "alerts.test.yml", tmp_path)
    unit = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert unit.returncode != 0 and "EdgeflowNoCompletedRequests" in unit.stdout + unit.stderr


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    return r.json()["data"]["result"]


KEY = "monitoring-key-0123456789abcdef"
CREDENTIALS = "/etc/edgeflow/monitoring-key"


def _without_auth(cfg: dict) -> dict:
    for job in cfg.get("scrape_configs", []):
        job.pop("authorization", None)
        if "params" in job:
            job["params"]["module"] = [m.removesuffix("_auth") for m in job["params"]["module"]]
    return cfg


def test_auth_configs_differ_from_the_plain_ones_only_in_the_credentials():
    plain = yaml.safe_load((PROM / "prometheus.yml").read_text())
    auth = yaml.safe_load((PROM / "prometheus-auth.yml").read_text())
    assert all(j["authorization"]["credentials_file"] == CREDENTIALS for j in auth["scrape_configs"] if j["job_name"] == "edgeflow-edge")
    assert _without_auth(auth) == plain
    modules = yaml.safe_load((PROM / "blackbox.yml").read_text())["modules"]
    keyed = modules["edgeflow_health_auth"]
    assert keyed["http"].pop("authorization")["credentials_file"] == CREDENTIALS
    assert keyed == modules["edgeflow_health"]


@needs_promtool
def test_auth_config_is_valid_with_its_credentials_file(tmp_path):
    key = tmp_path / "monitoring-key"
    key.write_text(KEY)
    (tmp_path / "prometheus.yml").write_text((PROM / "prometheus-auth.yml").read_text().replace(CREDENTIALS, str(key)))
    shutil.copy(PROM / "alerts.yml", tmp_path)
    config = subprocess.run([PROMTOOL, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr


@pytest.mark.skipif(not (shutil.which("prometheus") and shutil.which("prometheus-blackbox-exporter")),
                    reason="prometheus / blackbox exporter not installed (.ci/run installs them)")
@pytest.mark.parametrize("auth", [False, True], ids=["open", "keyed-probes"])
def test_prometheus_scrapes_the_server_and_probes_its_deep_health(engine_dir, tmp_path, auth: bool):
    """The shipped scrape and probe configs, pointed at a live server, see traffic and a healthy probe; for a
    server whose probes need the key, the -auth config and module send it (and without it /metrics is 401)."""
    procs: list[subprocess.Popen] = []
    settings = {"api_key": KEY, "auth_probes": True} if auth else {}
    headers = {"Authorization": f"Bearer {KEY}"} if auth else {}
    with LiveServer(engine_dir, model_name="tiny-edge", **settings) as server:
        try:
            bb_port, prom_port = free_port(), free_port()
            key = tmp_path / "monitoring-key"
            key.write_text(KEY + "\n")
            blackbox = tmp_path / "blackbox.yml"
            blackbox.write_text((PROM / "blackbox.yml").read_text().replace(CREDENTIALS, str(key)))
            if auth:
                assert httpx.get(f"{server.url}/metrics", timeout=5).status_code == 401
            cfg = yaml.safe_load((PROM / ("prometheus-auth.yml" if auth else "prometheus.yml")).read_text().replace(CREDENTIALS, str(key)))
            cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
            cfg["rule_files"] = [str(PROM / "alerts.yml")]
            target = f"127.0.0.1:{server.port}"
            jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
            jobs["edgeflow-edge"]["static_configs"][0]["targets"] = [target]
            jobs["edgeflow-health"]["static_configs"][0]["targets"] = [f"http://{target}/health"]
            jobs["edgeflow-health"]["relabel_configs"][-1]["replacement"] = f"127.0.0.1:{bb_port}"
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
            procs.append(_start(["prometheus-blackbox-exporter", f"--config.file={blackbox}",
                                 f"--web.listen-address=127.0.0.1:{bb_port}"], tmp_path / "blackbox.log"))
            procs.append(_start(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                tmp_path / "prometheus.log"))
            prom = f"http://127.0.0.1:{prom_port}"
            r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, headers=headers,
                           json={"model": "tiny-edge", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            seen: dict[str, list] = {}
            while time.monotonic() < deadline:
                try:
                    seen = {
                        "received": _query(prom, 'sum(edgeflow_requests_received_total{job="edgeflow-edge"})'),
                        "ok": _query(prom, 'sum(edgeflow_requests_total{job="edgeflow-edge",status="200"})'),
                        "probe": _query(prom, 'probe_success{job="edgeflow-health"}'),
                        "memory": _query(prom, 'edgeflow_device_memory_used_bytes{job="edgeflow-edge"}'),
                        "ttft": _query(prom, 'sum(edgeflow_time_to_first_token_seconds_count{job="edgeflow-edge"}) > 0'),
                        "duration": _query(prom, 'sum(edgeflow_request_duration_seconds_bucket{job="edgeflow-edge",le="+Inf"}) > 0'),
                    }
                    if all(seen.values()) and seen["probe"][0]["value"][1] == "1":
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            assert seen and all(seen.values()), (seen, (tmp_path / "prometheus.log").read_text()[-2000:])
            assert float(seen["received"][0]["value"][1]) >= 1 and float(seen["ok"][0]["value"][1]) >= 1
            assert seen["probe"][0]["value"][1] == "1", (tmp_path / "blackbox.log").read_text()[-2000:]
            assert float(seen["memory"][0]["value"][1]) > 50e6  # an engine-holding process, not a placeholder
            # every alert rule has been evaluated against the live data, without errors
            time.sleep(2)
            rules = [r for g in httpx.get(f"{prom}/api/v1/rules", timeout=5).json()["data"]["groups"] for r in g["rules"]]
            assert {r["name"] for r in rules} >= {"EdgeflowNoCompletedRequests", "EdgeflowP99LatencyHigh",
                                                  "EdgeflowDeviceMemoryDrift", "EdgeflowTargetDown", "EdgeflowHealthProbeFailing"}
            for r in rules:
                assert r["health"] == "ok" and not r["lastEvaluation"].startswith("0001"), r
                assert r["state"] == "inactive", r  # a healthy, answering server raises none of them
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=15)


def _exported_names() -> set[str]:
    """Every sample name the edge server's registry can export (counters as *_total, histograms as *_bucket, …)."""
    from edgeflow.serving.metrics import Metrics

    m = Metrics()
    m.requests.labels(endpoint="x", status="200").inc()
    m.received.labels(endpoint="x").inc()
    m.request_duration.labels(endpoint="x").observe(0.1)  # labelled collectors export samples once used
    m.engine.info({"backend": "cpu"})
    return {s.name for fam in m.registry.collect() for s in fam.samples}


def test_dashboard_and_rules_only_use_metrics_the_server_exports():
    import json
    import re

    names = _exported_names()
    dash = json.loads((REPO_ROOT / "infra" / "grafana" / "edgeflow-edge.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    used = {n for e in exprs for n in re.findall(r"\bedgeflow_[a-z_]+", e)}
    assert used and used <= names, sorted(used - names)
    assert {"edgeflow_time_to_first_token_seconds_bucket", "edgeflow_requests_received_total",
            "edgeflow_device_memory_used_bytes"} <= used
