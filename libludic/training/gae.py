"""Generalised advantage estimation (GAE, Schulman et al. 2016) over the action tokens of
episodes: the learner's half of PPO's credit, where the items' rewards and the critic's
values meet.

Token-level MDP. An episode is the sequence of its action tokens, the completions of its
steps in step order (the state tokens between them, prompts and observations, are not
actions). Token t of an episode of T action tokens gets the reward r_t: 0, but at the last
action token of each step, which carries that step's reward (the item's ``weight``, which
the credit assigner ``StepReward`` writes: the step's shaped reward). With the critic's
value V_t = V(s_t) of the state each action token is sampled in:

    delta_t = r_t + gamma V_{t+1} - V_t        V_T = 0: nothing after the last action token
    A_t     = sum_{l >= 0} (gamma lambda)^l delta_{t+l} = delta_t + gamma lambda A_{t+1}
    R_t     = A_t + V_t                        the value targets (returns)

gamma = lambda = 1: A_t = sum_{s >= t} r_s - V_t, the return minus the baseline; lambda = 0:
A_t = delta_t, the one-step TD error. AReaL's names: ``discount`` (gamma), ``gae_lambda``.

:class:`GAE` computes it over the items of one optimizer step (``per_item``): the items of a
rollout (``meta["rollout_id"]``, in ``meta["step_index"]`` order) make one episode, an item
without a rollout id is one of its own. The episode ends after the last of its items in the
step: a multi-step rollout whose later steps were filtered out or are in another batch is
credited as if it ended there (no bootstrap from a state the step does not hold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from libludic.saw import SAWItem


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(A, R) of the module docstring for a batch of episodes.

    ``rewards``, ``values`` ``# [N, L]``: row n is an episode's action tokens in order,
    right-padded with zeros (a padded position adds delta = 0, so the episode's V_T is 0).
    Returns the advantages and the returns ``# [N, L]``, 0 on the padding. One pass from
    the last token back: L vector operations over the N episodes."""
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must both "
            "be [N, L]"
        )
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        adv[:, t] = next_adv
        next_value = values[:, t]
    return adv, adv + values


def _check_unit(name: str, x: object, what: str) -> None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not 0.0 <= x <= 1.0:
        raise ValueError(f"GAE {name}={x!r} must be a number in [0, 1] ({what})")


@dataclass(frozen=True)
class GAE:
    """GAE's two constants (module docstring): ``gamma`` (AReaL's ``discount``) and
    ``gae_lambda``, each in [0, 1]; AReaL's defaults, 1 and 1 (A_t = G_t - V_t)."""

    gamma: float = 1.0
    gae_lambda: float = 1.0

    def __post_init__(self) -> None:
        _check_unit("gamma", self.gamma, "the per-token discount, AReaL's discount")
        _check_unit("gae_lambda", self.gae_lambda, "0: one-step TD errors, 1: returns - V")

    @torch.no_grad()
    def per_item(
        self, items: Sequence[SAWItem], values: Sequence[Tensor]
    ) -> list[tuple[Tensor, Tensor]]:
        """(A, R) ``# [n_i]`` of every item, each over its n_i action tokens in order.

        ``values[i]`` ``# [n_i]``: the critic's V at ``items[i]``'s action tokens. The
        episodes are the items' rollouts (module docstring); each item's reward, its
        ``weight``, is r at its last action token."""
        if len(items) != len(values):
            raise ValueError(f"{len(values)} value vectors for {len(items)} items")
        episodes: dict[object, list[int]] = {}
        for i, it in enumerate(items):
            rid = it.meta.get("rollout_id")
            episodes.setdefault(("item", i) if rid is None else str(rid), []).append(i)
        rows = [
            sorted(ix, key=lambda i: int(items[i].meta.get("step_index", 0)))
            for ix in episodes.values()
        ]
        lengths = [sum(int(values[i].numel()) for i in row) for row in rows]
        n, width = len(rows), max(lengths, default=0)
        r = torch.zeros(n, max(width, 1), dtype=torch.float32)
        v = torch.zeros_like(r)
        for e, row in enumerate(rows):
            at = 0
            for i in row:
                k = int(values[i].numel())
                if k == 0:  # no action token (an inert item): nothing to credit
                    continue
                v[e, at : at + k] = values[i].detach().to(torch.float32).cpu()
                r[e, at + k - 1] = float(items[i].weight)
                at += k
        adv, ret = gae(r, v, float(self.gamma), float(self.gae_lambda))
        out: list[tuple[Tensor, Tensor]] = [(torch.zeros(0), torch.zeros(0))] * len(items)
        for e, row in enumerate(rows):
            at = 0
            for i in row:
                k = int(values[i].numel())
                out[i] = (adv[e, at : at + k].clone(), ret[e, at : at + k].clone())
                at += k
        return out
