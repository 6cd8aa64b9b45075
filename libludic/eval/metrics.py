"""The evaluation figures, one definition each, as pure functions over rollouts.

The unit is a Rollout: one agent's episode (a multi-agent env gives one per role that
acted, ``meta["agent_id"]``). Its env return is the env's score, ``R = sum_t env_reward_t``
(``step.info["env_reward"]``; ``step.reward`` for a step without it); its total reward
``G = sum_t reward_t`` adds the parser's format reward (what training's reward_mean
reports). With threshold ``tau`` and ``pass_e = [R_e >= tau]`` (a pass is the task solved,
whatever the format penalties on the way), over rollouts ``e``:

    pass_rate            = mean_e pass_e
    reward_mean          = mean_e G_e
    episode_len_mean     = mean_e |steps_e|          (model calls: moves, retries, tool calls)
    parse_error_rate     = sum_e #{t: info_t["parse_error"]} / sum_e |steps_e|
    illegal_rate         = mean_e [some step's info has a truthy flag in ILLEGAL_FLAGS]
    truncated_rate_<r>   = mean_e [last step truncated, info["truncation_reason"] == r]
                           (r in TRUNCATION_REASONS; "env": the env cut it, no reason given)
    truncated_rate       = sum_r truncated_rate_<r>
    num_episodes         = #rollouts

From ``k`` sampled episodes per problem ``p`` (``meta["problem"]``, else the env seed):

    pass_at_k    = mean_p [max_j pass_{p,j}]     (n = k samples: the unbiased estimator
    mean_at_k    = mean_p mean_j pass_{p,j}       1 - C(n-c, k)/C(n, k) is this indicator)

Per role (``<figure>/<role>``): the same over that role's rollouts only, a role's pass being
its own return >= tau; without a role suffix a multi-agent figure averages over every
(episode, role) rollout, and pass_at_k over every (problem, role). A role that did not act in
an episode has no rollout there: its figures are over the episodes where it acted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from libludic.types import Rollout

# info flags by which an env marks an illegal/invalid action (tic_tac_toe: "illegal",
# TextArena: "invalid_move", examples/custom_env: "bad_guess"); a user's env sets "illegal"
ILLEGAL_FLAGS = ("illegal", "invalid_move", "bad_guess")
# why an episode was cut short (libludic/interaction/base.py truncate), "env": by the env
TRUNCATION_REASONS = ("max_steps", "context_length", "parse_error", "env")
Figures = dict[str, float]
# every figure's name (a role's adds "/<role>")
FIGURES = (
    "pass_rate",
    "reward_mean",
    "episode_len_mean",
    "parse_error_rate",
    "illegal_rate",
    "truncated_rate",
    *(f"truncated_rate_{r}" for r in TRUNCATION_REASONS),
    "num_episodes",
    "pass_at_k",
    "mean_at_k",
    "num_problems",
)


def env_return(rollout: Rollout) -> float:
    """``R = sum_t env_reward_t`` (the parser's format reward left out)."""
    return float(sum(s.info.get("env_reward", s.reward) for s in rollout.steps))


def passed(rollout: Rollout, pass_threshold: float = 1.0) -> bool:
    return env_return(rollout) >= pass_threshold


def illegal(rollout: Rollout) -> bool:
    """Whether some step's info holds a truthy flag of :data:`ILLEGAL_FLAGS`."""
    return any(s.info.get(f) for s in rollout.steps for f in ILLEGAL_FLAGS)


def truncation(rollout: Rollout) -> str | None:
    """Why the episode was cut short (a :data:`TRUNCATION_REASONS` entry), None if not."""
    if not rollout.steps or not rollout.steps[-1].truncated:
        return None
    reason = rollout.steps[-1].info.get("truncation_reason")
    return reason if reason in TRUNCATION_REASONS else "env"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def episode_figures(rollouts: Sequence[Rollout], pass_threshold: float = 1.0) -> Figures:
    """Every rollout-level figure of the module docstring, over ``rollouts`` (empty: 0.0
    each, num_episodes 0)."""
    calls = sum(r.length for r in rollouts)
    errors = sum(1 for r in rollouts for s in r.steps if s.info.get("parse_error"))
    cut = [truncation(r) for r in rollouts]
    out: Figures = {
        "pass_rate": _mean([float(passed(r, pass_threshold)) for r in rollouts]),
        "reward_mean": _mean([r.total_reward for r in rollouts]),
        "episode_len_mean": _mean([float(r.length) for r in rollouts]),
        "parse_error_rate": errors / calls if calls else 0.0,
        "illegal_rate": _mean([float(illegal(r)) for r in rollouts]),
        "truncated_rate": _mean([float(c is not None) for c in cut]),
    }
    for reason in TRUNCATION_REASONS:
        out[f"truncated_rate_{reason}"] = _mean([float(c == reason) for c in cut])
    out["num_episodes"] = float(len(rollouts))
    return out


def problem_of(rollout: Rollout) -> Any:
    """The problem a sampled episode belongs to: ``meta["problem"]``, else its env seed."""
    meta = rollout.meta
    if "problem" in meta:
        return meta["problem"]
    if meta.get("env_seed") is None:
        raise ValueError(
            f"rollout {rollout.id} names no problem: set meta['problem'] (or env_seed) on its "
            "request to score pass@k"
        )
    return meta["env_seed"]


def at_k_figures(samples: Sequence[Rollout], pass_threshold: float = 1.0) -> Figures:
    """``pass_at_k``, ``mean_at_k`` and ``num_problems`` over sampled rollouts, grouped by
    (problem, role)."""
    groups: dict[tuple[Any, Any], list[bool]] = {}
    for r in samples:
        key = (problem_of(r), r.meta.get("agent_id"))
        groups.setdefault(key, []).append(passed(r, pass_threshold))
    return {
        "pass_at_k": _mean([float(any(g)) for g in groups.values()]),
        "mean_at_k": _mean([_mean([float(x) for x in g]) for g in groups.values()]),
        "num_problems": float(len({p for p, _ in groups})),
    }


def roles_of(rollouts: Iterable[Rollout]) -> list[str]:
    """The distinct ``meta["agent_id"]`` values, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in rollouts:
        role = r.meta.get("agent_id")
        if role is not None:
            seen.setdefault(str(role), None)
    return list(seen)


def set_figures(
    greedy: Sequence[Rollout],
    samples: Sequence[Rollout] = (),
    *,
    pass_threshold: float = 1.0,
    roles: Sequence[str] | None = None,
) -> Figures:
    """An eval set's figures: :func:`episode_figures` of the greedy rollouts,
    :func:`at_k_figures` of the sampled ones (when there are any), and both again per role as
    ``<figure>/<role>`` when there are several roles (``roles``: the protocol's; None: those
    the rollouts carry). A role with no rollout reports ``num_episodes/<role>`` 0 only."""
    out = episode_figures(greedy, pass_threshold)
    if samples:
        out.update(at_k_figures(samples, pass_threshold))
    roles = list(roles) if roles is not None else roles_of([*greedy, *samples])
    if len(roles) < 2:
        return out
    for role in roles:
        mine = [r for r in greedy if str(r.meta.get("agent_id")) == role]
        if not mine:
            out[f"num_episodes/{role}"] = 0.0
            continue
        out.update({f"{k}/{role}": v for k, v in episode_figures(mine, pass_threshold).items()})
        sampled = [r for r in samples if str(r.meta.get("agent_id")) == role]
        if sampled:
            out.update({f"{k}/{role}": v for k, v in at_k_figures(sampled, pass_threshold).items()})
    return out
