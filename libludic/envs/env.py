"""LudicEnv: the multi-agent environment kernel.

An env exposes ``agent_ids`` (every role) and ``active_agents`` (who acts now).
``reset(seed)`` returns ``{agent_id: (obs, info)}`` for every agent; ``step(actions)``
takes ``{agent_id: action}`` for the active agents and returns
``{agent_id: StepOutcome}`` (for every agent that has something to observe).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from libludic.types import Info, StepOutcome

AgentIDT = TypeVar("AgentIDT")
ObsT = TypeVar("ObsT")
ActionT = TypeVar("ActionT")


class LudicEnv(ABC, Generic[AgentIDT, ObsT, ActionT]):
    @property
    @abstractmethod
    def agent_ids(self) -> list[AgentIDT]: ...

    @property
    @abstractmethod
    def active_agents(self) -> list[AgentIDT]: ...

    @abstractmethod
    def reset(self, seed: int | None = None) -> dict[AgentIDT, tuple[ObsT, Info]]: ...

    @abstractmethod
    def step(self, actions: dict[AgentIDT, ActionT]) -> dict[AgentIDT, StepOutcome]: ...

    @property
    def suggested_system_prompt(self) -> str | None:
        """A system prompt the env recommends to agents (None: no suggestion)."""
        return None

    def close(self) -> None:
        """Release resources (subprocesses, temp dirs)."""
