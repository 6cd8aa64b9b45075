"""Agent = ChatClient + ContextStrategy + Parser.

``act()`` asks the model for one reply and parses it. It returns ``(action, info)`` (the
spec's shape): ``action`` is the parsed action string, or None when the reply failed to
parse; ``info["parsed"]`` is the full ``ParseResult`` (format reward, feedback for the
model); ``info["turns"]`` lists every model call made (one for a plain Agent; a
ToolAgent may make several), each an ``AgentTurn`` with the response (text, token ids,
logprobs, policy_version) and the tool messages it caused; ``info["response"]`` is the
last response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libludic.context.base import ContextStrategy
from libludic.context.full_dialog import FullDialog
from libludic.inference.client import ChatClient
from libludic.inference.request import ChatCompletionRequest, ReturnSpec
from libludic.inference.sampling import SamplingConfig
from libludic.parsers import Parser, ParseResult, identity_parser
from libludic.types import ChatResponse, Message

#: seed offset between successive model calls of one episode (more than any group size)
CALL_SEED_STRIDE = 1 << 20


@dataclass
class AgentTurn:
    """One model call inside ``act()``."""

    response: ChatResponse
    tool_messages: list[Message] = field(default_factory=list)


class Agent:
    def __init__(
        self,
        client: ChatClient,
        ctx: ContextStrategy | None = None,
        parser: Parser | None = None,
        sampling: SamplingConfig | None = None,
        return_spec: ReturnSpec | None = None,
        model: str | None = None,
    ) -> None:
        self.client = client
        self.ctx = ctx if ctx is not None else FullDialog()
        self.parser = parser if parser is not None else identity_parser
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.return_spec = return_spec if return_spec is not None else ReturnSpec.for_rl()
        self.model = model
        self._calls = 0

    def reset(self, system_prompt: str | None = None) -> None:
        self.ctx.reset(system_prompt)
        self._calls = 0

    def on_env_reset(self, obs: str, info: dict[str, Any]) -> None:
        self.ctx.on_env_reset(obs, info)

    def on_after_step(self, obs: str, info: dict[str, Any]) -> None:
        self.ctx.on_after_step(obs, info)

    def _request(self, messages: list[Message], seed: int | None) -> ChatCompletionRequest:
        # Each call of an episode gets its own seed so multi-turn sampling is reproducible:
        # call c of the episode seeded s uses s + c * CALL_SEED_STRIDE. Episodes of a group
        # have consecutive seeds, so their calls of one turn do too, and a client may send a
        # turn the whole group shares (same messages) as one n-choice request
        # (libludic/inference/openai_client.py: coalescing).
        call_seed = None if seed is None else seed + self._calls * CALL_SEED_STRIDE
        self._calls += 1
        return ChatCompletionRequest(
            messages=messages,
            sampling=self.sampling,
            return_spec=self.return_spec,
            model=self.model,
            seed=call_seed,
        )

    async def _call(self, seed: int | None) -> ChatResponse:
        messages = self.ctx.on_before_act()
        response, _ = await self.client.complete(self._request(messages, seed))
        self.ctx.on_after_act(response)
        return response

    async def act(self, *, seed: int | None = None) -> tuple[str | None, dict[str, Any]]:
        response = await self._call(seed)
        return act_result(self.parser(response.text), [AgentTurn(response)])


def act_result(parsed: ParseResult, turns: list[AgentTurn]) -> tuple[str | None, dict[str, Any]]:
    """``(action, info)`` as ``Agent.act`` returns it (see the module doc)."""
    return parsed.action, {"parsed": parsed, "turns": turns, "response": turns[-1].response}
