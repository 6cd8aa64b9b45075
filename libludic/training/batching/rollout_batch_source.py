"""RolloutBatchSource: online RL, synchronous. Each ``next_batch()`` runs fresh episodes.

``request_fn()`` -> requests -> ``engine.generate_rollouts(requests, max_steps,
concurrency)`` -> ``algorithm.to_saw_items(rollouts, sample_filter)`` -> SAWBatch. If
filters (or the algorithm's preprocess, e.g. ScaleRL's zero-variance filter) leave nothing,
new requests are run, up to ``max_empty_batches`` times in a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libludic.requests import RolloutRequest
from libludic.saw import SAWBatch
from libludic.training.algorithm import RLAlgorithm
from libludic.training.filters import SampleFilter


@dataclass
class RolloutBatchSource:
    engine: Any  # has async generate_rollouts(requests, max_steps, concurrency) -> List[Rollout]
    request_fn: Callable[[], list[RolloutRequest]]
    algorithm: RLAlgorithm
    max_steps: int = 1
    concurrency: int = 8
    sample_filter: SampleFilter | None = None
    max_empty_batches: int = 16

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"RolloutBatchSource.max_steps={self.max_steps} must be >= 1")
        if self.concurrency < 1:
            raise ValueError(f"RolloutBatchSource.concurrency={self.concurrency} must be >= 1")
        if self.max_empty_batches < 1:
            raise ValueError(f"max_empty_batches={self.max_empty_batches} must be >= 1")

    async def next_batch(self) -> SAWBatch:
        for _ in range(self.max_empty_batches):
            requests = list(self.request_fn())
            if not requests:
                raise ValueError("request_fn() returned no RolloutRequests")
            rollouts = await self.engine.generate_rollouts(
                requests, max_steps=self.max_steps, concurrency=self.concurrency
            )
            items = self.algorithm.to_saw_items(rollouts, self.sample_filter)
            if items:
                rewards = [r.total_reward for r in rollouts]
                return SAWBatch(
                    items=items,
                    meta={
                        "num_rollouts": len(rollouts),
                        "num_items": len(items),
                        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
                    },
                )
        raise RuntimeError(
            f"{self.max_empty_batches} rollout batches in a row were filtered to nothing; "
            "check sample_filter / the algorithm's dynamic sampling (e.g. make_scalerl(dynamic_sampling=False))"
        )
