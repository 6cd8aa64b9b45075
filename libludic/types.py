"""Shared data types of the rollout side.

Everything here is plain data: it round-trips through ``to_dict`` / ``from_dict`` into
dicts of str/int/float/bool/list/None, so it can cross a process boundary (Redis, HTTP)
without pickle. The wire codec (msgpack, packed token arrays) lives in
``libludic.transport``; these dicts are its input.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

AgentID = str
Obs = str
Action = str
Info = dict[str, Any]
RolloutStepKey = tuple[str, int]  # (rollout_id, step_index)


class Message(TypedDict):
    """A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``."""

    role: str
    content: str


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class TokenTrace:
    """Token-level record of one model call: exactly what the server saw and sampled.

    ``prompt_token_ids`` is the full state as tokenised by the server (chat template
    applied); ``completion_token_ids`` are the sampled action tokens and
    ``completion_logprobs[i]`` is log pi_old(completion_token_ids[i] | prefix) under the
    policy that sampled it. Training uses these ids as they are (token-in/token-out):
    never a re-tokenisation of the text.

    ``temperature`` is the sampling temperature of the call. The logprobs are those of the
    distribution actually sampled, ``log_softmax(logits / T)`` (T = 0, greedy: untempered,
    as vLLM does), and the trainer recomputes its logprobs at the same temperature, so the
    importance ratio of an on-policy token is exactly 1. None (older records, offline data)
    means 1.0.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float] | None = None
    temperature: float | None = None

    def __post_init__(self) -> None:
        if self.completion_logprobs is not None and len(self.completion_logprobs) != len(
            self.completion_token_ids
        ):
            raise ValueError(
                f"TokenTrace has {len(self.completion_logprobs)} logprobs for "
                f"{len(self.completion_token_ids)} completion tokens; they must align 1:1"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "completion_token_ids": list(self.completion_token_ids),
            "completion_logprobs": (
                None if self.completion_logprobs is None else list(self.completion_logprobs)
            ),
            "temperature": self.temperature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TokenTrace:
        lp, temp = d.get("completion_logprobs"), d.get("temperature")
        return cls(
            prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
            completion_token_ids=[int(t) for t in d["completion_token_ids"]],
            completion_logprobs=None if lp is None else [float(x) for x in lp],
            temperature=None if temp is None else float(temp),
        )


@dataclass
class ChatResponse:
    """Normalised output of one chat completion.

    ``finish_reason`` is ``"stop"`` (EOS or a stop string), ``"length"`` (hit max_tokens)
    or ``"abort"``. ``policy_version`` is the version of the weights that produced every
    token of this completion (the server never mixes versions inside one completion).
    """

    text: str
    finish_reason: str = "stop"
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    policy_version: int | None = None
    tool_calls: list[dict[str, Any]] | None = None
    temperature: float | None = None  # the request's sampling temperature (TokenTrace)

    def trace(self) -> TokenTrace | None:
        if self.prompt_token_ids is None or self.completion_token_ids is None:
            return None
        return TokenTrace(
            prompt_token_ids=list(self.prompt_token_ids),
            completion_token_ids=list(self.completion_token_ids),
            completion_logprobs=(
                None if self.completion_logprobs is None else list(self.completion_logprobs)
            ),
            temperature=self.temperature,
        )


@dataclass
class StepOutcome:
    """What an environment returns for one agent after a step."""

    obs: Obs
    reward: float
    truncated: bool = False
    terminated: bool = False
    info: Info = field(default_factory=dict)


@dataclass
class Step:
    """One agent-environment interaction step.

    ``reward`` is the total reward of the step (env reward plus the parser's format
    reward); ``info`` keeps both apart (``env_reward``, ``parse_reward``) along with
    ``parse_error`` and ``finish_reason``. ``policy_version`` is the version of the
    weights that produced ``action`` (None for steps with no model call).
    """

    index: int
    prev_obs: Obs
    action: Action
    next_obs: Obs | None
    reward: float
    truncated: bool = False
    terminated: bool = False
    info: Info = field(default_factory=dict)
    trace: TokenTrace | None = None
    policy_version: int | None = None
    agent_id: AgentID | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prev_obs": self.prev_obs,
            "action": self.action,
            "next_obs": self.next_obs,
            "reward": float(self.reward),
            "truncated": bool(self.truncated),
            "terminated": bool(self.terminated),
            "info": dict(self.info),
            "trace": None if self.trace is None else self.trace.to_dict(),
            "policy_version": self.policy_version,
            "agent_id": self.agent_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        tr = d.get("trace")
        pv = d.get("policy_version")
        return cls(
            index=int(d["index"]),
            prev_obs=d["prev_obs"],
            action=d["action"],
            next_obs=d.get("next_obs"),
            reward=float(d["reward"]),
            truncated=bool(d.get("truncated", False)),
            terminated=bool(d.get("terminated", False)),
            info=dict(d.get("info") or {}),
            trace=None if tr is None else TokenTrace.from_dict(tr),
            policy_version=None if pv is None else int(pv),
            agent_id=d.get("agent_id"),
        )


@dataclass
class Rollout:
    """One episode seen from one agent: its steps plus metadata.

    ``meta`` carries ``group_id`` (rollouts sampled for the same prompt share it; grouped
    credit assigners normalise within a group), ``request_id``, ``env_seed``,
    ``sampling_seed``, ``agent_id`` and anything the request's meta held.
    """

    id: str = field(default_factory=new_id)
    steps: list[Step] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def group_id(self) -> str | None:
        gid = self.meta.get("group_id")
        return None if gid is None else str(gid)

    @property
    def total_reward(self) -> float:
        return float(sum(s.reward for s in self.steps))

    @property
    def length(self) -> int:
        return len(self.steps)

    @property
    def policy_versions(self) -> list[int | None]:
        return [s.policy_version for s in self.steps]

    @property
    def min_policy_version(self) -> int | None:
        vs = [v for v in self.policy_versions if v is not None]
        return min(vs) if vs else None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "steps": [s.to_dict() for s in self.steps], "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rollout:
        return cls(
            id=str(d["id"]),
            steps=[Step.from_dict(s) for s in d["steps"]],
            meta=dict(d.get("meta") or {}),
        )
