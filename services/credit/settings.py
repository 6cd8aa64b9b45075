"""The credit worker's settings (the ``credit:`` section of the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libludic.training.algorithm_spec import AlgorithmSpec
from services.common.settings import SAW_HIGH_WATER, RedisService, check_service_algorithm


@dataclass
class CreditSettings(RedisService):
    algorithm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the run's algorithm {name, group_size, kwargs}: the top-level algorithm: "
            "section (JSON here)"
        },
    )
    group_timeout_s: float = field(default=120.0, metadata={"help": "incomplete-group timeout"})
    min_partial_group: int = field(
        default=2, metadata={"help": "timed-out groups at least this big are processed as-is"}
    )
    filters: list[str] = field(
        default_factory=list,
        metadata={"help": "sample filters by name: drop_truncated,drop_incomplete_completions,..."},
    )
    batch: int = field(default=64, metadata={"help": "rollout entries read per call"})
    block_ms: int = field(default=1000, metadata={"help": "XREADGROUP block time"})
    claim_idle_ms: int = field(default=30_000, metadata={"help": "idle time before claiming"})
    max_deliveries: int = field(default=10, metadata={"help": "deliveries before dead-letter"})
    saw_high_water: int = field(
        default=SAW_HIGH_WATER,
        metadata={"help": "pause while the saw backlog is this long (0 off)"},
    )
    lease_ttl_ms: int = field(default=10_000, metadata={"help": "leader lease TTL"})
    metrics_port: int = field(default=9102, metadata={"help": "/metrics and /health (0 off)"})
    consumer: str | None = field(default=None, metadata={"help": "consumer name (default auto)"})

    def __post_init__(self) -> None:
        self.spec = AlgorithmSpec.from_mapping(self.algorithm)
        check_service_algorithm(self.spec, "credit")
        if self.min_partial_group < 1:
            raise ValueError(f"min_partial_group={self.min_partial_group} must be >= 1")
