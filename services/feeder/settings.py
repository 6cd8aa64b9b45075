"""The feeder's settings (the ``feeder:`` section of the run config); its curriculum is a list
of tasks (libludic/tasks.py), each built once at start-up (``check_task``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from libludic import staleness
from libludic.tasks import DEFAULT_TASKS, check_task, parse_tasks
from services.common.settings import RedisService, algorithm_group_size


@dataclass
class FeederSettings(RedisService):
    tasks: list[dict[str, Any]] = field(
        default_factory=lambda: copy.deepcopy(list(DEFAULT_TASKS)),
        metadata={
            "help": "curriculum: list of {name, env, protocol, agent, inference, reward, "
            "weight} (YAML; libludic/tasks.py)"
        },
    )
    algorithm: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "the run's top-level algorithm: section; its group_size = episodes per "
            "request (one group)"
        },
    )
    high_water: int = field(default=64, metadata={"help": "target backlog of the requests stream"})
    max_head_offpolicyness: int | None = field(
        default=staleness.DEFAULT_MAX_HEAD_OFFPOLICYNESS,
        metadata={
            "help": "admission bound (top-level key): generate at most this many learner "
            "batches ahead of the served weights (0 synchronous, null off); see "
            "libludic/staleness.py"
        },
    )
    seed_base: int = field(
        default=0,
        metadata={
            "help": "env seeds are seed_base, seed_base+1, ...: put them past an evaluation's "
            "(env seeds 0..n-1) so no trained game is one the evaluation plays"
        },
    )
    max_requests: int = field(default=0, metadata={"help": "stop after this many (0: forever)"})
    poll_s: float = field(default=0.5, metadata={"help": "seconds between top-ups"})
    metrics_port: int = field(default=9104, metadata={"help": "/metrics and /health (0 off)"})

    def __post_init__(self) -> None:
        self.group_size = algorithm_group_size(self.algorithm)
        if self.seed_base < 0:
            raise ValueError(f"feeder seed_base={self.seed_base} must be >= 0")
        if self.high_water < 1:
            raise ValueError(f"feeder high_water={self.high_water} must be >= 1")
        staleness.check_bound("max_head_offpolicyness", self.max_head_offpolicyness)
        if not self.tasks:
            raise ValueError("feeder needs at least one task; see services/feeder/README.md")
        self.parsed_tasks = parse_tasks(self.tasks, "feeder.tasks")
        for i, task in enumerate(self.parsed_tasks):  # reward functions are the actors' to build
            check_task(task, f"feeder.tasks[{i}]", build_rewards=False)
