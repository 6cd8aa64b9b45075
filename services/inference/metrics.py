"""Prometheus metrics of the inference service (``ludic_inference_*``).

The service's own metrics live in a per-app registry (so tests can build several apps);
``/metrics`` renders it followed by the process-wide default registry, where vLLM's stat
loggers register ``vllm:*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


@dataclass
class InferenceMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "ludic_inference_requests_total",
            "OpenAI-compatible requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "ludic_inference_generated_tokens_total",
            "Completion tokens returned by finished generations",
            registry=r,
        )
        self.weight_updates = Counter(
            "ludic_inference_weight_updates_total",
            "Weight update attempts by outcome (ok, rejected, unauthorized, conflict, error)",
            ["plane", "outcome"],
            registry=r,
        )
        self.weight_update_seconds = Histogram(
            "ludic_inference_weight_update_seconds",
            "Wall time of accepted weight updates, receive to resume",
            ["plane"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.weight_pause_seconds = Histogram(
            "ludic_inference_weight_pause_seconds",
            "Time generation admission was paused for a swap (drain + reload)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.weight_reload_seconds = Histogram(
            "ludic_inference_weight_reload_seconds",
            "In-place reload of a weight update inside the vLLM worker (part of the pause)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.weight_bytes = Counter(
            "ludic_inference_weight_bytes_received_total",
            "Bytes of weight payload received (HTTP bodies and collective broadcasts)",
            ["plane"],
            registry=r,
        )
        self.policy_version = Gauge(
            "ludic_inference_policy_version", "Policy version currently served", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)
