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
    # sample among the k most likely tokens only (None: all; AReaL's default 1e8 means the same)
    top_k: int | None = None
    # generation also ends when one of these token ids is sampled (it is kept, like EOS)
    stop_token_ids: tuple[int, ...] | None = None
    # keep sampling after the end-of-sequence token until max_tokens (vLLM's ignore_eos; the
    # sampled distribution is unchanged, so logprobs stay those of the policy)
    ignore_eos: bool = False
    # False: the text keeps special tokens (chat-template markers, an EOS sampled under
    # ignore_eos) as their strings; a stop token ending the completion is never in the text
    skip_special_tokens: bool = True
    # no end-of-sequence or stop token id before this many tokens (vLLM's min_tokens, AReaL's
    # min_new_tokens): their logits are masked, so the logprobs are of that distribution
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens={self.max_tokens} must be >= 1")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise ValueError(
                f"SamplingConfig.min_tokens={self.min_tokens!r} must be an integer in "
                f"[0, max_tokens={self.max_tokens}]"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(
                f"SamplingConfig.top_k={self.top_k!r} must be an integer >= 1 or None (all tokens)"
            )
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(
                    f"SamplingConfig.stop_token_ids={list(ids)!r} must be token ids (integers >= 0)"
                )
            object.__setattr__(self, "stop_token_ids", ids or None)

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
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False  # vLLM's extension, default True
        if self.top_k is not None:
            out["top_k"] = self.top_k  # vLLM's extension of the OpenAI body
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens  # vLLM's extension of the OpenAI body
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.stop_token_ids is not None:
            d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingConfig:
        return cls(**d)
