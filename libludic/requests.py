"""What an actor is asked to run: an environment, an interaction protocol (with its agents),
inference overrides, reward functions and how many episodes (``RolloutRequest``). Plain data: every class
round-trips through ``to_dict`` / ``from_dict`` (the wire codec is libludic.transport).
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True)
class RewardFnSpec:
    """One reward function of a task: ``kind`` is a registered name (entry-point group
    ``ludic.rewards``) or an import path; ``weight`` scales its score; ``name`` labels it in
    the step info (default: the kind's last part)."""

    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    name: str = ""

    KEYS = ("kind", "kwargs", "weight", "name")

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"reward function kind={self.kind!r} must be a non-empty string")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"reward function {self.kind}: kwargs must be a mapping")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ValueError(f"reward function {self.kind}: weight={w!r} must be a finite number")
        if not self.name:
            object.__setattr__(self, "name", self.kind.rsplit(":", 1)[-1].rsplit(".", 1)[-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "kwargs": dict(self.kwargs),
            "weight": self.weight,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RewardFnSpec:
        if not isinstance(d, Mapping) or "kind" not in d:
            raise ValueError(f"a reward function is {{kind, kwargs, weight, name}}; got {d!r}")
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"reward function: unknown key(s) {unknown}; known: {list(cls.KEYS)}")
        return cls(
            kind=d["kind"],
            kwargs=dict(d.get("kwargs") or {}),
            weight=d.get("weight", 1.0),
            name=str(d.get("name") or ""),
        )


@dataclass(frozen=True)
class RewardSpec:
    """A task's reward: ``r = env_weight * r_env + sum_i weight_i * f_i(rollout)``.

    Every step's reward (the env's plus the parser's) is scaled by ``env_weight`` and the
    weighted scores of ``functions`` are added to the rollout's last step, so per-step
    rewards keep their place and the total is the formula above (libludic/scoring)."""

    functions: tuple[RewardFnSpec, ...] = ()
    env_weight: float = 1.0

    KEYS = ("functions", "env_weight")

    def __post_init__(self) -> None:
        w = self.env_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ValueError(f"reward env_weight={w!r} must be a finite number")
        names = [f.name for f in self.functions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward functions share the name(s) {dup}; give each its own name:")

    def to_dict(self) -> dict[str, Any]:
        return {"functions": [f.to_dict() for f in self.functions], "env_weight": self.env_weight}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RewardSpec:
        if not isinstance(d, Mapping):
            raise ValueError(
                f"reward must be a mapping {{env_weight, functions: [...]}}; got {d!r}"
            )
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"reward: unknown key(s) {unknown}; known: {list(cls.KEYS)}")
        fns = d.get("functions") or []
        if not isinstance(fns, list):
            raise ValueError(f"reward.functions must be a list; got {fns!r}")
        return cls(
            functions=tuple(RewardFnSpec.from_dict(f) for f in fns),
            env_weight=d.get("env_weight", 1.0),
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
    # reward functions composed with the env's reward (None: the env's alone)
    reward: RewardSpec | None = None

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
            **({} if self.reward is None else {"reward": self.reward.to_dict()}),
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
            reward=None if d.get("reward") is None else RewardSpec.from_dict(d["reward"]),
        )
