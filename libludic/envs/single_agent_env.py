"""SingleAgentEnv: the convenience base for one-agent tasks.

Subclasses implement ``env_reset``, ``env_step`` and ``env_current_obs``; the kernel
methods wrap them under the single agent id ``"agent"``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Dict, List, Optional, Tuple

from libludic.envs.env import LudicEnv
from libludic.types import Info, Obs, StepOutcome

DEFAULT_AGENT_ID = "agent"


class SingleAgentEnv(LudicEnv[str, str, str]):
    agent_id: str = DEFAULT_AGENT_ID

    @property
    def agent_ids(self) -> List[str]:
        return [self.agent_id]

    @property
    def active_agents(self) -> List[str]:
        return [self.agent_id]

    def reset(self, seed: Optional[int] = None) -> Dict[str, Tuple[Obs, Info]]:
        return {self.agent_id: self.env_reset(seed=seed)}

    def step(self, actions: Dict[str, str]) -> Dict[str, StepOutcome]:
        if self.agent_id not in actions:
            raise KeyError(
                f"{type(self).__name__}.step got actions for {sorted(actions)}; "
                f"expected an action for {self.agent_id!r}"
            )
        return {self.agent_id: self.env_step(actions[self.agent_id])}

    @abstractmethod
    def env_reset(self, *, seed: Optional[int] = None) -> Tuple[Obs, Info]: ...

    @abstractmethod
    def env_step(self, action: str) -> StepOutcome: ...

    @abstractmethod
    def env_current_obs(self) -> Obs: ...
