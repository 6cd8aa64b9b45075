"""Agents from plain data: ``{kind, **kwargs}``.

A task's ``agent:`` section (feeder YAML -> ``ProtocolSpec.agent`` -> actor) selects the
agent class each protocol builds. ``kind`` is a registered name (entry-point group
``ludic.agents``) or an import path ``pkg.mod:Class`` naming an ``Agent`` subclass; its
constructor takes the Agent's own arguments (:data:`AGENT_ARGS`, supplied by the protocol)
and the spec's kwargs. The built-in kinds:

| kind    | class        | kwargs                                                   |
|---------|--------------|----------------------------------------------------------|
| `plain` | `Agent`      | none                                                     |
| `tool`  | `ToolAgent`  | `tools` (tool kinds: registered names of ``ludic.tools`` or import paths of functions; at least one), `max_tool_rounds` (int >= 0, default 4) |
| `react` | `ReActAgent` | as `tool` (``tools`` may be empty), plus `think_error_reward` (number, default -1.0) |

``validate_agent_config`` runs where the config enters (feeder start-up, ``ludic check``,
the actor's task list), so a typo fails before any episode; ``build_agent`` builds the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from libludic import plugins
from libludic.agents.base_agent import Agent
from libludic.agents.tool_agent import Tool, ToolAgent
from libludic.context.config import ContextSpec, make_context
from libludic.inference.client import ChatClient
from libludic.inference.request import InferenceSpec
from libludic.parsers import ParserSpec, make_parser
from libludic.plugins import PluginError

#: the constructor arguments a protocol supplies to every agent (never a config's kwargs)
AGENT_ARGS = ("client", "ctx", "parser", "sampling", "return_spec", "model")


def resolve_tools(tools: Any, where: str) -> list[Callable[..., Any]]:
    """The functions a ``tools`` list names (registered names or import paths), each
    checked to have a signature a JSON schema can describe."""
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise PluginError(
            f"{where}.tools={tools!r} must be a list of tool kinds; registered: "
            f"{sorted(plugins.registered('tools'))}"
        )
    out = []
    for i, name in enumerate(tools):
        fn = plugins.resolve("tools", name, where=f"{where}.tools[{i}]")
        try:
            Tool.from_function(fn, name.rsplit(":", 1)[-1].rsplit(".", 1)[-1])
        except (TypeError, ValueError) as e:
            raise PluginError(f"{where}.tools[{i}]={name!r}: {e}") from e
        out.append(fn)
    return out


def agent_class(kind: str, where: str = "agent") -> type[Agent]:
    cls = plugins.resolve("agents", kind, where=f"{where}.kind")
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise PluginError(
            f"{where}.kind={kind!r} names {cls!r}, not an Agent subclass "
            "(libludic/agents/base_agent.py)"
        )
    return cls


def validate_agent_config(
    kind: str, kwargs: Mapping[str, Any], where: str = "agent"
) -> dict[str, Any]:
    """Check ``kind`` and its kwargs (tools resolved, numbers typed); returns the kwargs as
    a plain dict. Raises PluginError (a ValueError) naming the bad value and the choices."""
    cls = agent_class(kind, where)
    plugins.check_kwargs(cls, kwargs, where=f"{where} ({kind})", injected=AGENT_ARGS)
    out = dict(kwargs)
    if "tools" in out:
        resolve_tools(out["tools"], where)
    if cls is ToolAgent and not out.get("tools"):
        raise PluginError(
            f"{where} ({kind}) needs tools=[...] (registered: "
            f"{sorted(plugins.registered('tools'))}); use kind: plain for an agent without tools"
        )
    rounds = out.get("max_tool_rounds", 0)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise PluginError(f"{where} ({kind}): max_tool_rounds={rounds!r} must be an integer >= 0")
    ter = out.get("think_error_reward", 0.0)
    if isinstance(ter, bool) or not isinstance(ter, (int, float)):
        raise PluginError(f"{where} ({kind}): think_error_reward={ter!r} must be a number")
    return out


def build_agent(
    kind: str, kwargs: Mapping[str, Any] | None = None, where: str = "agent", **agent_args: Any
) -> Agent:
    """The agent ``kind`` names, built with ``agent_args`` (:data:`AGENT_ARGS`: client, ctx,
    parser, sampling, return_spec, model) and the spec's kwargs, tool kinds resolved to
    functions."""
    kw = validate_agent_config(kind, kwargs or {}, where)
    if "tools" in kw:
        kw["tools"] = resolve_tools(kw["tools"], where)
    agent: Agent = plugins.call(agent_class(kind, where), f"{where} ({kind})", **agent_args, **kw)
    return agent


def inference_args(inference: InferenceSpec | None) -> dict[str, Any]:
    """Agent keyword arguments taken from a request's InferenceSpec."""
    if inference is None:
        return {}
    return {
        "sampling": inference.sampling,
        "return_spec": inference.return_spec,
        "model": inference.model,
    }


class MakeAgent(Protocol):
    """What a protocol factory is given to build its agents: one call, one fresh agent of
    the request's agent kind, with the request's inference settings."""

    def __call__(self, parser: ParserSpec = None, context: ContextSpec = "full") -> Agent: ...


def agent_maker(
    client: ChatClient,
    inference: InferenceSpec | None = None,
    kind: str = "plain",
    kwargs: Mapping[str, Any] | None = None,
    where: str = "agent",
) -> MakeAgent:
    """A :class:`MakeAgent` building agents of ``kind`` (with ``kwargs``) on ``client``."""

    def make(parser: ParserSpec = None, context: ContextSpec = "full") -> Agent:
        return build_agent(
            kind,
            kwargs,
            where,
            client=client,
            ctx=make_context(context),
            parser=make_parser(parser),
            **inference_args(inference),
        )

    return make
