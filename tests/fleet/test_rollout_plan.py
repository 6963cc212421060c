"""Rollout planning and judging, without a fleet: waves, targeting, device configs, the probe measure, the verdict."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from edgeflow.preflight import load_profile
from edgeflow.profile import DeployConfig, RolloutConfig, WaveSpec
from edgeflow.device.identity import DeviceConfig, device_profile, load_device
from edgeflow.fleet.inventory import DeviceRecord, Serving, prometheus_targets, select, table
from edgeflow.device.probe import common_prefix_share
from edgeflow.fleet.rollout import plan_waves, targeted, wave_sizes
from edgeflow.fleet.watch import DeviceFigures, judge, pooled


def test_cumulative_waves_become_disjoint_device_lists():
    waves = [WaveSpec(devices=1), WaveSpec(percent=50), WaveSpec(percent=100)]
    assert wave_sizes(waves, 10) == [1, 5, 10]
    assert plan_waves(waves, [f"d{i}" for i in range(10)]) == [["d0"], ["d1", "d2", "d3", "d4"], [f"d{i}" for i in range(5, 10)]]
    # two devices: canary, then the other; the 50 % wave adds nobody and is dropped
    assert plan_waves(waves, ["a", "b"]) == [["a"], ["b"]]
    assert plan_waves([WaveSpec(percent=10), WaveSpec(percent=100)], ["a", "b", "c"]) == [["a"], ["b", "c"]]  # rounded up
    with pytest.raises(ValueError, match="addresses no device"):
        plan_waves(waves, [])


def test_wave_specs_are_checked_at_load():
    with pytest.raises(ValidationError, match="exactly one of devices or percent"):
        WaveSpec(devices=1, percent=10)
    with pytest.raises(ValidationError, match="last wave must be percent: 100"):
        RolloutConfig(waves=[{"devices": 1}, {"percent": 50}])
    with pytest.raises(ValidationError, match="rollout.waves is empty"):
        RolloutConfig(waves=[])
    with pytest.raises(ValidationError, match="extra"):
        RolloutConfig(wave=[])  # a typo is refused, not ignored


def _record(i: str, **tags) -> DeviceRecord:
    return DeviceRecord(id=i, pool="orin", queue=f"device-{i}", tags=tags, facts={"sku": tags.get("sku", "x")},
                        metrics_target=f"127.0.0.1:{8000 + len(i)}", serving=Serving(version="3", model="m", healthy=True),
                        registered_at="2026-12-02T00:00:00+00:00")


def test_targeting_by_tags_refuses_an_empty_selection_and_offline_devices():
    fleet = [_record("a", sku="agx-orin-64gb", site="berlin"), _record("b", sku="agx-orin-32gb", site="berlin")]
    assert [r.id for r in select(fleet, {"site": "berlin"})] == ["a", "b"]
    assert [r.id for r in select(fleet, {"sku": "agx-orin-64gb"})] == ["a"]
    cfg = RolloutConfig(target={"site": "paris"})
    with pytest.raises(ValueError, match=r"rollout.target=\{'site': 'paris'\} addresses no device of pool 'orin'.*a \{"):
        targeted(cfg, fleet, {"a": "online", "b": "online"})
    with pytest.raises(ValueError, match=r"not online: b \(offline \(200 s since heartbeat\)\)"):
        targeted(RolloutConfig(), fleet, {"a": "online", "b": "offline (200 s since heartbeat)"})
    assert [r.id for r in targeted(RolloutConfig(), fleet, {"a": "online", "b": "online"})] == ["a", "b"]
    assert prometheus_targets(fleet)[0] == {"targets": ["127.0.0.1:8001"], "labels": {"device": "a", "pool": "orin"}}
    out = table(fleet, {"a": "online"})
    assert out.splitlines()[0].split()[:3] == ["id", "queue", "worker"]
    assert "device-a" in out and "online" in out and "no worker" in out and "m v3" in out


def test_device_config_is_validated_and_overrides_only_deploy(tmp_path):
    profile = load_profile("configs/test-tiny.yaml")
    d = DeviceConfig(id="orin-b", deploy={"port": 8785, "side_ports": [8786, 8787]})
    p = device_profile(profile, d)
    assert (p.deploy.port, p.deploy.side_ports, d.queue) == (8785, [8786, 8787], "device-orin-b")
    assert p.engine == profile.engine and profile.deploy.port != 8785  # the shared profile is untouched
    with pytest.raises(ValidationError, match="id='Orin_B'"):
        DeviceConfig(id="Orin_B")
    with pytest.raises(ValidationError, match=r"deploy: unknown keys \['prot'\]"):
        DeviceConfig(id="a", deploy={"prot": 1})
    with pytest.raises(ValidationError, match="are not fault flags"):
        DeviceConfig(id="a", faults={"3": {"max_queue": 0}})
    with pytest.raises(ValueError, match="device orin-b: its deploy overrides do not validate"):
        device_profile(profile, DeviceConfig(id="orin-b", deploy={"side_ports": [1]}))
    assert load_device(tmp_path / "none.yaml") is None
    with pytest.raises(FileNotFoundError, match="no device config at"):
        load_device(tmp_path / "none.yaml", required=True)
    (tmp_path / "device.yaml").write_text("id: a\ntags: {site: x}\nbogus: 1\n")
    with pytest.raises(ValueError, match="device config .*device.yaml.*bogus"):
        load_device(tmp_path / "device.yaml")
    assert set(DeployConfig.model_fields) >= {"update_lock_max_in_flight", "update_lock_timeout_s"}


def test_the_probe_measure_is_the_matched_share_of_the_reference():
    assert common_prefix_share(" Paris is", " Paris is") == 1.0
    assert common_prefix_share(" Paris", " Paris is") == pytest.approx(6 / 9)
    assert common_prefix_share(" London", " Paris") == pytest.approx(1 / 6)  # the leading space matched
    assert common_prefix_share("London", "Paris") == 0.0
    assert common_prefix_share("anything", "") == 1.0


def _fig(device: str, requests: float, errors: float = 0, ttft: float | None = 100, restarts: float = 0,
         feedback: float = 0, scraped: bool = True) -> DeviceFigures:
    return DeviceFigures(device=device, scraped=scraped, requests=requests, errors_5xx=errors,
                         error_rate=errors / requests if requests else None, ttft_p99_ms=ttft, restarts=restarts,
                         bad_feedback=feedback)


def test_the_verdict_compares_the_wave_with_the_old_version_devices():
    cfg = RolloutConfig(min_requests=10, max_error_rate=0.01, max_ttft_p99_ratio=1.5, max_feedback_rate=0.05)
    base = pooled([_fig("b", 100, ttft=200), _fig("c", 100, ttft=100)])
    assert base.requests == 200 and base.ttft_p99_ms == 200
    assert judge(cfg, [_fig("a", 100, ttft=250)], base) == ([], [])
    breaches, _ = judge(cfg, [_fig("a", 100, errors=5, ttft=400, restarts=1, feedback=10)], base)
    assert [b.split("(check: ")[1] for b in breaches] == ["restarts)", "error rate)", "TTFT p99)", "feedback)"]
    assert breaches[1].startswith("a: 5xx rate 5.00% > old version's 0.00%")
    breaches, _ = judge(cfg, [_fig("a", 100, scraped=False)], base)
    assert breaches == ["a: not scraped (or down) through the window; Prometheus cannot vouch for it (check: scraped)"]
    # one histogram-bucket step (25 -> 44 ms) is a 1.76x ratio but within the slack; without a slack it breaches
    tight = pooled([_fig("b", 100, ttft=25)])
    assert judge(cfg, [_fig("a", 100, ttft=44)], tight) == ([], [])
    breaches, _ = judge(cfg.model_copy(update={"ttft_p99_slack_ms": 0}), [_fig("a", 100, ttft=44)], tight)
    assert breaches == ["a: TTFT p99 44 ms > 1.5 x old version's 25 ms, and more than rollout.ttft_p99_slack_ms=0 above it "
                        "(check: TTFT p99)"]
    # too little traffic: rates are not judged, restarts still are
    breaches, notes = judge(cfg, [_fig("a", 3, errors=3, restarts=2)], None)
    assert len(breaches) == 1 and "restart" in breaches[0] and any("3 requests < rollout.min_requests=10" in n for n in notes)
    # no old-version devices: absolute limits only
    breaches, notes = judge(cfg.model_copy(update={"max_ttft_p99_ms": 300}), [_fig("a", 100, ttft=400)], None)
    assert breaches == ["a: TTFT p99 400 ms > rollout.max_ttft_p99_ms=300 (check: TTFT p99)"] and notes


def test_a_prometheus_that_does_not_answer_fails_the_wave_closed():
    from tests.helpers.ports import free_port

    from edgeflow.fleet.watch import WatchError, observe

    cfg = RolloutConfig(prometheus_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(WatchError, match=r"Prometheus at http://127.0.0.1:\d+ did not answer .*the wave fails closed"):
        observe(cfg, ["a"], ["b"], 0.0, 60.0)
