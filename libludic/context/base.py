"""ContextStrategy: what the agent remembers and what it sends the model.

Hooks, in episode order: ``reset(system_prompt)`` -> ``on_env_reset(obs, info)`` ->
[``on_before_act()`` returns the messages for the next call -> ``on_after_act(response)``
-> ``on_after_step(obs, info)``]*.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from libludic.types import ChatResponse, Message


class ContextStrategy(ABC):
    def __init__(self) -> None:
        self.system_prompt: str | None = None

    def reset(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt
        self._reset()

    @abstractmethod
    def _reset(self) -> None: ...

    @abstractmethod
    def on_env_reset(self, obs: str, info: dict[str, Any]) -> None: ...

    @abstractmethod
    def on_before_act(self) -> list[Message]: ...

    @abstractmethod
    def on_after_act(self, response: ChatResponse) -> None: ...

    @abstractmethod
    def on_after_step(self, obs: str, info: dict[str, Any]) -> None: ...

    def add_message(self, message: Message) -> None:
        """Append an extra message (e.g. a tool result) to the history."""
        raise NotImplementedError(f"{type(self).__name__} does not keep extra messages")
