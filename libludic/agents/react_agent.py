"""ReActAgent: think, optionally call tools, then act.

Each model call must open with ``<think>...</think>``; after it comes either one or more
``<tool_call>{...}</tool_call>`` blocks (tools run, results come back, the agent thinks
again) or the final answer, which goes through the agent's parser. A call that does
not open with a think block ends the turn as a parse failure with feedback.
"""

from __future__ import annotations

from typing import Any

from libludic.agents.tool_agent import ToolAgent
from libludic.parsers import compose_parsers, think_prefix_parser

REACT_SYSTEM_PROMPT = (
    "Think step by step inside <think>...</think>. Then either call a tool with "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or give your final answer.'
)


class ReActAgent(ToolAgent):
    def __init__(self, *args: Any, think_error_reward: float = -1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parser = compose_parsers(
            think_prefix_parser(error_reward=think_error_reward), self.parser
        )

    def reset(self, system_prompt: str | None = None) -> None:
        # the think-first format is what the parser enforces, so the model is always told
        super().reset(
            f"{system_prompt}\n\n{REACT_SYSTEM_PROMPT}" if system_prompt else REACT_SYSTEM_PROMPT
        )
