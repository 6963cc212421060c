"""What a rollout wave is judged on: the wave devices' Prometheus series against the devices still on the old version.

    python -c "from edgeflow.fleet.watch import observe; ..."   # called by edgeflow/pipeline/rollout.py after each wave's window

Read over the wave's window [start, end] from the Prometheus in `rollout.prometheus_url`, by the `device`
label its scrape targets carry (python -m edgeflow.fleet targets writes them from the inventory):

  scraped      every wave device was scraped through the window (`up` present and 1)        fail closed
  error rate   5xx answers / requests, above the old-version devices' by > max_error_rate   judged with >= min_requests
  TTFT p99     above max_ttft_p99_ratio x the old-version devices' (and by more than ttft_p99_slack_ms), or above
               max_ttft_p99_ms                                                                judged with >= min_requests
  restarts     supervisor restarts (edgeflow_server_restarts) above max_restarts             always
  feedback     'wrong answer' + 'no response' per request, above the old ones' by > max_feedback_rate

A Prometheus that does not answer, or answers with an error, is a breach (WatchError): a wave nobody could
watch does not go on.
"""
from __future__ import annotations

import math

import httpx
from pydantic import BaseModel, ConfigDict, Field

from edgeflow.profile import RolloutConfig


class WatchError(RuntimeError):
    """Prometheus could not be read: the wave fails closed."""


class DeviceFigures(BaseModel):
    model_config = ConfigDict(extra="forbid")
    device: str = Field(description="Device id.")
    scraped: bool = Field(description="Scraped, and up, through the window.")
    requests: float = Field(description="Requests finished in the window.")
    errors_5xx: float = Field(description="Of those, answered 5xx.")
    error_rate: float | None = Field(description="errors_5xx / requests (None without requests).")
    ttft_p99_ms: float | None = Field(description="TTFT p99 in the window, ms (None without requests).")
    restarts: float = Field(description="Supervisor restarts of its server seen in the window.")
    bad_feedback: float = Field(description="'wrong_answer' + 'no_response' feedback in the window.")


class WaveWatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: str = Field(description="The window read, as ISO start/end and seconds.")
    wave: list[DeviceFigures] = Field(description="Each wave device's figures.")
    baseline: DeviceFigures | None = Field(description="The devices still on the old version, pooled (None when none are).")
    breaches: list[str] = Field(description="One line per breach, naming the device, the check and the numbers.")
    notes: list[str] = Field(description="Checks not judged, and why (too few requests).")


def _query(url: str, expr: str, at: float) -> dict[str, float]:
    """An instant query at `at`; {device: value}."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=15)
    except httpx.HTTPError as e:
        raise WatchError(f"Prometheus at {url} did not answer ({type(e).__name__}: {e}) for {expr!r}; the wave fails closed") from None
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200 or body.get("status") != "success":
        raise WatchError(f"Prometheus at {url} answered {r.status_code} {body.get('error', r.text[:200])} for {expr!r}; "
                         "the wave fails closed")
    out = {}
    for s in body["data"]["result"]:
        value = float(s["value"][1])
        out[s["metric"].get("device", "")] = value
    return out


def figures(cfg: RolloutConfig, devices: list[str], start: float, end: float) -> dict[str, DeviceFigures]:
    """The window's figures for `devices` (each one separately)."""
    if not devices:
        return {}
    w = f"{max(int(end - start), int(4 * cfg.scrape_interval_s))}s"
    sel = f'device=~"{"|".join(devices)}"'
    url = cfg.prometheus_url
    up_min = _query(url, f"min by (device) (min_over_time(up{{{sel}}}[{w}]))", end)
    requests = _query(url, f"sum by (device) (increase(edgeflow_requests_total{{{sel}}}[{w}]))", end)
    errors = _query(url, f'sum by (device) (increase(edgeflow_requests_total{{{sel},status=~"5.."}}[{w}]))', end)
    ttft = _query(url, f"histogram_quantile(0.99, sum by (device, le) (rate(edgeflow_time_to_first_token_seconds_bucket{{{sel}}}[{w}])))", end)
    restarts = _query(url, f"max by (device) (max_over_time(edgeflow_server_restarts{{{sel}}}[{w}]))", end)
    feedback = _query(url, f'sum by (device) (increase(edgeflow_feedback_total{{{sel},kind=~"wrong_answer|no_response"}}[{w}]))', end)
    out = {}
    for d in devices:
        n = requests.get(d, 0.0)
        t = ttft.get(d)
        out[d] = DeviceFigures(
            device=d, scraped=up_min.get(d) == 1.0, requests=round(n, 2), errors_5xx=round(errors.get(d, 0.0), 2),
            error_rate=round(errors.get(d, 0.0) / n, 4) if n > 0 else None,
            ttft_p99_ms=round(t * 1000, 1) if t is not None and not math.isnan(t) else None,
            restarts=restarts.get(d, 0.0), bad_feedback=round(feedback.get(d, 0.0), 2))
    return out


def pooled(figs: list[DeviceFigures]) -> DeviceFigures | None:
    if not figs:
        return None
    n = sum(f.requests for f in figs)
    e = sum(f.errors_5xx for f in figs)
    ttfts = [f.ttft_p99_ms for f in figs if f.ttft_p99_ms is not None]
    return DeviceFigures(device="+".join(f.device for f in figs), scraped=all(f.scraped for f in figs), requests=n,
                         errors_5xx=e, error_rate=round(e / n, 4) if n > 0 else None,
                         ttft_p99_ms=max(ttfts) if ttfts else None, restarts=sum(f.restarts for f in figs),
                         bad_feedback=sum(f.bad_feedback for f in figs))


def judge(cfg: RolloutConfig, wave: list[DeviceFigures], baseline: DeviceFigures | None) -> tuple[list[str], list[str]]:
    """(breaches, notes) of the wave against the old-version devices."""
    breaches, notes = [], []
    base_ok = baseline is not None and baseline.requests >= cfg.min_requests
    base_err = (baseline.error_rate or 0.0) if base_ok else 0.0
    base_fb = baseline.bad_feedback / baseline.requests if base_ok else 0.0
    for f in wave:
        if not f.scraped:
            breaches.append(f"{f.device}: not scraped (or down) through the window; Prometheus cannot vouch for it (check: scraped)")
            continue
        if f.restarts > cfg.max_restarts:
            breaches.append(f"{f.device}: {f.restarts:.0f} server restart(s) in the window > rollout.max_restarts={cfg.max_restarts} "
                            "(check: restarts)")
        if f.requests < cfg.min_requests:
            notes.append(f"{f.device}: {f.requests:.0f} requests < rollout.min_requests={cfg.min_requests}: rates not judged")
            continue
        if (f.error_rate or 0.0) > base_err + cfg.max_error_rate:
            breaches.append(f"{f.device}: 5xx rate {f.error_rate:.2%} > old version's {base_err:.2%} + "
                            f"rollout.max_error_rate={cfg.max_error_rate:.2%} (check: error rate)")
        if f.ttft_p99_ms is not None:
            if (base_ok and baseline.ttft_p99_ms and f.ttft_p99_ms > cfg.max_ttft_p99_ratio * baseline.ttft_p99_ms
                    and f.ttft_p99_ms - baseline.ttft_p99_ms > cfg.ttft_p99_slack_ms):
                breaches.append(f"{f.device}: TTFT p99 {f.ttft_p99_ms:.0f} ms > {cfg.max_ttft_p99_ratio} x old version's "
                                f"{baseline.ttft_p99_ms:.0f} ms, and more than rollout.ttft_p99_slack_ms="
                                f"{cfg.ttft_p99_slack_ms:g} above it (check: TTFT p99)")
            if cfg.max_ttft_p99_ms is not None and f.ttft_p99_ms > cfg.max_ttft_p99_ms:
                breaches.append(f"{f.device}: TTFT p99 {f.ttft_p99_ms:.0f} ms > rollout.max_ttft_p99_ms={cfg.max_ttft_p99_ms:.0f} "
                                "(check: TTFT p99)")
        fb = f.bad_feedback / f.requests
        if fb > base_fb + cfg.max_feedback_rate:
            breaches.append(f"{f.device}: 'wrong answer'/'no response' feedback {fb:.2%} of requests > old version's "
                            f"{base_fb:.2%} + rollout.max_feedback_rate={cfg.max_feedback_rate:.2%} (check: feedback)")
    if not base_ok:
        notes.append("no old-version devices with enough requests in the window: rates judged against zero, TTFT only "
                     "against rollout.max_ttft_p99_ms")
    return breaches, notes


def observe(cfg: RolloutConfig, wave: list[str], old: list[str], start: float, end: float) -> WaveWatch:
    """Read and judge the window; WatchError if Prometheus cannot be read."""
    from datetime import datetime, timezone

    figs = figures(cfg, wave + old, start, end)
    wave_figs = [figs[d] for d in wave]
    baseline = pooled([figs[d] for d in old if figs[d].scraped])
    breaches, notes = judge(cfg, wave_figs, baseline)
    iso = lambda t: datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")  # noqa: E731
    return WaveWatch(window=f"{iso(start)} .. {iso(end)} ({end - start:.0f} s)", wave=wave_figs, baseline=baseline,
                     breaches=breaches, notes=notes)
