"""The actor's settings (the ``actor:`` section of the run config)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

from libludic import staleness
from libludic.tasks import DEFAULT_TASKS, TaskSet, check_task, parse_tasks
from services.common.settings import RedisService, secret, secret_from_file


@dataclass
class ActorSettings(RedisService):
    # the run's tasks are the feeder's: one list in the run config, read by both
    FROM_SECTIONS: ClassVar[dict[str, tuple[str, str]]] = {"tasks": ("feeder", "tasks")}

    inference_urls: list[str] = field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        metadata={"help": "comma-separated inference base URLs (round-robin)"},
    )
    api_key: str | None = secret(
        "bearer token for inference",
        "set LUDIC_API_KEY, or name a file holding it with api_key_file (--api-key-file)",
    )
    api_key_file: str | None = field(
        default=None, metadata={"help": "file holding the inference token (else LUDIC_API_KEY)"}
    )
    max_head_offpolicyness: int | None = field(
        default=staleness.DEFAULT_MAX_HEAD_OFFPOLICYNESS,
        metadata={
            "help": "admission bound (top-level key): start no episode while the inference "
            "replica is more than this many versions behind the learner (null off)"
        },
    )
    tasks: list[dict[str, Any]] = field(
        default_factory=lambda: copy.deepcopy(list(DEFAULT_TASKS)),
        metadata={
            "help": "the tasks this actor runs (default: the run config's feeder.tasks): a "
            "request that is not one of them is dead-lettered, nothing it names imported"
        },
    )
    concurrency: int = field(default=4, metadata={"help": "requests run at once"})
    episode_concurrency: int = field(default=8, metadata={"help": "episodes at once per request"})
    max_steps: int = field(default=8, metadata={"help": "max steps per episode"})
    claim_idle_ms: int = field(
        default=30_000, metadata={"help": "idle time after which a peer's entry is claimed"}
    )
    max_deliveries: int = field(default=5, metadata={"help": "deliveries before dead-letter"})
    rollouts_high_water: int = field(
        default=1024, metadata={"help": "pause while the rollouts backlog is this long (0 off)"}
    )
    block_ms: int = field(default=1000, metadata={"help": "XREADGROUP block time"})
    heartbeat_ttl_s: float = field(default=10.0, metadata={"help": "liveness key TTL"})
    drain_grace_s: float = field(default=30.0, metadata={"help": "SIGTERM: time to finish work"})
    inference_timeout_s: float = field(default=120.0, metadata={"help": "per-call timeout"})
    request_retries: int = field(
        default=1,
        metadata={
            "help": "retries of a failed model call on one replica (connection errors, "
            "timeouts, 429, 5xx) before the pool tries the next replica; AReaL's "
            "request_retries (3 there, where a client has one server)"
        },
    )
    metrics_port: int = field(default=9101, metadata={"help": "/metrics and /health (0 off)"})
    consumer: str | None = field(default=None, metadata={"help": "consumer name (default auto)"})

    def __post_init__(self) -> None:
        self.api_key = secret_from_file(self.api_key, self.api_key_file, "LUDIC_API_KEY", "api key")
        if self.concurrency < 1:
            raise ValueError(f"actor concurrency={self.concurrency} must be >= 1")
        staleness.check_bound("max_head_offpolicyness", self.max_head_offpolicyness)
        if isinstance(self.request_retries, bool) or self.request_retries < 0:
            raise ValueError(f"actor request_retries={self.request_retries!r} must be >= 0")
        if self.claim_idle_ms < 100:
            raise ValueError(f"claim_idle_ms={self.claim_idle_ms} must be >= 100")
        where = "feeder.tasks"  # the actor reads the feeder's list; its errors name that key
        parsed = parse_tasks(self.tasks, where)
        for i, task in enumerate(parsed):
            check_task(task, f"{where}[{i}]")
        self.task_set = TaskSet(parsed)
