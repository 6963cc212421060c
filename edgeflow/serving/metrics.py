"""The edge server's Prometheus collectors (`edgeflow_*`), each app with its own registry.

    m = Metrics(); m.requests.labels(endpoint="/v1/completions", status="200").inc(); m.exposition()
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest


class Metrics:
    """Prometheus collectors in a registry owned by one app (several apps can share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "edgeflow_request_duration_seconds",
            "Arrival to last byte of admitted generation requests.",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120),
            registry=r,
        )
        self.queue_time = Histogram(
            "edgeflow_queue_time_seconds",
            "Time an admitted request waited for a generation slot.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60),
            registry=r,
        )
        self.ttft = Histogram(
            "edgeflow_time_to_first_token_seconds",
            "Arrival to first generated token (queueing and prefill included).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30),
            registry=r,
        )
        self.tpot = Histogram(
            "edgeflow_time_per_output_token_seconds",
            "Mean inter-token time of a request (decode speed), after the first token.",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1),
            registry=r,
        )
        self.prompt_tokens = Counter("edgeflow_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("edgeflow_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "edgeflow_requests", "Finished generation requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.received = Counter(
            "edgeflow_requests_received", "Generation requests received (before validation and admission).", ["endpoint"], registry=r
        )
        self.device_memory = Gauge(
            "edgeflow_device_memory_used_bytes",
            "Memory the engine holds: the backend's device_memory_used hook (GPU), else this process's RSS "
            "(on Jetson, GPU and CPU share the same DRAM).",
            registry=r,
        )
        self.in_flight = Gauge("edgeflow_requests_in_flight", "Generations holding a slot (running).", registry=r)
        self.queue_depth = Gauge("edgeflow_queue_depth", "Requests waiting for a slot.", registry=r)
        self.engine = Info("edgeflow_engine", "The engine being served.", registry=r)
        self.feedback = Counter(
            "edgeflow_feedback", "Feedback sent from the chat page, by kind.", ["kind"], registry=r
        )
        self.access_log_dropped = Counter(
            "edgeflow_access_log_dropped_records",
            "Access-log records the disk refused (full or over quota): served, but missing from tonight's logs.",
            registry=r,
        )
        self.access_log_writable = Gauge(
            "edgeflow_access_log_writable", "1 while the last access-log write succeeded, 0 after a refused one.",
            registry=r,
        )
        self.access_log_writable.set(1)
        self.restarts = Gauge(
            "edgeflow_server_restarts",
            "Times the supervisor restarted this server (watchdog exits and crashes) since the deploy started it.",
            registry=r,
        )

    def exposition(self) -> tuple[bytes, str]:
        """The registry in the Prometheus text format, and its content type (GET /metrics)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
