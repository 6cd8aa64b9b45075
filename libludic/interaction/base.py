"""InteractionProtocol: runs one episode of agents in an env and returns rollouts.

A protocol returns one Rollout per agent that acted. Rules shared by the protocols:

* A reply that fails to parse does not step the env: the step gets the parser's penalty
  as reward, the parser's feedback as next observation, ``info["parse_error"]=True``,
  and the agent tries again (it counts against ``max_steps``).
* A step's reward is ``env_reward + parse_reward``; both are kept in ``info``.
* Tool calls made inside one ``act()`` become their own steps (``info["kind"]=
  "tool_call"``, reward 0) so every model call has a trace the trainer can use.
* Hitting ``max_steps`` before the env ends marks the last step ``truncated`` with
  ``info["truncation_reason"]="max_steps"``; a prompt that no longer fits the model's
  context (the server's ContextLengthExceeded) ends the episode the same way with
  ``"context_length"`` (on the first prompt it is the task's error and propagates).
* An env with an ``astep`` coroutine (CodeExecEnv: tests run in a worker thread) is
  stepped with it, so a slow step does not stall the other episodes of the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from libludic.agents.base_agent import AgentTurn
from libludic.envs.env import LudicEnv
from libludic.parsers import ParseResult
from libludic.types import Rollout, Step, StepOutcome


class InteractionProtocol(ABC):
    @abstractmethod
    async def run(
        self,
        env: LudicEnv[Any, Any, Any],
        *,
        max_steps: int,
        env_seed: int | None = None,
        sampling_seed: int | None = None,
    ) -> list[Rollout]: ...


def tool_steps(
    turns: list[AgentTurn], start_index: int, obs: str, agent_id: str | None
) -> list[Step]:
    """Steps for the tool-calling turns (all but the last) of one act()."""
    steps: list[Step] = []
    for turn in turns[:-1]:
        tool_obs = "\n".join(m["content"] for m in turn.tool_messages)
        steps.append(
            Step(
                index=start_index + len(steps),
                prev_obs=obs,
                action=turn.response.text,
                next_obs=tool_obs,
                reward=0.0,
                info={"kind": "tool_call", "finish_reason": turn.response.finish_reason},
                trace=turn.response.trace(),
                policy_version=turn.response.policy_version,
                agent_id=agent_id,
            )
        )
        obs = tool_obs
    return steps


def truncate(step: Step, reason: str) -> None:
    """Mark ``step`` as the last of an episode cut short, and why (``max_steps``,
    ``parse_error``, ``context_length``)."""
    step.truncated = True
    step.info["truncation_reason"] = reason


def action_info(parsed: ParseResult, turn: AgentTurn) -> dict[str, Any]:
    return {
        "kind": "action",
        "parse_error": not parsed.ok,
        "parse_reward": parsed.reward,
        "parsed_action": parsed.action,
        "finish_reason": turn.response.finish_reason,
    }


async def step_env(env: LudicEnv[Any, Any, Any], actions: dict[str, str]) -> dict[str, StepOutcome]:
    """``await env.astep(actions)`` when the env has it, else ``env.step(actions)``."""
    astep = getattr(env, "astep", None)
    if astep is not None:
        out: dict[str, StepOutcome] = await astep(actions)
        return out
    return env.step(actions)
