"""The multi-agent loop: every active agent acts (concurrently), then the env steps.

Each agent keeps its own context and produces its own Rollout. Rewards an agent
receives while it is not acting (e.g. the opponent's winning move) are added to that
agent's last step, so the episode's total reward per agent is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

from libludic.agents.base_agent import Agent
from libludic.agents.config import MakeAgent
from libludic.context.config import ContextSpec
from libludic.envs.env import LudicEnv
from libludic.inference.client import ContextLengthExceeded
from libludic.interaction.base import (
    InteractionProtocol,
    action_info,
    step_env,
    tool_steps,
    truncate,
)
from libludic.parsers import ParserSpec
from libludic.types import Rollout, Step


class MultiAgentProtocol(InteractionProtocol):
    def __init__(self, agents: dict[str, Agent], system_prompts: dict[str, str] | None = None):
        if not agents:
            raise ValueError("MultiAgentProtocol needs at least one agent")
        self.agents = agents
        self.system_prompts = system_prompts or {}

    async def run(
        self,
        env: LudicEnv[Any, Any, Any],
        *,
        max_steps: int,
        env_seed: int | None = None,
        sampling_seed: int | None = None,
    ) -> list[Rollout]:
        missing = [a for a in env.agent_ids if a not in self.agents]
        if missing:
            raise ValueError(
                f"no agent given for env roles {missing}; pass agents={{role: Agent}} for each"
            )
        first = env.reset(seed=env_seed)
        obs: dict[str, str] = {}
        for aid, agent in self.agents.items():
            agent.reset(self.system_prompts.get(aid, env.suggested_system_prompt))
            if aid in first:
                o, i = first[aid]
                obs[aid] = o
                agent.on_env_reset(o, i)
        steps: dict[str, list[Step]] = {aid: [] for aid in self.agents}
        ended = False
        for _t in range(max_steps):
            active = list(env.active_agents)
            if not active:
                ended = True
                break
            seeds = {
                a: None if sampling_seed is None else sampling_seed * 100 + k
                for k, a in enumerate(active)
            }
            try:
                results = await asyncio.gather(*(self.agents[a].act(seed=seeds[a]) for a in active))
            except ContextLengthExceeded:
                if not any(steps.values()):  # the first prompt does not fit: the task's error
                    raise
                for s in steps.values():
                    if s:
                        truncate(s[-1], "context_length")
                ended = True
                break
            actions: dict[str, str] = {}
            acted: dict[str, Step] = {}
            for aid, (_action, ainfo) in zip(active, results):
                parsed = ainfo["parsed"]
                turns = ainfo["turns"]
                steps[aid].extend(tool_steps(turns, len(steps[aid]), obs[aid], aid))
                final = turns[-1]
                sinfo = action_info(parsed, final)
                step = Step(
                    len(steps[aid]),
                    obs[aid],
                    final.response.text,
                    None,
                    parsed.reward,
                    info=sinfo,
                    trace=final.response.trace(),
                    policy_version=final.response.policy_version,
                    agent_id=aid,
                )
                steps[aid].append(step)
                if parsed.action is None:
                    fb = parsed.obs or "Invalid format."
                    step.next_obs = fb
                    sinfo["env_reward"] = 0.0
                    self.agents[aid].on_after_step(fb, {})
                    obs[aid] = fb
                else:
                    actions[aid] = parsed.action
                    acted[aid] = step
            if not actions:
                continue
            outcomes = await step_env(env, actions)
            for aid, out in outcomes.items():
                if aid not in self.agents:
                    continue
                if aid in acted:
                    st = acted[aid]
                    st.info.update(out.info)
                    st.info["env_reward"] = out.reward
                    st.reward += out.reward
                    st.next_obs = out.obs
                    st.terminated, st.truncated = out.terminated, out.truncated
                elif steps[aid]:
                    last = steps[aid][-1]
                    last.reward += out.reward
                    last.info["env_reward"] = last.info.get("env_reward", 0.0) + out.reward
                    last.terminated = last.terminated or out.terminated
                    last.truncated = last.truncated or out.truncated
                obs[aid] = out.obs
                if not (out.terminated or out.truncated):
                    self.agents[aid].on_after_step(out.obs, out.info)
            if outcomes and all(o.terminated or o.truncated for o in outcomes.values()):
                ended = True
                break
        if not ended:
            for aid in steps:
                if steps[aid]:
                    truncate(steps[aid][-1], "max_steps")
        return [Rollout(steps=s, meta={"agent_id": aid}) for aid, s in steps.items() if s]


def multi_agent(
    make_agent: MakeAgent,
    roles: list[str] | None = None,
    parser: ParserSpec = None,
    context: ContextSpec = "full",
    system_prompts: dict[str, str] | None = None,
) -> MultiAgentProtocol:
    """The ``multi_agent`` protocol kind: one agent per role in ``roles`` (the env's agent
    ids), each with its own context."""
    if not roles or not isinstance(roles, list):
        raise ValueError("multi_agent protocol needs kwargs roles=[...] naming the env's agent ids")
    return MultiAgentProtocol({r: make_agent(parser, context) for r in roles}, system_prompts)
