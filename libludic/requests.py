"""What an actor is asked to run: an environment, an interaction protocol (with its agents),
inference overrides and how many episodes (``RolloutRequest``). Plain data: every class
round-trips through ``to_dict`` / ``from_dict`` (the wire codec is libludic.transport).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from libludic.inference.request import InferenceSpec
from libludic.types import new_id

#: the most episodes one request may ask for: the actor lists every episode of a request
#: up front, so a request claiming 2^31 of them would exhaust its memory
MAX_EPISODES = 65536


@dataclass(frozen=True)
class EnvSpec:
    """Which environment to build: ``kind`` is a key of the engine's env registry."""

    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EnvSpec:
        return cls(kind=str(d["kind"]), kwargs=dict(d.get("kwargs") or {}))


@dataclass(frozen=True)
class AgentSpec:
    """Which agent class the protocol builds: ``kind`` is ``plain``, ``tool`` or ``react``.

    Written flat in config (``agent: {kind: tool, tools: [python], max_tool_rounds: 2}``);
    the kwargs per kind are in ``libludic.agents.config``, whose ``validate_agent_config``
    runs where a spec enters: the feeder's start-up, request decoding and agent building.
    """

    kind: str = "plain"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.kwargs}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentSpec:
        if not isinstance(d, Mapping):
            raise ValueError(
                f"agent must be a mapping like {{kind: tool, tools: [python]}}; got {d!r}"
            )
        rest = {k: v for k, v in d.items() if k != "kind"}
        return cls(kind=str(d.get("kind", "plain")), kwargs=rest)


@dataclass(frozen=True)
class ProtocolSpec:
    """Which interaction protocol (and agent) to run: ``kind`` is a protocol registry key.

    ``agent`` (None: a plain Agent) is handed to the protocol factory as ``agent=`` and
    selects the class of every agent the protocol builds.
    """

    kind: str = "single_agent"
    kwargs: dict[str, Any] = field(default_factory=dict)
    agent: AgentSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "kwargs": dict(self.kwargs)}
        if self.agent is not None:
            d["agent"] = self.agent.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProtocolSpec:
        agent = d.get("agent")
        return cls(
            kind=str(d["kind"]),
            kwargs=dict(d.get("kwargs") or {}),
            agent=None if agent is None else AgentSpec.from_dict(agent),
        )


@dataclass
class RolloutRequest:
    """Pure data describing episodes to run; safe to put on a queue.

    ``num_episodes`` episodes run with env seeds ``env_seed + i`` and sampling seeds
    ``sampling_seed + i`` (when given). ``meta["group_id"]`` is copied into every
    resulting rollout: for grouped algorithms, send one request with
    ``num_episodes=group_size`` (same env seed for all, so all see the same prompt) or
    several requests sharing a group id.
    """

    env: EnvSpec
    protocol: ProtocolSpec = field(default_factory=ProtocolSpec)
    env_seed: int | None = None
    sampling_seed: int | None = None
    inference: InferenceSpec | None = None
    num_episodes: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)
    # True: every episode of this request uses env_seed itself (same problem, a group).
    same_env_seed: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_episodes <= MAX_EPISODES:
            raise ValueError(
                f"RolloutRequest.num_episodes={self.num_episodes} must be in [1, {MAX_EPISODES}]; "
                "split a larger batch into several requests"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "env": self.env.to_dict(),
            "protocol": self.protocol.to_dict(),
            "env_seed": self.env_seed,
            "sampling_seed": self.sampling_seed,
            "inference": None if self.inference is None else self.inference.to_dict(),
            "num_episodes": self.num_episodes,
            "meta": dict(self.meta),
            "same_env_seed": self.same_env_seed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RolloutRequest:
        inf = d.get("inference")
        return cls(
            id=str(d["id"]),
            env=EnvSpec.from_dict(d["env"]),
            protocol=ProtocolSpec.from_dict(d.get("protocol") or {"kind": "single_agent"}),
            env_seed=d.get("env_seed"),
            sampling_seed=d.get("sampling_seed"),
            inference=None if inf is None else InferenceSpec.from_dict(inf),
            num_episodes=int(d.get("num_episodes", 1)),
            meta=dict(d.get("meta") or {}),
            same_env_seed=bool(d.get("same_env_seed", False)),
        )
