"""Training-side data: rollout requests going in, State-Action-Weight items coming out.

A ``SAWItem`` is one model call seen by the trainer: ``input_ids = state_ids +
action_ids`` exactly as the inference server tokenised and sampled them, an
``action_mask`` (1 on sampled action tokens), the credit ``weight`` and attachments
(the actor's chosen-token logprobs aligned to ``input_ids`` and the policy_version
that sampled the action). Everything round-trips through plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from libludic.inference.request import InferenceSpec
from libludic.types import new_id


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
    the kwargs per kind are in ``libludic.agents.config``. Validated at construction, so a
    bad kind or kwarg fails where the config is read.
    """

    kind: str = "plain"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from libludic.agents.config import validate_agent_config

        validate_agent_config(self.kind, self.kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.kwargs}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentSpec:
        if not isinstance(d, Mapping):
            raise ValueError(f"agent must be a mapping like {{kind: tool, tools: [python]}}; got {d!r}")
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
        if self.num_episodes < 1:
            raise ValueError(f"RolloutRequest.num_episodes={self.num_episodes} must be >= 1")

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


@dataclass
class SampleAttachments:
    """Side data of an item: per-token logprobs aligned with ``SAWItem.input_ids`` (0.0 on
    state tokens), the policy version and the sampling temperature of its action tokens.

    ``temperature``: the trainer computes the item's logprobs as ``log_softmax(logits / T)``,
    the distribution the actor sampled from (and whose logprobs the server returned), so an
    on-policy importance ratio is exactly 1. None or 0 (greedy) means T = 1.
    """

    actor_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    policy_version: int | None = None
    temperature: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "actor_logprobs": None if self.actor_logprobs is None else list(self.actor_logprobs),
            "ref_logprobs": None if self.ref_logprobs is None else list(self.ref_logprobs),
            "policy_version": self.policy_version,
            "temperature": self.temperature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SampleAttachments:
        a, r, v = d.get("actor_logprobs"), d.get("ref_logprobs"), d.get("policy_version")
        t = d.get("temperature")
        return cls(
            actor_logprobs=None if a is None else [float(x) for x in a],
            ref_logprobs=None if r is None else [float(x) for x in r],
            policy_version=None if v is None else int(v),
            temperature=None if t is None else float(t),
        )

    @property
    def train_temperature(self) -> float:
        """The temperature the trainer divides this item's logits by (1.0 for None/0)."""
        t = self.temperature
        return 1.0 if t is None or t <= 0.0 else float(t)


@dataclass
class SAWItem:
    """State-Action-Weight: one training sample.

    input_ids      [T]  state_ids + action_ids (server's ids, never re-tokenised)
    attention_mask [T]  1 on real tokens
    action_mask    [T]  0 on state, 1 on action tokens
    weight              credit from the algorithm's CreditAssigner
    meta                item_id, rollout_id, step_index, group_id, reward, ...
    """

    input_ids: list[int]
    attention_mask: list[int]
    action_mask: list[int]
    weight: float
    meta: dict[str, Any] = field(default_factory=dict)
    attachments: SampleAttachments = field(default_factory=SampleAttachments)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.attention_mask) != n or len(self.action_mask) != n:
            raise ValueError(
                f"SAWItem {self.meta.get('item_id')!r}: input_ids ({n}), attention_mask "
                f"({len(self.attention_mask)}) and action_mask ({len(self.action_mask)}) "
                "must have the same length"
            )
        lp = self.attachments.actor_logprobs
        if lp is not None and len(lp) != n:
            raise ValueError(
                f"SAWItem {self.meta.get('item_id')!r}: actor_logprobs has {len(lp)} entries "
                f"for {n} tokens; align it to input_ids with 0.0 on state tokens"
            )

    @property
    def item_id(self) -> str:
        return str(self.meta.get("item_id", ""))

    @property
    def policy_version(self) -> int | None:
        return self.attachments.policy_version

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.action_mask))

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_ids": list(self.input_ids),
            "attention_mask": list(self.attention_mask),
            "action_mask": list(self.action_mask),
            "weight": float(self.weight),
            "meta": dict(self.meta),
            "attachments": self.attachments.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SAWItem:
        return cls(
            input_ids=[int(t) for t in d["input_ids"]],
            attention_mask=[int(t) for t in d["attention_mask"]],
            action_mask=[int(t) for t in d["action_mask"]],
            weight=float(d["weight"]),
            meta=dict(d.get("meta") or {}),
            attachments=SampleAttachments.from_dict(d.get("attachments") or {}),
        )


@dataclass
class SAWBatch:
    """A macro-batch: the items of one optimizer step plus batch-level stats."""

    items: list[SAWItem]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


@runtime_checkable
class BatchSource(Protocol):
    async def next_batch(self) -> SAWBatch: ...
