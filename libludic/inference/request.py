"""What a caller asks of an inference backend: messages, sampling and what to return."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from libludic.inference.sampling import SamplingConfig
from libludic.types import Message


@dataclass(frozen=True)
class ReturnSpec:
    """Which token-level data the backend must return.

    ``for_rl()`` asks for completion token ids and chosen-token logprobs (what the
    losses need), no alternatives (``top_logprobs_k=0``: nothing reads them, and each one
    costs the server a decoded entry per token); ``for_eval()`` only token ids.
    """

    return_token_ids: bool = False
    return_chosen_logprobs: bool = False
    top_logprobs_k: int = 1

    @classmethod
    def for_eval(cls) -> ReturnSpec:
        return cls(return_token_ids=True, return_chosen_logprobs=False)

    @classmethod
    def for_rl(cls) -> ReturnSpec:
        return cls(return_token_ids=True, return_chosen_logprobs=True, top_logprobs_k=0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReturnSpec:
        return cls(**d)


@dataclass
class ChatCompletionRequest:
    messages: list[Message]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    return_spec: ReturnSpec = field(default_factory=ReturnSpec.for_rl)
    model: str | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class InferenceSpec:
    """Per-request inference overrides carried inside a RolloutRequest."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    return_spec: ReturnSpec = field(default_factory=ReturnSpec.for_rl)
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sampling": self.sampling.to_dict(),
            "return_spec": self.return_spec.to_dict(),
            "model": self.model,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InferenceSpec:
        rs = d.get("return_spec")
        return cls(
            sampling=SamplingConfig.from_dict(d.get("sampling") or {}),
            # a missing return_spec means the dataclass default (for_rl), not "return nothing"
            return_spec=ReturnSpec.for_rl() if rs is None else ReturnSpec.from_dict(rs),
            model=d.get("model"),
        )
