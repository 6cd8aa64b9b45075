"""Credit assignment: rollouts -> one scalar weight per (rollout_id, step_index).

An algorithm's CreditAssigner decides *how much* each step's action is pushed up or down;
the Loss decides *how* (REINFORCE, clipped surrogate, CISPO...). Grouped assigners compare
rollouts that answered the same prompt: they group by ``rollout.meta["group_id"]`` and
require exactly ``group_size`` rollouts per group.

Every step of a rollout gets the same weight under the grouped assigners (outcome reward);
MonteCarloReturn gives step t the discounted return from t onwards.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from libludic.types import Rollout, RolloutStepKey

# [partial sums of this shard] -> the same sums over every data-parallel rank's shard
# (identity on one process)
SumFn = Callable[[list[float]], list[float]]


@runtime_checkable
class CreditAssigner(Protocol):
    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]: ...


def group_rollouts(rollouts: Sequence[Rollout], group_size: int) -> OrderedDict[str, list[Rollout]]:
    """Rollouts by group_id, in first-seen order; every group must hold ``group_size``.

    With ``group_size == 1`` a rollout without a group_id is its own group.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    groups: OrderedDict[str, list[Rollout]] = OrderedDict()
    for r in rollouts:
        gid = r.group_id
        if gid is None:
            if group_size != 1:
                raise ValueError(
                    f"Rollout {r.id} has no group_id in meta; set RolloutRequest.meta"
                    '["group_id"] (one id per prompt) or use group_size=1'
                )
            gid = f"__single__:{r.id}"
        groups.setdefault(gid, []).append(r)
    for gid, rs in groups.items():
        if len(rs) != group_size:
            raise ValueError(
                f"group {gid!r} has {len(rs)} rollouts (ids {[r.id for r in rs]}) but "
                f"group_size={group_size}; send num_episodes=group_size per group and only "
                "assign credit to complete groups"
            )
    return groups


def _broadcast(rollout: Rollout, value: float, out: dict[RolloutStepKey, float]) -> None:
    for s in rollout.steps:
        out[(rollout.id, s.index)] = float(value)


@dataclass
class MonteCarloReturn:
    """G_t = sum_{k>=0} gamma^k r_{t+k} over the steps of each rollout (REINFORCE)."""

    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"MonteCarloReturn.gamma={self.gamma} must be in [0, 1]")

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in rollouts:
            g = 0.0
            for s in reversed(r.steps):
                g = float(s.reward) + self.gamma * g
                out[(r.id, s.index)] = g
        return out


@dataclass
class GroupNormalizedReturn:
    """A_i = R_i - mean_{j in group}(R_j)  (GRPO; Dr. GRPO without the std division).

    ``normalize_adv=True`` divides by the group's population std: A_i / (std + 1e-8).
    ``positive_only=True`` clips to max(A_i, 0). R_i is the rollout's total reward.
    """

    group_size: int
    normalize_adv: bool = False
    positive_only: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"GroupNormalizedReturn.group_size={self.group_size} must be >= 1")

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for rs in group_rollouts(rollouts, self.group_size).values():
            rewards = [r.total_reward for r in rs]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
            for r, x in zip(rs, rewards, strict=True):
                a = x - mean
                if self.normalize_adv:
                    a = a / (std + 1e-8)
                if self.positive_only:
                    a = max(a, 0.0)
                _broadcast(r, a, out)
        return out


@dataclass
class HybridNormalizedReturn:
    """ScaleRL's hybrid normalisation: group-mean centring, batch-level std scaling.

    c_i = R_i - mean_{j in group(i)}(R_j);   A_i = c_i / (std_batch(c) + eps)

    where std_batch is the population std of the centred rewards over the whole training
    batch, so the advantages have unit std across the batch while each group stays centred.
    ``positive_only=True`` clips to max(A_i, 0) (after the scaling, whose std is taken over
    the unclipped c).

    Two stages. ``group_stage`` needs only whole groups (c_i); ``batch_stage`` needs the
    whole batch (std_batch and the clip). ``compute`` runs both and treats the rollouts of
    the call as the batch (the in-process path: RolloutBatchSource/RolloutEngine credit one
    training batch per call). The services' credit worker sees one group at a time, so it
    runs ``group_stage`` only (``RLAlgorithm.to_saw_items(..., defer_batch_stage=True)``)
    and the Trainer runs ``batch_stage`` over exactly the items of each optimizer step
    (``RLAlgorithm.apply_batch_stage``): std_batch is then over those items.
    """

    group_size: int
    eps: float = 1e-8
    positive_only: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"HybridNormalizedReturn.group_size={self.group_size} must be >= 1")
        if self.eps <= 0:
            raise ValueError(f"HybridNormalizedReturn.eps={self.eps} must be > 0")

    def _centred(self, rollouts: list[Rollout]) -> list[tuple[Rollout, float]]:
        out: list[tuple[Rollout, float]] = []
        for rs in group_rollouts(rollouts, self.group_size).values():
            rewards = [r.total_reward for r in rs]
            mean = sum(rewards) / len(rewards)
            out.extend((r, x - mean) for r, x in zip(rs, rewards, strict=True))
        return out

    def group_stage(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        """c_i = R_i - mean of its group, broadcast to every step (no std, no clip)."""
        out: dict[RolloutStepKey, float] = {}
        for r, c in self._centred(rollouts):
            _broadcast(r, c, out)
        return out

    def batch_stage(self, centred: Sequence[float], all_sum: SumFn | None = None) -> list[float]:
        """A = c / (std(c) + eps), clipped at 0 with ``positive_only``.

        ``all_sum`` extends the count and the sums over the other data-parallel ranks'
        shards of the batch (default: ``centred`` is the whole batch).
        """
        cs = [float(c) for c in centred]
        red: SumFn = all_sum if all_sum is not None else (lambda xs: xs)
        n, total = red([float(len(cs)), sum(cs)])
        if n <= 0:
            return []
        mu = total / n  # ~0, kept for exactness with float rounding
        (ss,) = red([sum((c - mu) ** 2 for c in cs)])
        std = math.sqrt(ss / n)
        out = [c / (std + self.eps) for c in cs]
        return [max(a, 0.0) for a in out] if self.positive_only else out

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        centred = self._centred(rollouts)  # std over rollouts: one c per rollout
        out: dict[RolloutStepKey, float] = {}
        for (r, _), a in zip(centred, self.batch_stage([c for _, c in centred]), strict=True):
            _broadcast(r, a, out)
        return out


@dataclass
class ConstantCredit:
    """weight = value for every step (SFT, behaviour cloning)."""

    value: float = 1.0

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in rollouts:
            _broadcast(r, self.value, out)
        return out
