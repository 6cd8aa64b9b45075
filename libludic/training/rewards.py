"""Reward shaping before credit: DAPO's overlong penalty, then AReaL's scaling, bias, clip.

Per step (one model completion: AReaL's "sequence"), with r the step's reward, L the number
of completion tokens, L_max = ``max_new_tokens`` (the generation budget) and
L_c = ``overlong_tokens``::

    p  = min(-(L - (L_max - L_c)) / L_c * overlong_penalty_factor, 0)   (overlong_reward_penalty)
    r' = clip((r + p + reward_bias) * reward_scaling, -reward_clip, +reward_clip)

The penalty is 0 up to ``L_max - L_c`` tokens and falls linearly to
``-overlong_penalty_factor`` at ``L_max`` (DAPO's soft overlong punishment; AReaL's option
names and defaults: off, scaling 1, bias 0, clip 20). A rollout's total reward, what the
grouped credit assigners compare and what dynamic sampling tests for equality, is the sum
of its shaped step rewards, so ``reward_bias`` counts once per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from libludic.types import Rollout, Step


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class RewardShaping:
    """The reward transform of one algorithm (see the module docstring)."""

    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    overlong_reward_penalty: bool = False
    overlong_tokens: int | None = None
    overlong_penalty_factor: float | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("reward_scaling", "reward_bias", "reward_clip"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(f"{name}={v!r} must be a finite number")
        if self.reward_clip <= 0:
            raise ValueError(f"reward_clip={self.reward_clip!r} must be > 0 (the largest |reward|)")
        if not isinstance(self.overlong_reward_penalty, bool):
            raise ValueError(
                f"overlong_reward_penalty={self.overlong_reward_penalty!r} must be true or false"
            )
        if not self.overlong_reward_penalty:
            given = [
                n
                for n in ("overlong_tokens", "overlong_penalty_factor")
                if getattr(self, n) is not None
            ]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} set but overlong_reward_penalty is false; set "
                    "overlong_reward_penalty: true to apply the penalty, or remove them"
                )
            return
        n, c, f = self.overlong_tokens, self.max_new_tokens, self.overlong_penalty_factor
        if c is None:
            raise ValueError(
                "overlong_reward_penalty needs max_new_tokens (the generation budget: the "
                "actors' max_tokens), the length the penalty counts back from"
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= c:
            raise ValueError(
                f"overlong_tokens={n!r} must be an integer in [1, max_new_tokens={c}] (the "
                "tail of the budget that is penalised)"
            )
        if f is None or not _is_number(f) or not math.isfinite(f) or f < 0:
            raise ValueError(
                f"overlong_penalty_factor={f!r} must be a number >= 0 (the penalty at "
                "max_new_tokens)"
            )

    def overlong_penalty(self, n_tokens: int) -> float:
        """p(L) above: 0 when the penalty is off or L <= max_new_tokens - overlong_tokens."""
        if not self.overlong_reward_penalty:
            return 0.0
        assert self.overlong_tokens is not None and self.max_new_tokens is not None
        assert self.overlong_penalty_factor is not None
        exceed = n_tokens - (self.max_new_tokens - self.overlong_tokens)
        return min(-exceed / self.overlong_tokens * float(self.overlong_penalty_factor), 0.0)

    def step_reward(self, rollout_id: str, step: Step) -> float:
        """r' of one step; ValueError for a non-finite reward or a step without tokens
        when the overlong penalty needs its length."""
        r = float(step.reward)
        if not math.isfinite(r):
            raise ValueError(f"rollout {rollout_id} step {step.index} has a non-finite reward {r}")
        if self.overlong_reward_penalty:
            if step.trace is None:
                raise ValueError(
                    f"rollout {rollout_id} step {step.index} has no TokenTrace: the overlong "
                    "penalty needs the completion's length; request token ids "
                    "(ReturnSpec.for_rl()) or set overlong_reward_penalty: false"
                )
            r += self.overlong_penalty(len(step.trace.completion_token_ids))
        r = (r + self.reward_bias) * self.reward_scaling
        return max(-self.reward_clip, min(self.reward_clip, r))

    def apply(self, rollouts: Sequence[Rollout]) -> list[Rollout]:
        """Copies of ``rollouts`` whose step rewards are shaped (the inputs are unchanged)."""
        return [
            dataclasses.replace(
                r, steps=[dataclasses.replace(s, reward=self.step_reward(r.id, s)) for s in r.steps]
            )
            for r in rollouts
        ]
