"""ToolAgent: an Agent that may call registered Python tools before it answers.

Tool calls come back either as OpenAI ``tool_calls`` on the response (servers that
parse them) or in the text as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Qwen's format). Each call's arguments are validated against the tool's JSON schema
(derived from its signature) before it runs; the result, or a clear error, goes back
as a ``tool`` message and the model is called again, up to ``max_tool_rounds`` times.
The reply without tool calls is parsed as the action.

The model learns the tools from the system prompt: ``reset()`` appends a section listing
each tool's JSON schema and the ``<tool_call>`` format (not the OpenAI ``tools`` request
field, which vLLM rejects unless the server runs with ``--enable-auto-tool-choice``);
``describe_tools=False`` leaves it out, for a model that learned its tools (a warm start on
tool calls: libludic/sft/tasks.py ``tool_task``) and whose prompts must stay short.
Tools run in a worker thread (``asyncio.to_thread``) so a slow one (the sandboxed
``python`` tool) does not stall the other episodes of the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints

from libludic.agents.base_agent import Agent, AgentTurn, act_result
from libludic.context.base import ContextStrategy
from libludic.inference.client import ChatClient
from libludic.inference.request import ReturnSpec
from libludic.inference.sampling import SamplingConfig
from libludic.parsers import Parser
from libludic.types import ChatResponse, Message

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
}


class ToolArgumentError(ValueError):
    pass


class ToolUnavailable(RuntimeError):
    """A tool that cannot run on this host at all (the ``python`` tool's sandbox refuses to
    run without its confinement): raised out of the episode, never shown to the model as
    one call's failure, so the run fails loudly instead of training on the refusal."""


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        hints = get_type_hints(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        for pname, p in inspect.signature(fn).parameters.items():
            t = hints.get(pname, str)
            if t not in _JSON_TYPES:
                raise TypeError(f"tool {fn.__name__}: parameter {pname} has unsupported type {t}")
            props[pname] = {"type": _JSON_TYPES[t]}
            if p.default is inspect.Parameter.empty:
                required.append(pname)
        schema = {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
        return cls(name or fn.__name__, fn, (fn.__doc__ or "").strip(), schema)

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict):
            raise ToolArgumentError(
                f"{self.name}: arguments must be a JSON object, got {type(args).__name__}"
            )
        props = self.parameters["properties"]
        unknown = sorted(set(args) - set(props))
        if unknown:
            raise ToolArgumentError(
                f"{self.name}: unknown argument(s) {unknown}; expected {sorted(props)}"
            )
        missing = [r for r in self.parameters["required"] if r not in args]
        if missing:
            raise ToolArgumentError(f"{self.name}: missing required argument(s) {missing}")
        for k, v in args.items():
            want = props[k]["type"]
            ok = {
                "integer": isinstance(v, int) and not isinstance(v, bool),
                "number": isinstance(v, (int, float)) and not isinstance(v, bool),
                "string": isinstance(v, str),
                "boolean": isinstance(v, bool),
                "array": isinstance(v, list),
                "object": isinstance(v, dict),
            }[want]
            if not ok:
                raise ToolArgumentError(f"{self.name}: argument {k!r} must be {want}, got {v!r}")
        return args


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it (what ``parse_tool_calls`` reads back)."""
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def tool_result_message(name: str, output: str) -> Message:
    """The message a tool's output goes back to the model in."""
    return {"role": "tool", "content": f"{name}: {output}" if name else f"error: {output}"}


def parse_tool_calls(response: ChatResponse) -> list[tuple[str, Any]]:
    """(name, arguments) pairs from structured tool_calls or ``<tool_call>`` text blocks.

    A block whose JSON cannot be decoded yields ``("", error message)`` so the agent can
    be told what was wrong.
    """
    calls: list[tuple[str, Any]] = []
    for tc in response.tool_calls or []:
        fn = tc.get("function", tc)
        raw = fn.get("arguments", {})
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as e:
            calls.append(("", f"arguments are not valid JSON: {e}"))
            continue
        calls.append((str(fn.get("name", "")), args))
    if calls:
        return calls
    for block in _TOOL_CALL.findall(response.text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(("", f"tool call is not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict):
            calls.append(("", "tool call must be a JSON object with 'name' and 'arguments'"))
            continue
        calls.append((str(obj.get("name", "")), obj.get("arguments", {})))
    return calls


class ToolAgent(Agent):
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
        describe_tools: bool = True,
    ):
        super().__init__(client, ctx, parser, sampling, return_spec, model)
        if not isinstance(describe_tools, bool):
            raise ValueError(f"describe_tools={describe_tools!r} must be true or false")
        # False: the model knows its tools (a warm start taught them): no schema in the prompt
        self.describe_tools = describe_tools
        self.tools: dict[str, Tool] = {}
        for fn in tools or []:
            self.register_tool(fn)
        if max_tool_rounds < 0:
            raise ValueError(f"max_tool_rounds={max_tool_rounds} must be >= 0")
        self.max_tool_rounds = max_tool_rounds

    def register_tool(self, fn: Callable[..., Any], name: str | None = None) -> Tool:
        tool = Tool.from_function(fn, name)
        self.tools[tool.name] = tool
        return tool

    def tools_prompt(self) -> str:
        """The system-prompt section that tells the model which tools exist and how to call them."""
        lines = [
            "You can call these tools. To call one, reply with",
            '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>',
            "and wait for its result; reply without a tool call to give your final answer.",
            "Tools:",
        ]
        lines += [json.dumps(t.openai_schema()["function"]) for t in self.tools.values()]
        return "\n".join(lines)

    def reset(self, system_prompt: str | None = None) -> None:
        if self.tools and self.describe_tools:
            system_prompt = (
                self.tools_prompt()
                if not system_prompt
                else f"{system_prompt}\n\n{self.tools_prompt()}"
            )
        super().reset(system_prompt)

    def run_tool(self, name: str, args: Any) -> str:
        if name not in self.tools:
            return f"error: unknown tool {name!r}; available: {sorted(self.tools)}"
        try:
            valid = self.tools[name].validate(args)
            return str(self.tools[name].fn(**valid))
        except ToolArgumentError as e:
            return f"error: {e}"
        except ToolUnavailable:
            raise
        except Exception as e:  # the tool's own failure is reported to the model, not raised
            return f"error: {name} raised {type(e).__name__}: {e}"

    async def act(self, *, seed: int | None = None) -> tuple[str | None, dict[str, Any]]:
        turns: list[AgentTurn] = []
        for _ in range(self.max_tool_rounds + 1):
            response = await self._call(seed)
            calls = parse_tool_calls(response)
            if not calls or len(turns) == self.max_tool_rounds:
                turns.append(AgentTurn(response))
                break
            tool_msgs: list[Message] = []
            for name, args in calls:
                out = args if name == "" else await asyncio.to_thread(self.run_tool, name, args)
                msg = tool_result_message(name, str(out))
                tool_msgs.append(msg)
                self.ctx.add_message(msg)
            turns.append(AgentTurn(response, tool_msgs))
        return act_result(self.parser(turns[-1].response.text), turns)
