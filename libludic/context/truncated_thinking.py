"""TruncatedThinkingContext: full dialog, but old ``<think>`` blocks are cut short.

Past assistant turns keep at most ``max_thinking_chars`` characters of each
``<think>...</think>`` block (followed by ``placeholder``); the latest assistant turn
is kept whole. This bounds the prompt of long multi-turn episodes while keeping
every action the agent took.
"""

from __future__ import annotations

import re

from libludic.context.full_dialog import FullDialog
from libludic.types import Message

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


class TruncatedThinkingContext(FullDialog):
    def __init__(self, max_thinking_chars: int = 0, placeholder: str = "...") -> None:
        super().__init__()
        if max_thinking_chars < 0:
            raise ValueError(f"max_thinking_chars={max_thinking_chars} must be >= 0")
        self.max_thinking_chars = max_thinking_chars
        self.placeholder = placeholder

    def _truncate(self, text: str) -> str:
        def cut(m: re.Match[str]) -> str:
            body = m.group(1)
            if len(body) <= self.max_thinking_chars:
                return m.group(0)
            return f"<think>{body[: self.max_thinking_chars]}{self.placeholder}</think>"

        return _THINK.sub(cut, text)

    def on_before_act(self) -> list[Message]:
        msgs = super().on_before_act()
        last_assistant = max(
            (i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1
        )
        return [
            {"role": m["role"], "content": self._truncate(m["content"])}
            if m["role"] == "assistant" and i != last_assistant
            else m
            for i, m in enumerate(msgs)
        ]
