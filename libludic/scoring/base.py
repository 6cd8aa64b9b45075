"""Reward functions: what they are given, how they are built and how their scores compose.

A reward function scores one rollout: ``fn(sample: RewardInput, **kwargs) -> float``, sync or
async, or a class whose instances are such a callable (built once with the kwargs). A task's
``RewardSpec`` composes them with the env's reward::

    r = env_weight * r_env + sum_i weight_i * f_i(sample)

``apply_rewards`` scales every step's reward by ``env_weight`` and adds the weighted sum to
the rollout's last step; the unweighted scores go to that step's ``info["reward_fns"]``. A
function that raises, returns a non-number or times out fails the episode with a
``RewardError`` (the actor dead-letters the request with reason ``reward_error``).

A function (or instance) is built once per process and called for every rollout, several
at once: it keeps no per-episode state. A sync function runs on the event loop; a slow one
should be async (or hand its work to a thread) so the other episodes keep going. A function
or class that takes a ``client`` parameter is given the run's own ChatClient (the inference
the actor samples from) unless its kwargs set ``client`` themselves.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from libludic import plugins
from libludic.plugins import PluginError
from libludic.requests import RewardFnSpec, RewardSpec
from libludic.types import Rollout

ScoreFn = Callable[["RewardInput"], Awaitable[float]]


class RewardError(RuntimeError):
    """A reward function failed on a rollout (after its retries, if it has any)."""


@dataclass(frozen=True)
class RewardInput:
    """What a reward function is given for one rollout (one agent's view of an episode).

    ``prompt``: the first observation the agent saw; ``completion``: its last reply as the
    model wrote it; ``answer``: that reply's parsed action (None: it did not parse);
    ``env_reward``: the rollout's total reward before any reward function (env + parser);
    ``info``: the last step's info (what the env returned, e.g. its reference answer);
    ``rollout``: every step and the meta (``task``, ``env_seed``, ``agent_id``, ...).
    """

    prompt: str
    completion: str
    answer: str | None
    env_reward: float
    info: Mapping[str, Any]
    rollout: Rollout = field(repr=False)

    @property
    def task(self) -> str | None:
        t = self.rollout.meta.get("task")
        return None if t is None else str(t)

    @property
    def agent_id(self) -> str | None:
        a = self.rollout.meta.get("agent_id")
        return None if a is None else str(a)

    @classmethod
    def of(cls, rollout: Rollout) -> RewardInput:
        first, last = rollout.steps[0], rollout.steps[-1]
        answer = last.info.get("parsed_action")
        return cls(
            prompt=str(first.prev_obs),
            completion=str(last.action),
            answer=None
            if last.info.get("parse_error")
            else (None if answer is None else str(answer)),
            env_reward=rollout.total_reward,
            info=dict(last.info),
            rollout=rollout,
        )


def _takes(target: Any, name: str) -> bool:
    try:
        return name in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def build_reward_fn(spec: RewardFnSpec, client: Any = None, where: str = "reward") -> ScoreFn:
    """The coroutine function scoring one RewardInput with ``spec``'s function (resolved
    through libludic.plugins, kwargs checked against its signature)."""
    label = f"{where}.functions[{spec.name}]"
    target = plugins.resolve("rewards", spec.kind, where=f"{label}.kind")
    kwargs = dict(spec.kwargs)
    if _takes(target, "client") and "client" not in kwargs:
        kwargs["client"] = client
    if inspect.isclass(target):
        plugins.check_kwargs(target, kwargs, where=f"{label} ({spec.kind})")
        fn = plugins.call(target, f"{label} ({spec.kind})", **kwargs)
        if not callable(fn):
            raise PluginError(f"{label}.kind={spec.kind!r}: its instances are not callable")
        call: Callable[[RewardInput], Any] = fn
    elif callable(target):
        names, _ = plugins.parameters(target)
        if not names:
            raise PluginError(
                f"{label}.kind={spec.kind!r} takes no argument; a reward function is "
                "fn(sample, **kwargs) -> float"
            )
        plugins.check_kwargs(target, kwargs, where=f"{label} ({spec.kind})", injected=names[:1])

        def call(sample: RewardInput) -> Any:
            return target(sample, **kwargs)
    else:
        raise PluginError(f"{label}.kind={spec.kind!r} names {target!r}, not a function or class")

    async def score(sample: RewardInput) -> float:
        try:
            out = call(sample)
            if inspect.isawaitable(out):
                out = await out
        except RewardError:
            raise
        except Exception as e:  # a user's function: its failure fails the episode, named
            raise RewardError(
                f"reward function {spec.name} ({spec.kind}) raised {type(e).__name__}: {e}"
            ) from e
        if isinstance(out, bool) or not isinstance(out, int | float) or not math.isfinite(out):
            raise RewardError(
                f"reward function {spec.name} ({spec.kind}) returned {out!r}; it must return a "
                "finite number"
            )
        return float(out)

    return score


async def apply_rewards(
    rollouts: Sequence[Rollout], spec: RewardSpec, fns: Mapping[str, ScoreFn]
) -> None:
    """Compose ``spec``'s functions (``fns``: name -> built function) with the env's reward
    in place (module docstring). Rollouts without steps are left alone."""

    async def one(ro: Rollout) -> None:
        if not ro.steps:
            return
        sample = RewardInput.of(ro)
        scores = await asyncio.gather(*(fns[f.name](sample) for f in spec.functions))
        total = sum(f.weight * s for f, s in zip(spec.functions, scores))
        if spec.env_weight != 1.0:
            for st in ro.steps:
                st.reward *= spec.env_weight
        last = ro.steps[-1]
        last.reward += total
        last.info["reward_fns"] = {f.name: s for f, s in zip(spec.functions, scores)}

    await asyncio.gather(*(one(ro) for ro in rollouts))
