"""PPO's critic loss: the clipped value loss over the action tokens of a collated batch.

What the Trainer puts in the batch for a loss that ``requires`` ``values``
(libludic/training/step.py, with the critic of libludic/training/critic.py), every tensor on
the shifted grid ``# [B, T-1]`` of libludic/training/loss.py (position t: the state that
samples token t+1), 0 off the action tokens:

    values      V(s_t): the critic's forward in this micro-batch, with grad
    old_values  V_old(s_t): the critic's no-grad forward before the step's first update
    returns     R_t = A_t + V_old(s_t), GAE's targets (libludic/training/gae.py)
    advantages  A_t, read by the policy's ratio loss (``loss.ADVANTAGES_KEY``)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from libludic.training.loss import (
    ADVANTAGES_KEY,
    LossInputs,
    Stats,
    _check_agg,
    aggregate,
    masked_mean,
    token_mask,
)
from libludic.training.typecheck import checked_loss

VALUES_KEY = "values"
OLD_VALUES_KEY = "old_values"
RETURNS_KEY = "returns"
__all__ = ["ADVANTAGES_KEY", "OLD_VALUES_KEY", "RETURNS_KEY", "VALUES_KEY", "ClippedValueLoss"]


@dataclass
class ClippedValueLoss:
    """PPO's clipped value loss (PPO2's, AReaL's ``ppo_critic_loss_fn``), per action token:

        V_clip = V_old + clip(V - V_old, -value_eps_clip, value_eps_clip)
        l_bt   = 1/2 max((V - R)^2, (V_clip - R)^2)
        L      = agg(l)                    (``aggregation``, as the policy losses')

    The max keeps the clipped error where it is the larger: once V has moved more than
    ``value_eps_clip`` from V_old, away from the target, that token passes no gradient.
    ``value_eps_clip`` None: no clipping, l = 1/2 (V - R)^2. AReaL's default for its
    critic's ``eps_clip``: 0.5. Stats, means over action tokens: ``value_mean`` (V),
    ``return_mean`` (R) and ``clip_frac``, the share of tokens whose clipped error is the
    larger. ``logits`` are not read: the values come from the critic (module docstring)."""

    value_eps_clip: float | None = 0.5
    aggregation: str = "token-mean"
    max_new_tokens: int | None = None  # C of aggregation "seq-mean-token-sum-norm"
    requires: ClassVar[LossInputs] = LossInputs(values=True)
    stat_keys: ClassVar[tuple[str, ...]] = ("loss", "value_mean", "return_mean", "clip_frac")

    def __post_init__(self) -> None:
        _check_agg(self)
        e = self.value_eps_clip
        if e is not None and (isinstance(e, bool) or not isinstance(e, int | float) or not e > 0):
            raise ValueError(
                f"ClippedValueLoss.value_eps_clip={e!r} must be a number > 0 (how far V may "
                "move from V_old before the error is clipped), or None for no clipping"
            )

    @checked_loss
    def compute(self, logits: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Stats]:
        missing = [k for k in (VALUES_KEY, OLD_VALUES_KEY, RETURNS_KEY) if k not in batch]
        if missing:
            raise KeyError(
                f"ClippedValueLoss needs batch {missing}: the critic's values and GAE's "
                "returns, which the Trainer puts there for an algorithm with a critic "
                "(make_ppo; RLAlgorithm.critic)"
            )
        v: Tensor = batch[VALUES_KEY].float()
        old = batch[OLD_VALUES_KEY].to(v)
        ret = batch[RETURNS_KEY].to(v)
        m = token_mask(batch, v.dtype)
        err = (v - ret) ** 2
        clipped = torch.zeros_like(m)
        if self.value_eps_clip is not None:
            e = float(self.value_eps_clip)
            err_clip = (old + (v - old).clamp(-e, e) - ret) ** 2
            clipped = (err_clip > err).to(v.dtype)
            err = torch.maximum(err, err_clip)
        loss = aggregate(0.5 * err, m, batch, self.aggregation, self.max_new_tokens)
        return loss, {
            "loss": loss.detach(),
            "value_mean": masked_mean(v, m),
            "return_mean": masked_mean(ret, m),
            "clip_frac": masked_mean(clipped, m),
        }
