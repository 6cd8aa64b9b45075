"""Credit assignment: rollouts -> one scalar weight per (rollout_id, step_index).

An algorithm's CreditAssigner decides *how much* each step's action is pushed up or down;
the Loss decides *how* (REINFORCE, clipped surrogate, CISPO...). Grouped assigners compare
rollouts that answered the same prompt: they group by ``rollout.meta["group_id"]`` and
require exactly ``group_size`` rollouts per group. GroupNormalizedReturn (GRPO) and
HybridNormalizedReturn (ScaleRL) are fixed normalisations; NormalizedReturn takes AReaL's
``reward_norm`` / ``adv_norm`` (libludic.training.normalization).

Per-step returns, keyword ``gamma`` of every assigner that reads rewards. Step t of
rollout i has the return

    G_{i,t} = sum_{k>=0} gamma^k r_{i,t+k}     gamma a number in [0, 1]
    G_{i,t} = R_i = sum_k r_{i,k}              gamma None: outcome credit, every step alike

MonteCarloReturn weighs step t by G_{i,t} (default gamma 1.0: the reward-to-go). The
grouped assigners (default gamma None) take every statistic over one value per rollout,
its episode return e_i = G_{i,0}, and apply each normalisation y -> (y - m_i) / d (m_i, d
from the e_j) to every step's return:

    A_{i,t} = (G_{i,t} - m_i) / d       GRPO: m_i = mean_{j in group} G_{j,0}, d = 1

With gamma = 1 and a reward on the last step only, G_{i,t} = R_i at every t: the weights of
gamma None. A penalty r_{i,s} moves G_{i,t} for t <= s only, so it weighs the steps that led
to it. ConstantCredit reads no reward; StepReward writes each step's own reward (PPO: the
learner turns it into advantages with the critic).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

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


@runtime_checkable
class StagedCreditAssigner(Protocol):
    """A credit assigner whose credit needs statistics over the whole training batch, in
    two stages: ``group_stage`` over whole groups (the credit worker, which sees one group
    at a time) and ``batch_stage`` over the values of exactly the items of one optimizer
    step (the learner; ``all_sum`` adds the other data-parallel ranks' shards, ``weights``
    counts each value, ``episodes`` are the values its statistics are taken over).
    ``needs_batch_stage`` False: this instance has no batch-level statistic and runs as a
    plain ``compute`` (NormalizedReturn with group-level norms only)."""

    @property
    def needs_batch_stage(self) -> bool: ...

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]: ...

    def group_stage(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]: ...

    def batch_stage(
        self,
        values: Sequence[float],
        all_sum: SumFn | None = None,
        weights: Sequence[float] | None = None,
        episodes: Sequence[float] | None = None,
    ) -> list[float]: ...


def staged(assigner: CreditAssigner) -> StagedCreditAssigner | None:
    """``assigner`` when it has a batch-level stage to run, else None. One with a
    ``batch_stage`` that lacks the rest of :class:`StagedCreditAssigner` is refused rather
    than run without its batch statistics."""
    if isinstance(assigner, StagedCreditAssigner):
        return assigner if assigner.needs_batch_stage else None
    if hasattr(assigner, "batch_stage"):
        missing = [n for n in ("needs_batch_stage", "group_stage") if not hasattr(assigner, n)]
        raise TypeError(
            f"{type(assigner).__name__} has batch_stage but no {' or '.join(missing)}: a "
            "two-stage credit assigner is a StagedCreditAssigner "
            "(libludic.training.credit_assignment)"
        )
    return None


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


def check_gamma(owner: str, gamma: float | None) -> None:
    """ValueError unless ``gamma`` is None or a number in [0, 1]."""
    if gamma is None:
        return
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0.0 <= gamma <= 1.0:
        raise ValueError(
            f"{owner}.gamma={gamma!r} must be a number in [0, 1] (the discount of the per-step "
            "returns G_t = sum_k gamma^k r_{t+k}) or null (every step gets the rollout's total "
            "reward)"
        )


def step_returns(rollout: Rollout, gamma: float | None) -> list[float]:
    """[G_0, ..., G_{T-1}] over ``rollout.steps`` in order: G_t = r_t + gamma G_{t+1}
    (G_T = 0); gamma None: R = sum_t r_t at every t."""
    if gamma is None:
        return [rollout.total_reward] * len(rollout.steps)
    out = [0.0] * len(rollout.steps)
    g = 0.0
    for t in reversed(range(len(rollout.steps))):
        g = float(rollout.steps[t].reward) + gamma * g
        out[t] = g
    return out


def episode_return(returns: Sequence[float]) -> float:
    """e = G_0, the value a rollout counts with in the group and batch statistics (0 for a
    rollout without steps)."""
    return float(returns[0]) if returns else 0.0


def _write(rollout: Rollout, values: Sequence[float], out: dict[RolloutStepKey, float]) -> None:
    for s, v in zip(rollout.steps, values, strict=True):
        out[(rollout.id, s.index)] = float(v)


def _broadcast(rollout: Rollout, value: float, out: dict[RolloutStepKey, float]) -> None:
    for s in rollout.steps:
        out[(rollout.id, s.index)] = float(value)


@dataclass
class MonteCarloReturn:
    """G_t = sum_{k>=0} gamma^k r_{t+k} over the steps of each rollout (REINFORCE).

    ``gamma`` (default 1.0, the reward-to-go) in [0, 1]; None weighs every step by the
    rollout's total reward R = sum_t r_t (REINFORCE with outcome credit)."""

    gamma: float | None = 1.0

    def __post_init__(self) -> None:
        check_gamma("MonteCarloReturn", self.gamma)

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in rollouts:
            _write(r, step_returns(r, self.gamma), out)
        return out


@dataclass
class GroupNormalizedReturn:
    """A_{i,t} = G_{i,t} - mean_{j in group}(G_{j,0})  (GRPO; Dr. GRPO without the std).

    G as in the module docstring: ``gamma`` None (default) gives G_{i,t} = R_i, the
    rollout's total reward, at every step (A_i = R_i - mean(R)); a number gives the
    discounted per-step return. ``normalize_adv=True`` divides by the population std of the
    group's G_{j,0}: A / (std + 1e-8). ``positive_only=True`` clips to max(A, 0).
    """

    group_size: int
    normalize_adv: bool = False
    positive_only: bool = False
    gamma: float | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"GroupNormalizedReturn.group_size={self.group_size} must be >= 1")
        check_gamma("GroupNormalizedReturn", self.gamma)

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for rs in group_rollouts(rollouts, self.group_size).values():
            returns = [step_returns(r, self.gamma) for r in rs]
            episodes = [episode_return(g) for g in returns]
            mean = sum(episodes) / len(episodes)
            std = math.sqrt(sum((x - mean) ** 2 for x in episodes) / len(episodes))
            for r, g in zip(rs, returns, strict=True):
                values = []
                for x in g:
                    a = x - mean
                    if self.normalize_adv:
                        a = a / (std + 1e-8)
                    if self.positive_only:
                        a = max(a, 0.0)
                    values.append(a)
                _write(r, values, out)
        return out


@dataclass
class HybridNormalizedReturn:
    """ScaleRL's hybrid normalisation: group-mean centring, batch-level std scaling.

    c_{i,t} = G_{i,t} - mean_{j in group(i)}(G_{j,0});   A_{i,t} = c_{i,t} / (std_batch(c_0) + eps)

    G as in the module docstring (``gamma`` None, the default: G_{i,t} = R_i, the total
    reward, so c_i = R_i - mean(R)); std_batch is the population std of the episodes'
    centred returns c_{i,0} over the whole training batch, so the episodes' advantages have
    unit std across the batch while each group stays centred. ``positive_only=True`` clips
    to max(A, 0) (after the scaling, whose std is taken over the unclipped c).

    Two stages. ``group_stage`` needs only whole groups (c); ``batch_stage`` needs the
    whole batch (std_batch and the clip). ``compute`` runs both and treats the rollouts of
    the call as the batch. ``RLAlgorithm.to_saw_items`` runs ``group_stage``, makes the
    items, filters them and runs ``batch_stage`` over the items of the call, or, in the
    services' credit worker, which sees one group at a time, leaves ``batch_stage`` to the
    Trainer on exactly the items of each optimizer step (``RLAlgorithm.apply_batch_stage``).
    Either way std_batch counts one value per rollout: each item is weighted 1 / (its
    rollout's items in the batch) and counts with its episode's c_0.
    """

    group_size: int
    eps: float = 1e-8
    positive_only: bool = False
    gamma: float | None = None

    needs_batch_stage: ClassVar[bool] = True  # std_batch is always a batch statistic

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"HybridNormalizedReturn.group_size={self.group_size} must be >= 1")
        if self.eps <= 0:
            raise ValueError(f"HybridNormalizedReturn.eps={self.eps} must be > 0")
        check_gamma("HybridNormalizedReturn", self.gamma)

    def _centred(self, rollouts: list[Rollout]) -> list[tuple[Rollout, float, list[float]]]:
        """(rollout, c_{i,0}, [c_{i,t}]) per rollout."""
        out: list[tuple[Rollout, float, list[float]]] = []
        for rs in group_rollouts(rollouts, self.group_size).values():
            returns = [step_returns(r, self.gamma) for r in rs]
            episodes = [episode_return(g) for g in returns]
            mean = sum(episodes) / len(episodes)
            out.extend(
                (r, e - mean, [x - mean for x in g])
                for r, e, g in zip(rs, episodes, returns, strict=True)
            )
        return out

    def group_stage(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        """c_{i,t} per step (no std, no clip); a rollout's first step holds its c_{i,0}."""
        out: dict[RolloutStepKey, float] = {}
        for r, _, cs in self._centred(rollouts):
            _write(r, cs, out)
        return out

    def _batch_std(
        self, episodes: Sequence[float], weights: Sequence[float], all_sum: SumFn | None
    ) -> float | None:
        """Population std of ``episodes`` counted with ``weights`` (None: no weight)."""
        red: SumFn = all_sum if all_sum is not None else (lambda xs: xs)
        es = [float(e) for e in episodes]
        ws = [float(w) for w in weights]
        n, total = red([sum(ws), sum(w * e for w, e in zip(ws, es, strict=True))])
        if n <= 0:
            return None
        mu = total / n  # ~0, kept for exactness with float rounding
        (ss,) = red([sum(w * (e - mu) ** 2 for w, e in zip(ws, es, strict=True))])
        return math.sqrt(ss / n)

    def _scale(self, cs: Sequence[float], std: float) -> list[float]:
        out = [float(c) / (std + self.eps) for c in cs]
        return [max(a, 0.0) for a in out] if self.positive_only else out

    def batch_stage(
        self,
        centred: Sequence[float],
        all_sum: SumFn | None = None,
        weights: Sequence[float] | None = None,
        episodes: Sequence[float] | None = None,
    ) -> list[float]:
        """A = c / (std(c_0) + eps), clipped at 0 with ``positive_only``.

        ``episodes`` (default ``centred``) are the c_{i,0} of each value's rollout, the
        population of the std; ``weights`` (default 1 each) count each of them: 1 / (items
        of its rollout) when the values are items. ``all_sum`` extends the count and the
        sums over the other data-parallel ranks' shards of the batch (default: ``centred``
        is the whole batch).
        """
        es = centred if episodes is None else episodes
        if len(es) != len(centred):
            raise ValueError(f"{len(es)} episode values for {len(centred)} values")
        ws = [1.0] * len(es) if weights is None else weights
        std = self._batch_std(es, ws, all_sum)
        return [] if std is None else self._scale(centred, std)

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        centred = self._centred(rollouts)  # std over rollouts: one c_0 per rollout
        std = self._batch_std([e for _, e, _ in centred], [1.0] * len(centred), None)
        out: dict[RolloutStepKey, float] = {}
        for r, _, cs in centred:
            _write(r, self._scale(cs, 0.0 if std is None else std), out)
        return out


@dataclass
class NormalizedReturn:
    """A_{i,t} = adv_norm(reward_norm(G))_{i,t}: each statistic over the episodes' G_{i,0}.

    G as in the module docstring (``gamma`` None, the default: G_{i,t} = R_i, the
    rollout's total reward at every step). ``reward_norm`` and ``adv_norm`` are AReaL's
    ``NormConfig`` (libludic.training.normalization: group or batch mean, leave-one-out
    mean, group or batch std, biased or unbiased, eps), either may be None (no-op), over
    one value per rollout, its episode return; each op's map (y - m_i) / d applies to every
    step of rollout i. ``positive_only=True`` clips to max(A, 0) at the end.

    Group-level statistics run in ``group_stage`` (whole groups, the credit worker);
    batch-level ones in ``batch_stage`` when there are any (``needs_batch_stage``), as for
    HybridNormalizedReturn. A group-level statistic after a batch-level one is refused.
    """

    group_size: int
    reward_norm: NormConfig | None = None
    adv_norm: NormConfig | None = None
    positive_only: bool = False
    gamma: float | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"NormalizedReturn.group_size={self.group_size} must be >= 1")
        check_gamma("NormalizedReturn", self.gamma)
        chain = [
            (n, c)
            for n, c in (("reward_norm", self.reward_norm), ("adv_norm", self.adv_norm))
            if c is not None
        ]
        self._group_ops, self._batch_ops = split_chain(chain)

    @property
    def needs_batch_stage(self) -> bool:
        return bool(self._batch_ops)

    def _grouped(
        self, rollouts: list[Rollout]
    ) -> tuple[list[Rollout], list[float], list[list[float]]]:
        """The rollouts in group order, their episode values and per-step values after the
        group-level ops."""
        rs: list[Rollout] = []
        index: list[list[int]] = []
        for g in group_rollouts(rollouts, self.group_size).values():
            index.append(list(range(len(rs), len(rs) + len(g))))
            rs.extend(g)
        returns = [step_returns(r, self.gamma) for r in rs]
        episodes = [episode_return(g) for g in returns]
        values, steps = apply_group_ops(episodes, index, self._group_ops, returns)
        return rs, values, steps

    def _clip(self, values: list[float]) -> list[float]:
        return [max(a, 0.0) for a in values] if self.positive_only else values

    def group_stage(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        """The group-level part per step (no batch statistic, no clip); a rollout's first
        step holds its episode value."""
        rs, _, steps = self._grouped(rollouts)
        out: dict[RolloutStepKey, float] = {}
        for r, vs in zip(rs, steps, strict=True):
            _write(r, vs, out)
        return out

    def batch_stage(
        self,
        values: Sequence[float],
        all_sum: SumFn | None = None,
        weights: Sequence[float] | None = None,
        episodes: Sequence[float] | None = None,
    ) -> list[float]:
        """The batch-level part over ``values``, its statistics over ``episodes`` (default
        ``values``: each value's episode value), each counted with its weight (default 1)
        and, across data-parallel ranks, ``all_sum``; then ``positive_only``."""
        es = values if episodes is None else episodes
        ws = [1.0] * len(es) if weights is None else list(weights)
        _, ys = apply_batch_ops(es, ws, self._batch_ops, all_sum, [[v] for v in values])
        return self._clip([y for (y,) in ys])

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        rs, values, steps = self._grouped(rollouts)
        _, ys = apply_batch_ops(values, [1.0] * len(values), self._batch_ops, None, steps)
        out: dict[RolloutStepKey, float] = {}
        for r, vs in zip(rs, ys, strict=True):
            _write(r, self._clip(vs), out)
        return out


@dataclass
class StepReward:
    """weight = r_{i,t}, the step's own (shaped) reward, nothing summed or normalised.

    PPO's credit (make_ppo): the advantages are the learner's, GAE over the critic's values
    at train time (libludic/training/gae.py), which reads each item's weight as the reward
    of its last action token. No ``gamma`` here: the discount is GAE's."""

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in rollouts:
            _write(r, [float(s.reward) for s in r.steps], out)
        return out


@dataclass
class ConstantCredit:
    """weight = value for every step (SFT, behaviour cloning): no reward, so no ``gamma``."""

    value: float = 1.0

    def compute(self, rollouts: list[Rollout]) -> dict[RolloutStepKey, float]:
        out: dict[RolloutStepKey, float] = {}
        for r in rollouts:
            _broadcast(r, self.value, out)
        return out
