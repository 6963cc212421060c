"""rollout: staged rollout over the device fleet (waves, the watch, the probe).
"""
from __future__ import annotations

from pydantic import Field, model_validator

from edgeflow.profile.base import _Strict


class WaveSpec(_Strict):
    devices: int | None = Field(default=None, ge=1, description="Devices on the candidate once this wave is done (cumulative).")
    percent: float | None = Field(
        default=None, gt=0, le=100, description="Share of the targeted devices on the candidate once this wave is done "
        "(cumulative, rounded up: 10 % of 3 devices is 1).",
    )

    @model_validator(mode="after")
    def _one(self) -> WaveSpec:
        if (self.devices is None) == (self.percent is None):
            raise ValueError(f"a wave sets exactly one of devices or percent (got devices={self.devices}, percent={self.percent})")
        return self


class RolloutConfig(_Strict):
    """Staged rollout over the fleet (edgeflow/pipeline/rollout.py): canary, then the rest in steps, each wave watched."""

    pool: str = Field(default="orin", description="Work pool whose registered devices (python -m edgeflow.fleet list) the rollout targets.")
    target: dict[str, str] = Field(
        default_factory=dict, description="Tags a device must carry, all of them, to be targeted (e.g. {sku: agx-orin-64gb, "
        "site: berlin}); empty: every registered device of the pool.",
    )
    waves: list[WaveSpec] = Field(
        default_factory=lambda: [WaveSpec(devices=1), WaveSpec(percent=100)],
        description="Cumulative waves: a canary first, then steps; the last one must reach every targeted device "
        "(percent: 100).",
    )
    observe_s: float = Field(
        default=600, gt=0, description="Each wave is watched this long after its devices switched (10 min: two alert "
        "evaluation windows of infra/prometheus/alerts.yml).",
    )
    prometheus_url: str = Field(default="http://127.0.0.1:9090", description="Prometheus that scrapes every device (label `device`).")
    scrape_interval_s: float = Field(
        default=15, gt=0, description="That Prometheus's scrape interval; rates are read over windows of at least 4 scrapes.",
    )
    max_error_rate: float = Field(
        default=0.01, ge=0, le=1, description="Breach: share of a wave device's requests that answered 5xx in the window, "
        "above the devices still on the old version by more than this.",
    )
    max_ttft_p99_ratio: float = Field(
        default=1.5, gt=1, description="Breach: a wave device's TTFT p99 above this multiple of the old-version devices' "
        "(when some serve in the window).",
    )
    max_ttft_p99_ms: float | None = Field(
        default=None, gt=0, description="Breach: a wave device's TTFT p99 above this, in ms (None: only the comparison).",
    )
    ttft_p99_slack_ms: float = Field(
        default=50, ge=0,
        description="The max_ttft_p99_ratio comparison breaches only when the wave device's TTFT p99 is also more than this "
        "many ms above the old-version devices'. Why: the p99s come from the server's histogram buckets (10, 25, 50, "
        "100 ms …), and with a few requests in a short window one bucket step is a 2x ratio with nothing wrong (seen in "
        "a loaded 2-core test run: 44 ms against 25 ms). 0: the ratio alone.",
    )
    max_restarts: int = Field(default=0, ge=0, description="Breach: more server restarts than this on a wave device in the window.")
    max_feedback_rate: float = Field(
        default=0.05, ge=0, le=1, description="Breach: 'wrong answer' or 'no response' feedback per request on a wave device, "
        "above the old-version devices by more than this.",
    )
    min_requests: int = Field(
        default=20, ge=1, description="Requests a device needs in the window for its rates to be judged; below it the rates "
        "are reported, not judged (the probe and the restarts still are).",
    )
    probe_prompts: int = Field(
        default=32, ge=1, description="Gate greedy prompts the on-device probe sends through the deployed server (the "
        "first N of the gate reference; fewer if the gate had fewer).",
    )
    probe_tolerance: float = Field(
        default=0.05, ge=0, le=1, description="Breach: the probe's agreement with the FP reference below the gate's "
        "figure for the same prompts by more than this.",
    )
    min_same_as_gate: float | None = Field(
        default=None, ge=0, le=1, description="Breach: share of probe answers identical to the gate engine's own "
        "continuation below this. Set it where devices run the gate's very engine (the CPU engines are deterministic: "
        "1.0 is expected); None where a device builds its own binding, whose answers may differ token for token.",
    )
    pickup_timeout_s: float = Field(
        default=120, gt=0, description="How long a wave waits for a device's worker to take its deploy-edge (or probe) run "
        "off the device's queue. A worker polls its queue every few seconds (PREFECT_WORKER_QUERY_SECONDS), so a run still "
        "queued after this means the device is cut off: the run is cancelled and the wave breaches on that device.",
    )
    deploy_timeout_s: float = Field(
        default=1800, gt=0, description="Longest a device's deploy-edge (or probe) run may take once its worker took it "
        "(a deploy that builds the engine on the device takes minutes).",
    )

    @model_validator(mode="after")
    def _waves(self) -> RolloutConfig:
        if not self.waves:
            raise ValueError("rollout.waves is empty; give at least one wave, the last with percent: 100")
        last = self.waves[-1]
        if last.percent != 100:
            raise ValueError(f"rollout.waves: the last wave must be percent: 100 (got {last.model_dump(exclude_none=True)}); "
                             "a rollout that stops short of its targets never completes")
        return self
