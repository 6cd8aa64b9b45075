"""KL to a reference policy: Schulman's per-token estimators, and the KL as a penalty on the
reward (AReaL's ``kl_ctl``) rather than a loss term.

With lr = logp_ref - logp of a token sampled from pi (estimators of KL(pi || ref)):

    k1 = -lr,    k2 = lr^2 / 2,    k3 = exp(lr) - 1 - lr   (unbiased, always >= 0)

As a reward penalty (:class:`KLRewardPenalty`), every action token t of a sequence gets
r_t -= coeff * k_t with k taken at the loss's pi_old; with no critic and gamma = 1, the
return of token t, and so its advantage, carries the penalties of t and of every later
action token of the same sequence:

    A_bt = A_b - coeff * sum_{s >= t} m_bs k_bs        (m: the action-token mask)

The penalty is a constant of the update (no gradient): the policy is pushed towards the
reference through the advantages alone, as by any other reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """The per-token estimate of KL(pi || ref), lr = ``ref`` - ``logp`` (module docstring);
    any shape, elementwise."""
    lr = ref - logp
    if estimator == "k1":
        return -lr
    if estimator == "k2":
        return 0.5 * lr * lr
    if estimator == "k3":
        return torch.exp(lr) - 1.0 - lr
    raise ValueError(f"estimator={estimator!r}; use one of {list(KL_ESTIMATORS)}")


@dataclass(frozen=True)
class KLRewardPenalty:
    """``coeff`` x the KL estimate ``estimator`` of each action token, taken off the reward
    of that token and so off the advantage of it and of every earlier action token of its
    sequence (module docstring). ``stat_keys``: ``kl``, the mean estimate over action tokens."""

    coeff: float
    estimator: str = "k3"
    stat_keys: ClassVar[tuple[str, ...]] = ("kl",)

    def __post_init__(self) -> None:
        c = self.coeff
        number = isinstance(c, int | float) and not isinstance(c, bool)
        if not (number and math.isfinite(c) and c > 0):
            raise ValueError(
                f"KLRewardPenalty coeff={c!r} must be a number > 0 (the preset option kl_coeff, "
                "AReaL's kl_ctl); with no KL, leave the penalty out"
            )
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"KLRewardPenalty estimator={self.estimator!r}; use one of {list(KL_ESTIMATORS)}"
            )

    @torch.no_grad()
    def advantages(self, adv: Tensor, old: Tensor, ref: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        """(the penalised advantages A_bt [B, T-1], the estimates k_bt [B, T-1], 0 off the
        action tokens). ``adv`` [B, 1] (or [B, T-1]); ``old`` pi_old's logprobs, ``ref`` the
        reference's and ``m`` the action-token mask, all [B, T-1] on the shifted grid.
        Neither leaves a graph: both are constants of the update."""
        on, zero = m > 0, torch.zeros_like(old)
        # both 0 off the action tokens, whatever they hold there: lr = 0, so k = 0
        k = kl_estimate(
            torch.where(on, old, zero), torch.where(on, ref.to(old.dtype), zero), self.estimator
        )
        to_go = k.flip(-1).cumsum(-1).flip(-1)  # sum_{s >= t} k_bs
        return adv - self.coeff * to_go, k
