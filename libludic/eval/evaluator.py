"""Evaluator: run held-out episodes through a rollout engine and score them.

Requests are run with ``ReturnSpec.for_eval()`` semantics (token ids, no logprobs: the
episodes are never trained on). :meth:`Evaluator.rollouts` returns the episodes;
:meth:`Evaluator.evaluate` reports, over them, with ``G_i`` the total reward and ``R_i``
the env return (the env's score, the parser's format reward left out) of
libludic/eval/metrics.py:

    eval/reward_mean = mean_i G_i
    eval/pass_rate   = mean_i [R_i >= pass_threshold]   (threshold 1.0: fully correct)
    eval/num_episodes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libludic.eval.metrics import episode_figures
from libludic.inference.request import InferenceSpec, ReturnSpec
from libludic.requests import RolloutRequest
from libludic.types import Rollout

Requests = Sequence[RolloutRequest] | Callable[[], Sequence[RolloutRequest]]


def as_eval_request(req: RolloutRequest) -> RolloutRequest:
    """A copy of ``req`` that asks only for token ids (``ReturnSpec.for_eval()``)."""
    inf = req.inference if req.inference is not None else InferenceSpec()
    inf = dataclasses.replace(inf, return_spec=ReturnSpec.for_eval())
    return RolloutRequest.from_dict({**req.to_dict(), "inference": inf.to_dict()})


@dataclass
class Evaluator:
    engine: Any  # has async generate_rollouts(requests, max_steps, concurrency)
    requests: Requests
    max_steps: int = 1
    concurrency: int | None = None  # None: the Trainer's eval_concurrency (or 32)
    pass_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.max_steps < 1 or (self.concurrency is not None and self.concurrency < 1):
            raise ValueError(
                f"Evaluator.max_steps={self.max_steps} and concurrency={self.concurrency} "
                "must be >= 1"
            )

    async def rollouts(self) -> list[Rollout]:
        """Every episode of the requests, in request order (at most ``max_steps`` turns)."""
        reqs = self.requests() if callable(self.requests) else self.requests
        reqs = [as_eval_request(r) for r in reqs]
        if not reqs:
            raise ValueError("Evaluator has no requests to run")
        rollouts: list[Rollout] = await self.engine.generate_rollouts(
            reqs, max_steps=self.max_steps, concurrency=self.concurrency or 32
        )
        return rollouts

    async def evaluate(self) -> dict[str, float]:
        fig = episode_figures(await self.rollouts(), self.pass_threshold)
        return {
            "eval/reward_mean": fig["reward_mean"],
            "eval/pass_rate": fig["pass_rate"],
            "eval/num_episodes": fig["num_episodes"],
        }
