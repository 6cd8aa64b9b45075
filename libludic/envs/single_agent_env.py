"""SingleAgentEnv: the convenience base for one-agent tasks.

Subclasses implement ``env_reset``, ``env_step`` and ``env_current_obs``; the kernel
methods wrap them under the single agent id ``"agent"``.
"""

from __future__ import annotations

from abc import abstractmethod

from libludic.envs.env import LudicEnv
from libludic.types import Info, Obs, StepOutcome

DEFAULT_AGENT_ID = "agent"


class SingleAgentEnv(LudicEnv[str, str, str]):
    agent_id: str = DEFAULT_AGENT_ID

    @property
    def agent_ids(self) -> list[str]:
        return [self.agent_id]

    @property
    def active_agents(self) -> list[str]:
        return [self.agent_id]

    def reset(self, seed: int | None = None) -> dict[str, tuple[Obs, Info]]:
        return {self.agent_id: self.env_reset(seed=seed)}

    def step(self, actions: dict[str, str]) -> dict[str, StepOutcome]:
        if self.agent_id not in actions:
            raise KeyError(
                f"{type(self).__name__}.step got actions for {sorted(actions)}; "
                f"expected an action for {self.agent_id!r}"
            )
        return {self.agent_id: self.env_step(actions[self.agent_id])}

    @abstractmethod
    def env_reset(self, *, seed: int | None = None) -> tuple[Obs, Info]: ...

    @abstractmethod
    def env_step(self, action: str) -> StepOutcome: ...

    @abstractmethod
    def env_current_obs(self) -> Obs: ...
