"""Agents from plain data: ``{kind: plain|tool|react, **kwargs}``.

A task's ``agent:`` section (feeder YAML -> ``ProtocolSpec.agent`` -> actor) selects the
agent class each protocol builds. Kwargs per kind:

| kind    | class        | kwargs                                                   |
|---------|--------------|----------------------------------------------------------|
| `plain` | `Agent`      | none                                                     |
| `tool`  | `ToolAgent`  | `tools` (names from ``libludic.agents.tools.TOOLS``, at least one), `max_tool_rounds` (int >= 0, default 4) |
| `react` | `ReActAgent` | as `tool` (``tools`` may be empty), plus `think_error_reward` (number, default -1.0) |

``validate_agent_config`` runs where the config enters (feeder start-up, request
decoding), so a typo fails before any episode; ``build_agent`` builds the agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libludic.agents.base_agent import Agent
from libludic.agents.react_agent import ReActAgent
from libludic.agents.tool_agent import ToolAgent
from libludic.agents.tools import TOOLS

AGENT_KINDS: dict[str, type] = {"plain": Agent, "tool": ToolAgent, "react": ReActAgent}
AGENT_KWARGS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "tool": ("tools", "max_tool_rounds"),
    "react": ("tools", "max_tool_rounds", "think_error_reward"),
}


def validate_agent_config(kind: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``kind`` and its kwargs; returns the kwargs as a plain dict.

    Raises ValueError naming the bad value and the valid choices.
    """
    if kind not in AGENT_KINDS:
        raise ValueError(f"agent kind {kind!r} is unknown; valid kinds: {sorted(AGENT_KINDS)}")
    valid = AGENT_KWARGS[kind]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"agent kind {kind!r}: unknown kwarg(s) {unknown}; valid kwargs for {kind!r}: "
            f"{list(valid) or 'none'}"
        )
    out = dict(kwargs)
    if "tools" in valid:
        tools = out.get("tools", [])
        if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            raise ValueError(
                f"agent kind {kind!r}: tools={tools!r} must be a list of tool names; available: {sorted(TOOLS)}"
            )
        bad = [t for t in tools if t not in TOOLS]
        if bad:
            raise ValueError(
                f"agent kind {kind!r}: unknown tool(s) {bad}; available: {sorted(TOOLS)}"
            )
        if kind == "tool" and not tools:
            raise ValueError(
                f"agent kind 'tool' needs tools=[...] (available: {sorted(TOOLS)}); "
                "use kind: plain for an agent without tools"
            )
    rounds = out.get("max_tool_rounds", 4)
    if "max_tool_rounds" in out and (
        isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0
    ):
        raise ValueError(f"agent kind {kind!r}: max_tool_rounds={rounds!r} must be an integer >= 0")
    ter = out.get("think_error_reward", 0.0)
    if isinstance(ter, bool) or not isinstance(ter, (int, float)):
        raise ValueError(f"agent kind {kind!r}: think_error_reward={ter!r} must be a number")
    return out


def build_agent(kind: str, kwargs: Mapping[str, Any] | None = None, **agent_args: Any) -> Agent:
    """``AGENT_KINDS[kind](**agent_args, **kwargs)`` with tool names resolved to functions.

    ``agent_args`` are the Agent constructor's own arguments (client, ctx, parser,
    sampling, return_spec, model).
    """
    kw = validate_agent_config(kind, kwargs or {})
    if "tools" in kw:
        kw["tools"] = [TOOLS[t] for t in kw["tools"]]
    agent: Agent = AGENT_KINDS[kind](**agent_args, **kw)
    return agent
