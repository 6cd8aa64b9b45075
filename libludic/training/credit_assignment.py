"""Credit assignment: rollouts -> one scalar weight per (rollout_id, step_index).

An algorithm's CreditAssigner decides *how much* each step's action is pushed up or down;
the Loss decides *how* (REINFORCE, clipped surrogate, CISPO...). Grouped assigners compare
rollouts that answered the same prompt: they group by ``rollout.meta["group_id"]`` and
require exactly ``group_size`` rollouts per group.

Every step of a rollout gets the same weight under the grouped assigners (outcome reward);
MonteCarloReturn gives step t the discounted return from t onwards. GroupNormalizedReturn
(GRPO) and HybridNormalizedReturn (ScaleRL) are fixed normalisations; NormalizedReturn
takes AReaL's ``reward_norm`` / ``adv_norm`` (libludic.training.normalization).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from libludic.training.normalization import (
    NormConfig,
    SumFn,
    apply_batch_ops,
    apply_group_ops,
    split_chain,
)
from libludic.types import Rollout, RolloutStepKey


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
    the call as the batch. ``RLAlgorithm.to_saw_items`` runs ``group_stage``, makes the
    items, filters them and runs ``batch_stage`` over the items of the call, or, in the
    services' credit worker, which sees one group at a time, leaves ``batch_stage`` to the
    Trainer on exactly the items of each optimizer step (``RLAlgorithm.apply_batch_stage``).
    Either way std_batch counts one value per rollout: each item is weighted 1 / (its
    rollout's items in the batch).
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

    def batch_stage(
        self,
        centred: Sequence[float],
        all_sum: SumFn | None = None,
        weights: Sequence[float] | None = None,
    ) -> list[float]:
        """A = c / (std(c) + eps), clipped at 0 with ``positive_only``.

        ``weights`` (default 1 each) count each value in the std: 1 / (items of its
        rollout) when the values are items. ``all_sum`` extends the count and the sums over
        the other data-parallel ranks' shards of the batch (default: ``centred`` is the
        whole batch).
        """
        cs = [float(c) for c in centred]
        ws = [1.0] * len(cs) if weights is None else [float(w) for w in weights]
        red: SumFn = all_sum if all_sum is not None else (lambda xs: xs)
        n, total = red([sum(ws), sum(w * c for w, c in zip(ws, cs, strict=True))])
        if n <= 0:
            return []
        mu = total / n  # ~0, kept for exactness with float rounding
        (ss,) = red([sum(w * (c - mu) ** 2 for w, c in zip(ws, cs, strict=True))])
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
class NormalizedReturn:
    """A_i = adv_norm(reward_norm(R))_i, broadcast to every step of rollout i.

    R_i is the rollout's total reward; ``reward_norm`` and ``adv_norm`` are AReaL's
    ``NormConfig`` (libludic.training.normalization: group or batch mean, leave-one-out
    mean, group or batch std, biased or unbiased, eps), either may be None (no-op), over
    one value per rollout. ``positive_only=True`` clips to max(A_i, 0) at the end.

    Group-level statistics run in ``group_stage`` (whole groups, the credit worker);
    batch-level ones in ``batch_stage`` when there are any (``needs_batch_stage``), as for
    HybridNormalizedReturn. A group-level statistic after a batch-level one is refused.
    """

    group_size: int
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    positive_only: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"NormalizedReturn.group_size={self.group_size} must be >= 1")
        chain = [
            (n, c)
            for n, c in (("reward_norm", self.reward_norm), ("adv_norm", self.adv_norm))
            if c is not None
        ]
        self._group_ops, self._batch_ops = split_chain(chain)

    @property
    def needs_batch_stage(self) -> bool:
        return bool(self._batch_ops)

    def _grouped(self, rollouts: list[Rollout]) -> tuple[list[Rollout], list[float]]:
        rs: list[Rollout] = []
        index: list[list[int]] = []
        for g in group_rollouts(rollouts, self.group_size).values():
            index.append(list(range(len(rs), len(rs) + len(g))))
            rs.extend(g)
        values = apply_group_ops([r.total_reward for r in rs], index, self._group_ops)
        return rs, values

    def _clip(self, values: list[float]) -> list[float]:
        return [max(a, 0.0) for a in values] if self.positive_only else values

    def group_stage(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        """The group-level part, broadcast to every step (no batch statistic, no clip)."""
        rs, values = self._grouped(rollouts)
        out: dict[RolloutStepKey, float] = {}
        for r, v in zip(rs, values, strict=True):
            _broadcast(r, v, out)
        return out

    def batch_stage(
        self,
        values: Sequence[float],
        all_sum: SumFn | None = None,
        weights: Sequence[float] | None = None,
    ) -> list[float]:
        """The batch-level part over ``values`` (each counted with its weight; default 1)
        and, across data-parallel ranks, ``all_sum``; then ``positive_only``."""
        ws = [1.0] * len(values) if weights is None else list(weights)
        return self._clip(apply_batch_ops(values, ws, self._batch_ops, all_sum))

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        rs, values = self._grouped(rollouts)
        out: dict[RolloutStepKey, float] = {}
        for r, a in zip(rs, self.batch_stage(values), strict=True):
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
