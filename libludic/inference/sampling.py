"""Sampling parameters sent with every completion request."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.7
    max_tokens: int = 256
    top_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    # keep sampling after the end-of-sequence token until max_tokens (vLLM's ignore_eos; the
    # sampled distribution is unchanged, so logprobs stay those of the policy)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens={self.max_tokens} must be >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1]")

    def to_openai(self) -> dict[str, Any]:
        """Fields of an OpenAI-compatible request body."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        if self.stop is not None:
            out["stop"] = self.stop
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingConfig:
        return cls(**d)
