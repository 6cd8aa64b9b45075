"""The single-agent loop: reset, then act/step until the env ends or max_steps."""

from __future__ import annotations

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


class SingleAgentSyncProtocol(InteractionProtocol):
    def __init__(
        self, agent: Agent, stop_on_parse_error: bool = False, system_prompt: str | None = None
    ):
        self.agent = agent
        self.stop_on_parse_error = stop_on_parse_error
        self.system_prompt = system_prompt

    async def run(
        self,
        env: LudicEnv[Any, Any, Any],
        *,
        max_steps: int,
        env_seed: int | None = None,
        sampling_seed: int | None = None,
    ) -> list[Rollout]:
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps} must be >= 1")
        if len(env.agent_ids) != 1:
            raise ValueError(
                f"SingleAgentSyncProtocol needs a one-agent env; {type(env).__name__} has agents "
                f"{env.agent_ids}: use MultiAgentProtocol"
            )
        agent_id = env.agent_ids[0]
        obs, info = env.reset(seed=env_seed)[agent_id]
        self.agent.reset(
            self.system_prompt if self.system_prompt is not None else env.suggested_system_prompt
        )
        self.agent.on_env_reset(obs, info)
        steps: list[Step] = []
        ended = False
        for _ in range(max_steps):
            try:
                _action, ainfo = await self.agent.act(seed=sampling_seed)
            except ContextLengthExceeded:
                if not steps:  # the first prompt does not fit: the task's, not the episode's
                    raise
                truncate(steps[-1], "context_length")
                ended = True
                break
            parsed = ainfo["parsed"]
            turns = ainfo["turns"]
            steps.extend(tool_steps(turns, len(steps), obs, agent_id))
            final = turns[-1]
            prev_obs = obs if len(turns) == 1 else steps[-1].next_obs or obs
            sinfo = action_info(parsed, final)
            if parsed.action is None:
                feedback = parsed.obs or "Invalid format."
                sinfo["env_reward"] = 0.0
                steps.append(
                    Step(
                        len(steps),
                        prev_obs,
                        final.response.text,
                        feedback,
                        parsed.reward,
                        info=sinfo,
                        trace=final.response.trace(),
                        policy_version=final.response.policy_version,
                        agent_id=agent_id,
                    )
                )
                self.agent.on_after_step(feedback, {})
                obs = feedback
                if self.stop_on_parse_error:
                    truncate(steps[-1], "parse_error")
                    ended = True
                    break
                continue
            out = (await step_env(env, {agent_id: parsed.action}))[agent_id]
            sinfo.update(out.info)
            sinfo["env_reward"] = out.reward
            steps.append(
                Step(
                    len(steps),
                    prev_obs,
                    final.response.text,
                    out.obs,
                    out.reward + parsed.reward,
                    truncated=out.truncated,
                    terminated=out.terminated,
                    info=sinfo,
                    trace=final.response.trace(),
                    policy_version=final.response.policy_version,
                    agent_id=agent_id,
                )
            )
            if out.terminated or out.truncated:
                ended = True
                break
            self.agent.on_after_step(out.obs, out.info)
            obs = out.obs
        if not ended and steps:
            truncate(steps[-1], "max_steps")
        return [Rollout(steps=steps, meta={"agent_id": agent_id})]


def single_agent(
    make_agent: MakeAgent,
    parser: ParserSpec = None,
    context: ContextSpec = "full",
    system_prompt: str | None = None,
    stop_on_parse_error: bool = False,
) -> SingleAgentSyncProtocol:
    """The ``single_agent`` protocol kind: one agent (``parser`` and ``context`` as plain
    data, libludic/parsers.py and libludic/context/config.py) plays a one-agent env."""
    return SingleAgentSyncProtocol(make_agent(parser, context), stop_on_parse_error, system_prompt)
