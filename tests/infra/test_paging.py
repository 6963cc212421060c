"""The silent hang pages: a live server frozen twice, with Prometheus, Alertmanager and a webhook sink around it.

The same drill `make page-test` runs (edgeflow.ops.monitoring.page_drill); its seconds are in BENCHMARKS.md#paging.
"""
from __future__ import annotations

import pytest

from edgeflow.ops import monitoring

pytestmark = pytest.mark.skipif(bool(monitoring.missing_binaries()),
                                reason="Prometheus, Alertmanager or the blackbox exporter not installed (.ci/run installs them)")


def test_a_wedged_engine_and_a_frozen_server_each_page_heal_and_resolve(engine_dir, tmp_path):
    results = monitoring.page_drill(engine_dir, tmp_path, model_name="tiny-edge")
    by_case = {r.alert: r for r in results}
    assert set(by_case) == {"EdgeflowHealthProbeFailing", "EdgeflowTargetDown"}, results
    for r in results:
        assert r.receiver == "edgeflow-page", r  # both are pages, on the page route
        assert 0 < r.page_s < r.resolved_s, r
        assert r.recovered_s <= r.resolved_s, r  # resolved only once it really serves again
    # the engine case is healed by the in-process watchdog (12 s of no progress), the frozen one by the supervisor's
    # liveness check: both restarts are in the server log, and the restarted server counts them
    log = (tmp_path / "server.log").read_text()
    assert "server exited with status 70; restarting" in log
    assert "frozen; killing it" in log and "server exited with status -9; restarting" in log
