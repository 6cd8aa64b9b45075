"""The kinds a RolloutRequest names, resolved for one ChatClient.

``build_registries(client)`` returns the RolloutEngine's three registries: env kind ->
env factory, protocol kind -> protocol factory, reward kind -> reward function builder.
They are read-only mappings over libludic.plugins: a kind is a registered short name
(entry-point groups ``ludic.envs``, ``ludic.protocols``, ``ludic.rewards``; the built-in
kinds are registered the same way, in libludic's pyproject) or an import path
``pkg.mod:Name``. Iterating one lists its registered names.

A protocol factory of a plugin is called as ``kind(make_agent, **kwargs)``:
``make_agent(parser, context)`` builds one agent of the request's agent kind
(``ProtocolSpec.agent``; none: a plain Agent) on ``client`` with the request's inference
settings (libludic/agents/config.py). The registry wraps it into the engine's contract,
``factory(inference=..., agent=..., **kwargs)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from libludic import plugins
from libludic.agents.config import agent_maker
from libludic.inference.client import ChatClient
from libludic.inference.request import InferenceSpec
from libludic.interaction.base import InteractionProtocol
from libludic.plugins import PluginError
from libludic.requests import AgentSpec, RewardFnSpec
from libludic.rollout.engine import EnvFactory, ProtocolFactory
from libludic.scoring.base import ScoreFn, build_reward_fn


class PluginRegistry(Mapping[str, Any]):
    """kind -> ``wrap(kind, resolved object)`` over one plugin group. A kind that does not
    resolve raises KeyError with the resolver's message (the choices, the nearest name)."""

    def __init__(self, group: str, wrap: Callable[[str, Any], Any] | None = None) -> None:
        self.group = group
        self.wrap = wrap
        self._cache: dict[str, Any] = {}

    def __getitem__(self, kind: str) -> Any:
        if kind not in self._cache:
            try:
                target = plugins.resolve(self.group, kind)
            except PluginError as e:
                raise KeyError(str(e)) from e
            self._cache[kind] = target if self.wrap is None else self.wrap(kind, target)
        return self._cache[kind]

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str) and (
            kind in plugins.registered(self.group) or plugins.is_import_path(kind)
        )

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(plugins.registered(self.group)))

    def __len__(self) -> int:
        return len(plugins.registered(self.group))


def default_env_registry() -> PluginRegistry:
    """env kind -> env factory (every registered env, and any import path)."""
    return PluginRegistry("envs")


def protocol_factory(client: ChatClient, kind: str, target: Any) -> ProtocolFactory:
    """The engine's ``factory(inference=, agent=, **kwargs)`` for a plugin's
    ``target(make_agent, **kwargs)``."""
    where = f"protocol ({kind})"

    def factory(
        inference: InferenceSpec | None = None, agent: AgentSpec | None = None, **kwargs: Any
    ) -> InteractionProtocol:
        plugins.check_kwargs(target, kwargs, where=where, injected=("make_agent",))
        spec = agent if agent is not None else AgentSpec()
        make = agent_maker(client, inference, spec.kind, spec.kwargs)
        proto = plugins.call(target, where, make_agent=make, **kwargs)
        if not isinstance(proto, InteractionProtocol):
            raise PluginError(
                f"{where} built a {type(proto).__name__}, not an InteractionProtocol "
                "(libludic/interaction/base.py)"
            )
        return proto

    return factory


def build_registries(
    client: ChatClient,
) -> tuple[Mapping[str, EnvFactory], Mapping[str, ProtocolFactory], Mapping[str, Any]]:
    """(envs, protocols, rewards) for ``client``: ``RolloutEngine(*build_registries(c))``.

    ``rewards[kind](spec)`` builds the scoring function of a RewardFnSpec, given ``client``
    when it takes one (an LLM judge on the run's own inference)."""

    def reward_builder(kind: str, target: Any) -> Callable[[RewardFnSpec], ScoreFn]:
        return lambda spec: build_reward_fn(spec, client)

    return (
        default_env_registry(),
        PluginRegistry("protocols", lambda kind, t: protocol_factory(client, kind, t)),
        PluginRegistry("rewards", reward_builder),
    )
