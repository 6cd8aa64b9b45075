"""Reward / advantage normalisation: AReaL's ``NormConfig`` over one value per rollout.

A ``NormConfig`` centres, then scales::

    m_i = mean of x over i's group or the batch    (mean_level "group" | "batch" | None: 0)
          leave-one-out (mean_leave1out): the mean of the others, (S - x_i) / (n - 1)
    s   = sqrt(sum_j (x_j - m_j)^2 / (n - 1 if std_unbiased else n))   over std_level's set
    y_i = (x_i - m_i) / (s + eps)                   (std_level None: y_i = x_i - m_i, no eps)

with AReaL's edge cases: a leave-one-out mean over n <= 1 values is 0; an unbiased std over
n <= 1 values (or any std over none) is 1. A group is the rollouts sharing
``meta["group_id"]`` (the algorithm's ``group_size``), so AReaL's ``NormConfig.group_size``
is not a key here. Unlike AReaL's ``adv_norm``, which weighs every token, the population is
one value per rollout, in both the group and the batch statistics.

Batch statistics in the services. The credit worker sees one group at a time, so the ops of
a normalisation chain (``reward_norm`` then ``adv_norm``) are cut at the first batch-level
statistic: the ops before it run per group (``group_ops``), the rest on the training batch
(``batch_ops``, ``RLAlgorithm.apply_batch_stage``), where each item carries a weight and
the weights of one rollout's items sum to 1 (its value counts once however many steps it
has). A group-level statistic after a batch-level one cannot be computed there and is
refused when the chain is built.

Per-step values. Every op is an affine map y -> (y - m_i) / d whose m_i and d are computed
from the values above (one per rollout: its episode return, or one per item in the batch
stage). The same map is applied to the ``steps`` each value carries (its rollout's per-step
returns G_{i,t}; libludic.training.credit_assignment), so a step is normalised with its
rollout's statistics: y_{i,t} = (G_{i,t} - m_i) / d. A value carried as its own only step
(``steps`` unset) gets exactly the arithmetic it had without steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

LEVELS = ("batch", "group")

# [partial sums of this shard] -> the same sums over every data-parallel rank's shard
SumFn = Callable[[list[float]], list[float]]


def _level(name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    if value not in LEVELS:
        raise ValueError(f"{name}={value!r}; use 'batch', 'group' or null (off)")
    return str(value)


@dataclass(frozen=True)
class NormConfig:
    """AReaL's normalisation options and defaults (see the module docstring)."""

    mean_level: str | None = "batch"
    mean_leave1out: bool = False
    std_level: str | None = "batch"
    std_unbiased: bool = True
    eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean_level", _level("mean_level", self.mean_level))
        object.__setattr__(self, "std_level", _level("std_level", self.std_level))
        for name in ("mean_leave1out", "std_unbiased"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.eps, bool) or not isinstance(self.eps, int | float) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r} must be a number > 0")

    @classmethod
    def parse(cls, value: NormConfig | Mapping[str, Any], name: str) -> NormConfig:
        """A NormConfig from itself or a mapping (the YAML of ``reward_norm`` / ``adv_norm``);
        errors name ``name``'s key and the fix."""
        if isinstance(value, NormConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{name}={value!r} must be a mapping like {{mean_level: group, std_level: null}}"
            )
        if "group_size" in value:
            raise ValueError(
                f"{name}.group_size={value['group_size']!r}: a group is the rollouts sharing "
                "meta.group_id (algorithm.group_size); remove the key"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"{name} keys {unknown} are unknown; known: {known}")
        try:
            return cls(**dict(value))
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None


@dataclass(frozen=True)
class Centre:
    level: str
    leave1out: bool


@dataclass(frozen=True)
class Scale:
    level: str
    unbiased: bool
    eps: float


Op = Centre | Scale


def ops_of(cfg: NormConfig) -> list[tuple[str, Op]]:
    """The config's steps, each with the key that asked for it."""
    ops: list[tuple[str, Op]] = []
    if cfg.mean_level is not None:
        ops.append(("mean_level", Centre(cfg.mean_level, cfg.mean_leave1out)))
    if cfg.std_level is not None:
        ops.append(("std_level", Scale(cfg.std_level, cfg.std_unbiased, cfg.eps)))
    return ops


def split_chain(chain: Sequence[tuple[str, NormConfig]]) -> tuple[list[Op], list[Op]]:
    """(group_ops, batch_ops) of the named configs applied in order; ValueError when a
    group-level statistic follows a batch-level one."""
    group_ops: list[Op] = []
    batch_ops: list[Op] = []
    first_batch = ""
    for name, cfg in chain:
        for key, op in ops_of(cfg):
            if op.level == "batch":
                first_batch = first_batch or f"{name}.{key}='batch'"
                batch_ops.append(op)
            elif first_batch:
                raise ValueError(
                    f"{name}.{key}='group' comes after {first_batch}: a group statistic of "
                    "batch-normalised values is not computed (credit sees one group at a "
                    "time, the batch only at the learner); put the group-level "
                    "normalisation in reward_norm and the batch-level one after it"
                )
            else:
                group_ops.append(op)
    return group_ops, batch_ops


def _mean(x: float, n: float, total: float, leave1out: bool) -> float:
    if leave1out:
        return 0.0 if n <= 1 else (total - x) / (n - 1)
    return 0.0 if n <= 0 else total / n


def _std(n: float, sum_sq: float, unbiased: bool) -> float:
    if unbiased:
        return 1.0 if n <= 1 else math.sqrt(sum_sq / (n - 1))
    return 1.0 if n <= 0 else math.sqrt(sum_sq / n)


def _own_steps(values: list[float], steps: Sequence[Sequence[float]] | None) -> list[list[float]]:
    if steps is None:
        return [[v] for v in values]
    if len(steps) != len(values):
        raise ValueError(f"{len(steps)} step lists for {len(values)} values")
    return [[float(y) for y in s] for s in steps]


def apply_group_ops(
    values: Sequence[float],
    groups: Sequence[Sequence[int]],
    ops: Sequence[Op],
    steps: Sequence[Sequence[float]] | None = None,
) -> tuple[list[float], list[list[float]]]:
    """``ops`` (all group-level) on ``values``; ``groups`` partitions their indices.

    Returns (values, steps): ``steps[i]`` (default ``[values[i]]``) transformed with the
    statistics of value i's group and value i's own mean (leave-one-out)."""
    x = [float(v) for v in values]
    ys = _own_steps(x, steps)
    for op in ops:
        for g in groups:
            n = float(len(g))
            if isinstance(op, Centre):
                total = sum(x[i] for i in g)
                ms = [_mean(x[i], n, total, op.leave1out) for i in g]
                for i, m in zip(g, ms, strict=True):
                    x[i] -= m
                    ys[i] = [y - m for y in ys[i]]
            else:
                s = _std(n, sum(x[i] ** 2 for i in g), op.unbiased)
                for i in g:
                    x[i] /= s + op.eps
                    ys[i] = [y / (s + op.eps) for y in ys[i]]
    return x, ys


def apply_batch_ops(
    values: Sequence[float],
    weights: Sequence[float],
    ops: Sequence[Op],
    all_sum: SumFn | None = None,
    steps: Sequence[Sequence[float]] | None = None,
) -> tuple[list[float], list[list[float]]]:
    """``ops`` (all batch-level) on ``values``, each counted with its weight; ``all_sum``
    extends the sums over the other data-parallel ranks' shards (default: this is the
    whole batch). Returns (values, steps) as ``apply_group_ops``."""
    red: SumFn = all_sum if all_sum is not None else (lambda xs: xs)
    x = [float(v) for v in values]
    w = [float(v) for v in weights]
    ys = _own_steps(x, steps)
    for op in ops:
        if isinstance(op, Centre):
            n, total = red([sum(w), sum(wi * xi for wi, xi in zip(w, x, strict=True))])
            ms = [_mean(xi, n, total, op.leave1out) for xi in x]
            x = [xi - m for xi, m in zip(x, ms, strict=True)]
            ys = [[y - m for y in yi] for yi, m in zip(ys, ms, strict=True)]
        else:
            n, sum_sq = red([sum(w), sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))])
            s = _std(n, sum_sq, op.unbiased)
            x = [xi / (s + op.eps) for xi in x]
            ys = [[y / (s + op.eps) for y in yi] for yi in ys]
    return x, ys
