"""FullDialog: keep the whole conversation."""

from __future__ import annotations

from typing import Any

from libludic.context.base import ContextStrategy
from libludic.types import ChatResponse, Message


class FullDialog(ContextStrategy):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Message] = []

    def _reset(self) -> None:
        self.messages = []

    def on_env_reset(self, obs: str, info: dict[str, Any]) -> None:
        self.messages.append({"role": "user", "content": obs})

    def on_before_act(self) -> list[Message]:
        head: list[Message] = []
        if self.system_prompt:
            head.append({"role": "system", "content": self.system_prompt})
        return head + [dict(m) for m in self.messages]  # type: ignore[misc]

    def on_after_act(self, response: ChatResponse) -> None:
        self.messages.append({"role": "assistant", "content": response.text})

    def on_after_step(self, obs: str, info: dict[str, Any]) -> None:
        self.messages.append({"role": "user", "content": obs})

    def add_message(self, message: Message) -> None:
        self.messages.append(message)
