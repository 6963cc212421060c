"""Alertmanager's config (amtool), what a bad one gets, and its routes, grouping and inhibition on a live Alertmanager."""
from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import yaml

from edgeflow.ops import monitoring
from edgeflow.ops.monitoring import AM_DIR, AlertSink, MonitoringConfigError, Ports, check_alertmanager
from tests.helpers.ports import free_port

needs_amtool = pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (.ci/run installs it)")
needs_stack = pytest.mark.skipif(bool(monitoring.missing_binaries()),
                                 reason="Prometheus, Alertmanager or the blackbox exporter not installed (.ci/run installs them)")


@needs_amtool
@pytest.mark.parametrize("name", ["alertmanager.yml", "receivers.example.yml"])
def test_shipped_configs_and_the_receiver_examples_are_valid(name):
    check_alertmanager(AM_DIR / name)
    examples = yaml.safe_load((AM_DIR / "receivers.example.yml").read_text())
    kinds = {k for r in examples["receivers"] for k in r if k.endswith("_configs")}
    assert kinds == {"email_configs", "pagerduty_configs", "slack_configs"}
    shipped = yaml.safe_load((AM_DIR / "alertmanager.yml").read_text())
    assert {r["name"] for r in examples["receivers"]} == {r["name"] for r in shipped["receivers"]}  # drop-in names


@needs_amtool
@pytest.mark.parametrize("edit, names, past", [
    (("receiver: edgeflow-ticket", "receiver: edgeflow-tickets"), ('undefined receiver "edgeflow-tickets"', "receivers:"), 0),
    (("group_interval: 2m", "group_intervl: 2m"), ("group_intervl not found", "remove or correct the key"), 0),
    (("  group_wait: 30s", "  group_wait: 30s\n x: ["), ("did not find expected key", "correct the YAML"), -1),
], ids=["undefined-receiver", "unknown-key", "broken-yaml"])
def test_a_bad_config_is_refused_with_its_file_line_and_fix(tmp_path, edit, names, past):
    """The message names the file and the line of the edit (go-yaml reports a broken mapping at the line before the stray one)."""
    bad = tmp_path / "alertmanager.yml"
    text = (AM_DIR / "alertmanager.yml").read_text().replace(*edit, 1)
    bad.write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if edit[1].splitlines()[-1] in t) + past
    with pytest.raises(MonitoringConfigError) as e:
        check_alertmanager(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}:{line}: ") and all(n in msg for n in names), msg


@needs_amtool
@pytest.mark.parametrize("labels, receiver", [
    ("alertname=EdgeflowTargetDown severity=page device=orin-07", "edgeflow-page"),
    ("alertname=EdgeflowServerRestarted severity=warn device=orin-07", "edgeflow-ticket"),
    ("alertname=Other device=orin-07", "edgeflow-default"),
])
def test_routes_send_pages_and_warnings_to_their_receivers(labels, receiver):
    r = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={AM_DIR / 'alertmanager.yml'}",
                        *labels.split()], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == receiver, r.stdout + r.stderr


def _post(am: str, alerts: list[dict]) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body = [{"labels": a, "annotations": {"summary": f"{a['alertname']} on {a['device']}"}, "startsAt": now} for a in alerts]
    r = httpx.post(f"{am}/api/v2/alerts", json=body, timeout=5)
    assert r.status_code == 200, r.text


@needs_stack
def test_a_down_device_inhibits_its_own_alerts_and_no_other_devices(tmp_path):
    """Live Alertmanager with the shipped routes (durations at 1/20): orin-01 is down and slow, orin-02 only slow.
    The sink gets the page for orin-01's outage and the warning for orin-02's latency, each on its own receiver,
    and nothing about orin-01's latency."""
    ports = Ports(prometheus=free_port(), alertmanager=free_port(), blackbox=free_port(), sink=free_port())
    sink = AlertSink(ports.sink).start()
    try:
        with monitoring.stack(tmp_path, ["127.0.0.1:1"], ports, scale=1 / 20, scrape_s=1.0):
            am = f"http://127.0.0.1:{ports.alertmanager}"
            _post(am, [{"alertname": "EdgeflowTargetDown", "severity": "page", "device": "orin-01"}])
            sink.wait_for("EdgeflowTargetDown", "firing", 30)
            _post(am, [{"alertname": "EdgeflowP99LatencyHigh", "severity": "warn", "device": d} for d in ("orin-01", "orin-02")])
            sink.wait_for("EdgeflowP99LatencyHigh", "firing", 30)
            time.sleep(3)  # a few group intervals (6 s at this scale is the longest) for anything else to arrive
    finally:
        sink.stop()
    got = {(n.receiver, a["labels"]["alertname"], a["labels"]["device"]) for n in sink.notifications for a in n.alerts}
    assert ("edgeflow-page", "EdgeflowTargetDown", "orin-01") in got
    assert ("edgeflow-ticket", "EdgeflowP99LatencyHigh", "orin-02") in got
    assert not any(name == "EdgeflowP99LatencyHigh" and device == "orin-01" for _, name, device in got), got
