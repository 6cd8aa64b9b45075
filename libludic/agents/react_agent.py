"""ReActAgent: think, optionally call tools, then act.

Each model call must open with ``<think>...</think>``; after it comes either one or more
``<tool_call>{...}</tool_call>`` blocks (tools run, results come back, the agent thinks
again) or the final answer, which goes through the agent's parser. A call that does
not open with a think block ends the turn as a parse failure with feedback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from libludic.agents.tool_agent import ToolAgent
from libludic.context.base import ContextStrategy
from libludic.inference.client import ChatClient
from libludic.inference.request import ReturnSpec
from libludic.inference.sampling import SamplingConfig
from libludic.parsers import Parser, compose_parsers, think_prefix_parser

REACT_SYSTEM_PROMPT = (
    "Think step by step inside <think>...</think>. Then either call a tool with "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or give your final answer.'
)


class ReActAgent(ToolAgent):
    def __init__(
        self,
        client: ChatClient,
        ctx: ContextStrategy | None = None,
        parser: Parser | None = None,
        sampling: SamplingConfig | None = None,
        return_spec: ReturnSpec | None = None,
        model: str | None = None,
        *,
        tools: list[Callable[..., Any]] | None = None,
        max_tool_rounds: int = 4,
        think_error_reward: float = -1.0,
        describe_tools: bool = True,
    ):
        super().__init__(
            client,
            ctx,
            parser,
            sampling,
            return_spec,
            model,
            tools=tools,
            max_tool_rounds=max_tool_rounds,
            describe_tools=describe_tools,
        )
        self.parser = compose_parsers(
            think_prefix_parser(error_reward=think_error_reward), self.parser
        )

    def reset(self, system_prompt: str | None = None) -> None:
        # the think-first format is what the parser enforces, so the model is always told
        super().reset(
            f"{system_prompt}\n\n{REACT_SYSTEM_PROMPT}" if system_prompt else REACT_SYSTEM_PROMPT
        )
