"""Throughput: the one definition of ``samples_per_s`` (console, Prometheus, live view,
summary.json, every bench): items trained per second of RL wall, the time inside
``Trainer.train_step`` minus the Trainer's own evaluations. The totals are saved in every
checkpoint (``state()``), so a resumed run's figure covers the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the per-step times whose sums are kept (their means: learner_final.json's step_profile)
STEP_TIMES = ("batch_wait_s", "train_s", "publish_wait_s", "step_wall_s")


@dataclass
class Throughput:
    rl_wall_s: float = 0.0  # the denominator of samples_per_s
    items_trained_total: int = 0
    tokens_trained_total: int = 0
    time_totals: dict[str, float] = field(default_factory=dict)  # STEP_TIMES summed

    @property
    def samples_per_s(self) -> float:
        return self.items_trained_total / max(self.rl_wall_s, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_trained_total / max(self.rl_wall_s, 1e-9)

    def count(self, items: int, tokens: int) -> None:
        """A step's trained items and tokens (before its checkpoint, which saves them)."""
        self.items_trained_total += items
        self.tokens_trained_total += tokens

    def add_times(self, stats: dict[str, float]) -> None:
        for k in STEP_TIMES:
            self.time_totals[k] = self.time_totals.get(k, 0.0) + stats[k]

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (its ``extra``)."""
        return {
            "rl_wall_s": self.rl_wall_s,
            "items_trained_total": self.items_trained_total,
            "tokens_trained_total": self.tokens_trained_total,
        }

    def restore(self, extra: dict[str, Any]) -> None:
        """The totals of a checkpoint's ``extra`` (zero where an older one has none)."""
        self.rl_wall_s = float(extra.get("rl_wall_s", 0.0))
        self.items_trained_total = int(extra.get("items_trained_total", 0))
        self.tokens_trained_total = int(extra.get("tokens_trained_total", 0))
