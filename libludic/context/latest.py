"""LatestObservation: the model sees the system prompt and the current observation only.

For envs whose observation holds the whole state (a board, a form to fill), the dialog's
history adds tokens without information: each turn's prompt is ``[system, user: latest
obs]``, plus what the agent said and the tools answered since that observation (a tool
call and its result stay until the next env step). Prompts stay the same length however
long the episode, and a turn is the same single-turn prompt a supervised warm start on the
env's observations trains on. The ``latest`` context kind.
"""

from __future__ import annotations

from typing import Any

from libludic.context.base import ContextStrategy
from libludic.types import ChatResponse, Message


class LatestObservation(ContextStrategy):
    def __init__(self) -> None:
        super().__init__()
        self.turn: list[Message] = []  # the latest observation and what followed it

    def _reset(self) -> None:
        self.turn = []

    def on_env_reset(self, obs: str, info: dict[str, Any]) -> None:
        self.turn = [{"role": "user", "content": obs}]

    def on_before_act(self) -> list[Message]:
        head: list[Message] = []
        if self.system_prompt:
            head.append({"role": "system", "content": self.system_prompt})
        return head + [dict(m) for m in self.turn]  # type: ignore[misc]

    def on_after_act(self, response: ChatResponse) -> None:
        self.turn.append({"role": "assistant", "content": response.text})

    def on_after_step(self, obs: str, info: dict[str, Any]) -> None:
        self.turn = [{"role": "user", "content": obs}]

    def add_message(self, message: Message) -> None:
        self.turn.append(message)
